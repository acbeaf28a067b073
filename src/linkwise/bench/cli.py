"""``linkwise bench <test> [flags]``: flags and orchestration.

Tests: ``p2p`` (OSU-style latency, bandwidth, bidirectional bandwidth between ranks 0 and 1)
and the collectives (nccl-tests' flags and columns). Two ways to run:

* not under a launcher (LINKWISE_RANK unset, a single process): this process starts ``-N``
  ranks itself (:mod:`.spawn`), then, for ``--compare mpi``, a second launch with mpirun right
  after; each repetition (``--reps``) repeats both launches, and the tables show medians;
* under a launcher (``linkwise launch -n 2 -m linkwise.cli bench all_reduce``, torchrun,
  mpirun, ...): every rank runs the sweep in place and rank 0 prints (and, for ``--compare
  mpi`` outside mpirun, starts mpirun itself once the others are done); ``-N`` other than the
  launcher's number of ranks is refused (status 2), except under a launcher of one rank,
  where ``-N`` asks bench to start that many itself.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from . import common, compare, report

TESTS = ("p2p",) + common.COLLECTIVES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("test", choices=TESTS, help="p2p, or a collective as in nccl-tests")
    p.add_argument("-b", "--minbytes", default=None,
                   help="smallest size (default 1 for p2p, 8; p2p sizes start at 1)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=float, default=None,
                   help="multiply the size by this (default 2, or 1 when -i is given); 1: add "
                        "-i instead; below 1: an error")
    p.add_argument("-i", "--stepbytes", default=None,
                   help="size step when -f is 1 (default 1M; at least 1 byte when -e > -b); "
                        "-i without -f steps by it, as in nccl-tests. A sweep has at most "
                        f"{common.MAX_SIZES} sizes")
    p.add_argument("-n", "--iters", type=int, default=None,
                   help="timed iterations (default 20). p2p: round trips for latency (default "
                        "10000; at least 10, fewer for large sizes), a tenth as many windows "
                        "for bw and bibw (at least 10; for large sizes fewer, down to 5)")
    p.add_argument("-w", "--warmup_iters", type=int, default=None,
                   help="untimed warm-up iterations (default 5; p2p 200). Collectives: the "
                        "first call, which finds out whether the system has that form and sets "
                        "up its connections, counts as one, so -w 0 still makes that one call; "
                        "p2p warms up with at least 2 round trips (1 window for bw, bibw)")
    p.add_argument("-c", "--check", type=int, default=1,
                   help="check count, as nccl-tests': N runs each variant N more times on "
                        "fresh inputs (other values each time) and counts wrong elements, up "
                        "to the first of them that finds some (default 1); 0: no checks. p2p: "
                        "any N counts the wrong bytes received in each size's timed rounds")
    p.add_argument("-d", "--datatype", default=None,
                   help=f"{', '.join(common.DTYPES)} or all (default float). linkwise cannot "
                        "reduce uint32, uint64: all_reduce, reduce, reduce_scatter show their "
                        "rows n/a, and with no other type refuse to start; p2p refuses -d")
    p.add_argument("-o", "--op", default=None,
                   help=f"{', '.join(common.OPS + common.BITWISE_OPS)}, or all = nccl-tests' "
                        f"{','.join(common.OPS)} (default sum). The bitwise ops take "
                        f"{', '.join(common.BITWISE_TYPES)}: with -d all their floating-point "
                        "rows show n/a; with floating-point types only it is an error; p2p "
                        "refuses -o")
    p.add_argument("-r", "--root", type=int, default=None,
                   help="root of broadcast and reduce (a rank of the job; default 0); the other "
                        "collectives ignore it, as nccl-tests does; p2p refuses it")
    p.add_argument("-N", "--nranks", type=int, default=None,
                   help="ranks to start (default 2; at most 16 a CPU when bench starts them, a "
                        "launcher may start more); under a launcher the launcher's ranks run the "
                        "sweep in place, and -N other than their number is an error, unless it "
                        "started only this one and -N asks for more. "
                        "Not nccl-tests' -N (run cycles): --reps repeats the sweep")
    p.add_argument("--tests", default="latency,bw,bibw", help="p2p: which of latency,bw,bibw")
    p.add_argument("--window", type=int, default=64, help="p2p: messages in flight for bw/bibw")
    p.add_argument("--compare", default="", help="other systems to run the same sweep: gloo,mpi "
                   "(CPU) or nccl (torch.distributed), nccl-cupy (NCCL called directly) "
                   "(--device cuda)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: NumPy buffers; cuda: torch CUDA tensors, one GPU per rank, timed "
                        "with CUDA events")
    p.add_argument("--graph", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                   help="--device cuda: time -n ops captured in one CUDA graph, replayed (every "
                        "system alike); 'both': eager and graph sweeps in the same processes, "
                        "two tables; default: eager back-to-back calls only")
    p.add_argument("--reps", type=int, default=1,
                   help="repeat the whole sweep (every system, alternating; at least 1); "
                   "report medians (#wrong: the largest count of any repetition)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw and time against size "
                   "(needs matplotlib; the extension picks the format: .png, .pdf, .svg, ...)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--mpirun-args", default="", help="extra mpirun arguments for --compare mpi, "
                   "split as the shell splits them (quote an argument that holds spaces)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds for each launch (default 900; a positive number)")


def _normalise(args) -> list[str]:
    """Fill test-dependent defaults; returns the compared systems (validated)."""
    if args.test == "p2p":  # it moves bytes between ranks 0 and 1: say so rather than ignore
        given = [flag for flag, v in (("-d", args.datatype), ("-o", args.op), ("-r", args.root))
                 if v is not None]
        if given:
            raise ValueError(f"{' '.join(given)}: p2p moves bytes between ranks 0 and 1, without "
                             "a type, an op or a root; the sendrecv test takes -d")
    args.datatype = "float" if args.datatype is None else args.datatype
    args.op = "sum" if args.op is None else args.op
    args.root = 0 if args.root is None else args.root
    if args.minbytes is None:
        args.minbytes = "1" if args.test == "p2p" else "8"
    lo, hi = common.parse_size(args.minbytes, "-b"), common.parse_size(args.maxbytes, "-e")
    if args.stepfactor is None:  # nccl-tests' -f defaults to 1, so -i alone steps by bytes
        args.stepfactor = 1.0 if args.stepbytes is not None else 2.0
    if args.stepbytes is None:
        args.stepbytes = "1M"
    step = common.parse_size(args.stepbytes, "-i")
    common.sweep(lo, hi)  # -e < -b
    if args.test == "p2p" and hi < 1:  # its sizes start at 1 byte (runner.plan)
        raise ValueError(f"-e {args.maxbytes}: p2p measures messages of 1 byte or more")
    f = args.stepfactor
    if not (1 <= f < float("inf")):  # also NaN
        raise ValueError(f"-f {f:g}: the size factor must be at least 1 (1: step by -i bytes)")
    if f <= 1 and step < 1 and hi > lo:
        raise ValueError(f"-i {args.stepbytes}: with -f 1 sizes grow by -i bytes; need at least 1")
    count = common.sweep_count(lo, hi, f, step)
    if count > common.MAX_SIZES:
        how = f"-i {args.stepbytes}" if f <= 1 else f"-f {f}"
        many = f"{count}" if f <= 1 else f"more than {common.MAX_SIZES}"
        raise ValueError(f"{how}: {many} sizes from -b {args.minbytes} to -e {args.maxbytes}; "
                         f"a sweep has at most {common.MAX_SIZES} (a larger step, or -f 2)")
    if args.test == "p2p":
        from .p2p import TESTS as P2P_TESTS
        tests = [t.strip() for t in args.tests.split(",") if t.strip()]
        unknown = [t for t in tests if t not in P2P_TESTS]
        if unknown or not tests:
            raise ValueError(f"--tests {args.tests!r}: expected one or more of {','.join(P2P_TESTS)}"
                             + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        args.tests = ",".join(tests)  # as the runner splits it
        if args.window < 1:
            raise ValueError(f"--window {args.window}: need at least 1 message in flight")
    if args.check < 0:
        raise ValueError(f"-c {args.check}: 0 (no checks) or at least 1")
    if args.nranks is not None and args.nranks < 1:
        raise ValueError(f"-N {args.nranks}: need at least 1 rank")
    if args.iters is not None and args.iters < 1:
        raise ValueError(f"-n {args.iters}: need at least 1 timed iteration")
    if args.warmup_iters is not None and args.warmup_iters < 0:
        raise ValueError(f"-w {args.warmup_iters}: must be >= 0")
    if args.reps < 1:
        raise ValueError(f"--reps {args.reps}: need at least 1 sweep")
    if not 0 < args.timeout < float("inf"):  # also NaN, which never ran out
        raise ValueError(f"--timeout {args.timeout:g}: give seconds, a positive finite number")
    _check_outputs(args)
    common.check_plan(args.test, common.resolve_dtypes(args.datatype), common.resolve_ops(args.op))
    try:
        shlex.split(args.mpirun_args)  # as compare.mpirun_command splits it
    except ValueError as exc:  # an unclosed quote
        raise ValueError(f"--mpirun-args {args.mpirun_args!r}: {exc}") from None
    others = [s.strip() for s in args.compare.split(",") if s.strip()]
    for s in others:
        if s not in compare.SYSTEMS:
            raise ValueError(f"--compare: unknown system {s!r}; expected {', '.join(compare.SYSTEMS)}")
    device = getattr(args, "device", "cpu")
    if device == "cuda" and args.test == "p2p":
        raise ValueError("--device cuda: use the sendrecv test for GPU point-to-point")
    if device == "cuda":
        from ..cuda.gpu_comm import unavailable_reason
        why = unavailable_reason()
        if why:  # say it once here rather than as a traceback from every rank
            raise ValueError(f"--device cuda: {why}")
    for s in others:
        gpu_sys = s.startswith("nccl")
        if gpu_sys != (device == "cuda"):
            raise ValueError(f"--compare {s} needs --device {'cuda' if gpu_sys else 'cpu'}")
    if getattr(args, "graph", "off") not in ("off", False, None) and device != "cuda":
        raise ValueError("--graph needs --device cuda")
    return others


def _check_outputs(args) -> None:
    """--json and --plot, before any rank starts, so that a sweep is never run only to fail
    writing: a file in a writable directory (not a directory), and for --plot an importable
    matplotlib that writes that extension. Writing can still fail later (disk full, pgf
    without LaTeX): then _write_outputs says so in one line and the status is non-zero."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if not path:
            continue
        where = os.path.dirname(os.path.abspath(path))
        if not (os.path.isdir(where) and os.access(where, os.W_OK | os.X_OK)):
            raise ValueError(f"{flag} {path}: {where} is not a writable directory")
        if os.path.isdir(path):
            raise ValueError(f"{flag} {path}: is a directory; give a file name in it")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path}: the file is not writable")
    if args.plot:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            raise ValueError(f"--plot {args.plot}: needs matplotlib (pip install matplotlib)") from None
        kinds = sorted(FigureCanvasBase.get_supported_filetypes())
        ext = os.path.splitext(args.plot)[1][1:].lower()
        if ext not in kinds:
            raise ValueError(f"--plot {args.plot}: matplotlib cannot write "
                             f"{'.' + ext + ' files' if ext else 'a file without an extension'}; "
                             f"use one of {', '.join('.' + k for k in kinds)}")


def _check_ranks(args, nranks: int) -> None:
    """Checks that need the job's size: -N, or the launcher's when started under one. -r only
    for the collectives with a root (nccl-tests ignores it for the others)."""
    if args.test == "p2p" and nranks < 2:
        raise ValueError("p2p needs -N 2 or more")
    if args.test in common.HAS_ROOT and not 0 <= args.root < nranks:
        raise ValueError(f"-r {args.root} is not a rank of {nranks}")


def _check_tunables(device: str, spawning: bool) -> None:
    """The LINKWISE_* variables the ranks will read, parsed here: a value the library refuses
    is one line (ValueError naming it) before any rank starts, instead of a traceback from
    every rank once init() or the first collective reads it. Not those spawn.launch_ranks
    sets in the ranks it starts (`spawning`: the values here never reach them), and the GPU
    plane's only for --device cuda (a CPU sweep never reads them)."""
    from .. import config
    from .spawn import RANK_VARIABLES
    skip = set(RANK_VARIABLES) if spawning else set()
    if device != "cuda":
        skip.update(name for name in config.TUNABLES if name.startswith(config.READ_BY_GPU_PLANE))
    error = config.first_invalid(("LINKWISE_",), skip)
    if error:
        raise ValueError(error)


SPAWN_PER_CPU = 16  # ranks bench starts itself, at most, for each CPU it may run on


def _check_spawn_count(nranks: int) -> None:
    """-N when bench starts the ranks itself: a typo such as -N 1000 would start that many
    processes, each spinning while it waits. 8 ranks on 2 CPUs is a fair test of
    oversubscription; past 16 a CPU the run measures the scheduler. A launcher can start more."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nranks > SPAWN_PER_CPU * cpus:
        raise ValueError(f"-N {nranks}: more than {SPAWN_PER_CPU} ranks for each of the {cpus} "
                         "CPUs this process may use; start them with a launcher (linkwise launch "
                         "-n N -m linkwise.cli bench ...) if that is meant")


def _command(args) -> str:
    """The command as typed, for the JSON: every argument after ``bench`` (options may come
    before the test's name), or this module's own arguments when run as ``python -m``."""
    argv = sys.argv[1:]
    if "bench" in argv:
        argv = argv[argv.index("bench") + 1:]
    elif args.test not in argv:  # called from Python (main(argv)): only the name is known
        argv = [args.test]
    return "linkwise bench " + " ".join(shlex.quote(a) for a in argv)


def _args_json(args) -> str:
    return json.dumps({k: v for k, v in vars(args).items() if not callable(v)})


def _finish(doc: dict, args) -> int:
    """Print the table (--graph both: the eager one, then the graph one), write --json and
    --plot, and give the exit status. A reader of stdout that goes away (`| head`) ends the
    tables, not the files: its BrokenPipeError is raised once they are written, for
    linkwise.cli's quiet end."""
    graph = [k for k in doc["systems"] if k.endswith(GRAPH_SUFFIX)]
    for s in doc["systems"].values():
        if s.get("status") == "ok":
            s["rows"] = report.median_rows(s.get("runs", []), doc["test"], doc["nranks"])
    parts = [dict(doc, systems={k: v for k, v in doc["systems"].items() if k not in graph})]
    if graph:  # the same sweep captured in CUDA graphs, same processes, same run
        parts.append(dict(doc, systems={k[:-len(GRAPH_SUFFIX)]: doc["systems"][k] for k in graph}))
    gone = None
    try:
        for k, part in enumerate(parts):
            if k:
                print("# --- the same sweep captured in CUDA graphs ---")
            report.print_doc(part, sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError as exc:
        gone = exc
    written = _write_outputs(doc, args, plot=not graph)
    rc = max([written] + [_status(part) for part in parts])
    if gone is not None:
        raise gone
    return rc


def _status(doc: dict) -> int:
    """The exit status one table's systems give (2: linkwise has no such test and nothing was
    measured; 1: wrong elements or a failed system), saying on stderr what the table does not."""
    coll = doc["test"]
    measured = [s for s in doc["systems"].values() if s.get("status") == "ok"]
    lw = doc["systems"].get("linkwise", {})
    if lw.get("status") == "not available" and not measured:
        print(f"linkwise bench {coll}: {lw.get('reason')}", file=sys.stderr)
        return 2
    wrong = {name: _wrong_count(s.get("rows", []), coll)
             for name, s in doc["systems"].items() if s.get("status") == "ok"}
    for name, count in wrong.items():
        if count and name != "linkwise":  # the table's own count is linkwise's
            print(f"linkwise bench {coll}: {name} gave {count} wrong elements (rows in --json)", file=sys.stderr)
    failed = any(s.get("status") == "failed" for s in doc["systems"].values())  # told on stderr
    return 1 if any(wrong.values()) or failed else 0


def _wrong_count(rows: list[dict], test: str) -> int:
    """Wrong elements over a system's rows: both variants of a collective, a p2p row's bytes."""
    if test == "p2p":
        return sum(r.get("wrong") or 0 for r in rows)
    return sum((c.get("wrong") or 0) for r in rows for c in (r.get("oop", {}), r.get("ip", {}))
               if isinstance(c, dict))


def _write_outputs(doc: dict, args, plot: bool = True) -> int:
    """Write --json and --plot; 0, or 1 after one line on stderr per output that failed."""
    rc = 0
    if args.json:
        try:
            report.write_json(doc, args.json)
        except OSError as exc:
            print(f"linkwise bench: --json {args.json}: {exc.strerror or exc}", file=sys.stderr)
            rc = 1
    if args.plot and plot:
        try:
            if not report.plot(doc, args.plot):
                print(f"linkwise bench: --plot {args.plot} not written: no measured point of "
                      "more than 0 bytes to plot", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - matplotlib raises many kinds; one line each
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"linkwise bench: --plot {args.plot}: {why}", file=sys.stderr)
            rc = 1
    return rc


GRAPH_SUFFIX = " [graph]"


def _merge(doc: dict, part: dict) -> None:
    for name, s in part["systems"].items():
        mine = doc["systems"].setdefault(name, {k: v for k, v in s.items() if k != "runs"} | {"runs": []})
        mine["runs"].extend(s.get("runs", []))


def _mpi_part(nranks: int, args_json: str, args) -> dict:
    """The MPI sweep, a second launch under mpirun: its result document, or {"status":
    "failed", "reason"} (the whole error on stderr) when mpirun failed or timed out, so that
    the other systems' results are still printed and written."""
    from . import spawn
    try:
        part = spawn.launch_mpi(nranks, args_json, args.timeout, args.mpirun_args)
    except (spawn.LaunchError, OSError, ValueError) as exc:  # ValueError: LINKWISE_LAUNCH_CPUS
        print(f"linkwise bench: --compare mpi: {exc}", file=sys.stderr)
        return {"status": "failed", "reason": str(exc).splitlines()[0].rstrip(":")}
    part["systems"]["mpi"]["how"] = spawn.mpi_how(nranks, args.mpirun_args)
    return part


def _self_launched(args, others: list[str]) -> int:
    from . import spawn
    systems = ["linkwise"] + [s for s in others if s != "mpi"]
    doc = {"test": args.test, "nranks": args.nranks, "machine": report.machine(),
           "command": _command(args),
           "systems": {}}
    one_rep = json.dumps(json.loads(_args_json(args)) | {"reps": 1})
    why_not = compare.missing("mpi") if "mpi" in others else None
    mpi_out = {"status": "skipped", "reason": why_not} if why_not else None  # else measured
    for _ in range(max(1, args.reps)):
        _merge(doc, spawn.launch_ranks(args.nranks, one_rep, systems, args.timeout))
        if "mpi" in others and mpi_out is None:
            part = _mpi_part(args.nranks, one_rep, args)
            if "systems" in part:
                _merge(doc, part)
            else:  # failed: no MPI column at all (not some repetitions' medians)
                mpi_out = part
    if mpi_out:
        doc["systems"]["mpi"] = mpi_out
    return _finish(doc, args)


def _in_launcher(args, others: list[str], one_host: bool = True) -> int:
    from .runner import OutOfMemory, measure
    mpi_here = compare.under_mpirun()
    systems = ["linkwise"] + [s for s in others if s != "mpi" or mpi_here]
    try:
        out = measure(args, systems, show_progress=not args.no_progress)
    except OutOfMemory as exc:
        print(f"linkwise bench: {exc}", file=sys.stderr)
        return 1
    rank, nranks = out.pop("_rank"), out.pop("_nranks")
    if rank != 0:
        return 0
    doc = {"test": args.test, "nranks": nranks, "machine": report.machine(),
           "command": _command(args),
           "systems": out}
    if "mpi" in others and not mpi_here:
        why = compare.missing("mpi") or (None if one_host else (
            "the job spans several hosts, and a second launch from rank 0 (mpirun -n N) would put "
            "every rank on its host: start the bench under mpirun to compare with MPI"))
        if why:
            out["mpi"] = {"status": "skipped", "reason": why}
        else:
            part = _mpi_part(nranks, _args_json(args), args)
            if "systems" in part:
                _merge(doc, part)
            else:
                out["mpi"] = part
    return _finish(doc, args)


def run(args) -> int:
    from .. import bootstrap
    try:
        env = bootstrap.detect()
    except ValueError as exc:  # a launcher variable that cannot be read (LINKWISE_RANK=x)
        print(f"linkwise bench: {exc}", file=sys.stderr)
        return 2
    # Under a launcher its ranks run the sweep in place; a launcher of one rank starts -N ranks
    # itself, as outside a launcher, where -N asks for more (one task of an allocation, say)
    # or for p2p, which needs two.
    in_place = env.size > 1 or (env.launcher != "none" and (
        args.nranks == 1 or (args.nranks is None and args.test != "p2p")))
    given = args.nranks
    if args.nranks is None:
        args.nranks = env.size if in_place else 2
    try:
        if env.size > 1 and given is not None and given != env.size:
            raise ValueError(f"-N {given}: the launcher started {env.size} ranks, which run the "
                             f"sweep; give -N {env.size} or leave -N out")
        others = _normalise(args)
        _check_ranks(args, env.size if in_place else args.nranks)
        if not in_place:
            _check_spawn_count(args.nranks)
        one_here = not in_place and args.nranks == 1 and args.test != "p2p"  # this process
        _check_tunables(getattr(args, "device", "cpu"), spawning=not (in_place or one_here))
    except ValueError as exc:
        if env.rank in (0, None):  # under a launcher every rank finds it: one line is enough
            print(f"linkwise bench: {exc}", file=sys.stderr)
        return 2
    if in_place:
        return _in_launcher(args, others, one_host=env.local_size == env.size)
    if one_here:
        return _in_launcher(args, others)
    from .spawn import LaunchError
    try:
        return _self_launched(args, others)
    except LaunchError as exc:
        print(f"linkwise bench: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout's reader went away (| head): linkwise.cli ends quietly
        raise
    except OSError as exc:  # a rank's process could not be started (EAGAIN, ENOMEM)
        print(f"linkwise bench: could not start the ranks: {exc}", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    """``python -m linkwise.bench.cli ARGS`` is ``linkwise bench ARGS`` (the same parser and the
    same quiet end when stdout's reader goes away)."""
    from ..cli import main as linkwise_main
    return linkwise_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

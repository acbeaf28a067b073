"""What every rank runs: the sweeps of the requested systems, in this process, in order.

:func:`measure` returns ``{system: {"status", "how", "runs"}}`` (complete on rank 0).
linkwise runs first; Gloo runs right after in the same processes (its own rendezvous on a
port rank 0 picks and sends to the others over linkwise); MPI runs in the same processes only
when they were started by mpirun (otherwise the caller makes a second launch).
"""
from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace
from typing import Optional

import numpy as np

from . import collective, common, compare, p2p
from .backends import Backend, LinkwiseBackend

_TAG_PORT = (1 << 61) + 21


class OutOfMemory(Exception):
    """A rank could not allocate a size's buffers: what its caller prints as one line."""


def plan(args) -> SimpleNamespace:
    """Sizes, types, ops and iteration counts of the sweep from the parsed flags."""
    is_p2p = args.test == "p2p"
    sizes = common.sweep(common.parse_size(args.minbytes), common.parse_size(args.maxbytes),
                         args.stepfactor, common.parse_size(args.stepbytes))
    if is_p2p:
        sizes = [s for s in sizes if s > 0] or [1]
    return SimpleNamespace(
        test=args.test, sizes=sizes,
        dtypes=common.resolve_dtypes(args.datatype), ops=common.resolve_ops(args.op),
        iters=args.iters if args.iters is not None else (10000 if is_p2p else 20),
        warmup=args.warmup_iters if args.warmup_iters is not None else (200 if is_p2p else 5),
        check=int(args.check), root=args.root, window=args.window,
        tests=[t for t in args.tests.split(",") if t], reps=args.reps)


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, label: str):
    """A rich progress bar on stderr; yields a callable that advances it by one point."""
    if not enabled or total <= 1 or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)


def _sweep(b: Backend, pl: SimpleNamespace, show: bool) -> list[dict]:
    if pl.test == "p2p":
        points = len(pl.sizes)
    else:
        points = collective.sweep_points(pl.test, pl.sizes, pl.dtypes, pl.ops)
    with progress_bar(show and b.rank == 0, points, f"{b.name} {pl.test}") as tick:
        if pl.test == "p2p":
            return p2p.run_sweep(b, pl.sizes, pl.tests, pl.iters, pl.warmup, pl.window, tick,
                                 pl.check)
        return collective.run_sweep(b, pl.test, pl.sizes, pl.dtypes, pl.ops, pl.root, pl.iters,
                                    pl.warmup, pl.check, tick)


def _torch_store(lw: LinkwiseBackend) -> tuple[str, int]:
    """Where torch.distributed's store is served: rank 0's host as the job's bootstrap knows it
    (every rank reads the same: the address linkwise's own store was found at), and a free
    port rank 0 picks and sends to every rank over linkwise."""
    from .. import bootstrap
    from .spawn import free_port
    buf = np.zeros(1, np.int64)
    if lw.rank == 0:
        buf[0] = free_port()
        for peer in range(1, lw.size):
            lw.comm.send(buf, peer, _TAG_PORT)
    else:
        lw.comm.recv(buf, 0, _TAG_PORT)
    return bootstrap.detect().master_addr, int(buf[0])


def _measure_gpu(args, pl, systems, lw, out, show_progress) -> dict:
    """--device cuda: linkwise's GPU data plane, then NCCL (torch.distributed: ``nccl``;
    called directly: ``nccl-cupy``) if asked; eager or captured in CUDA graphs (``--graph``)."""
    from . import gpu
    mode = getattr(args, "graph", "off")
    mode = {True: "on", False: "off", None: "off"}.get(mode, mode)
    graph = mode == "on"
    how = gpu.how_timing(graph)
    order = []
    if lw is not None and out["linkwise"]["status"] == "ok":
        glw = gpu.LinkwiseGpuBackend(lw, graph)
        if pl.test not in ("sendrecv",) and not glw.available(pl.test):
            out["linkwise"] = {"status": "not available", "reason": f"{pl.test} has no GPU path"}
        else:
            out["linkwise"]["how"] = "comm.<collective>(torch CUDA tensor); " + how
            order.append(("linkwise", glw))
    device = lw.comm.cuda().device if lw is not None else 0
    if "nccl" in systems:
        why = gpu.missing_nccl() if lw is not None else "nccl runs beside linkwise only"
        if why:
            out["nccl"] = {"status": "skipped", "reason": why}
        else:
            nccl = gpu.NcclBackend(lw, *_torch_store(lw), device, graph)
            out["nccl"] = {"status": "ok", "runs": [], "how": "torch.distributed nccl, same "
                           "processes, right after linkwise; " + how}
            order.append(("nccl", nccl))
    if "nccl-cupy" in systems:
        from . import gpu_nccl
        why = gpu_nccl.missing_direct() if lw is not None else "nccl-cupy runs beside linkwise only"
        if why:
            out["nccl-cupy"] = {"status": "skipped", "reason": why}
        else:
            try:
                direct = gpu_nccl.NcclDirectBackend(lw, device, graph)
            except Exception as exc:  # noqa: BLE001 - same on every rank (gpu_nccl)
                out["nccl-cupy"] = {"status": "skipped", "reason": str(exc)[:200]}
            else:
                out["nccl-cupy"] = {"status": "ok", "runs": [], "how": f"NCCL called directly "
                                    f"({direct.impl}), same processes; " + how}
                order.append(("nccl-cupy", direct))
    if mode == "both":  # the same backends again, captured: systems "<name> [graph]"
        for name, _ in order:
            out[name + GRAPH_SUFFIX] = dict(out[name], runs=[], how=out[name]["how"].replace(
                how, gpu.how_timing(True)))
    for _ in range(pl.reps):
        for name, b in order:
            b.graph = graph
            out[name]["runs"].append(_sweep(b, pl, show_progress))
        if mode == "both":
            for name, b in order:
                b.graph = True
                out[name + GRAPH_SUFFIX]["runs"].append(_sweep(b, pl, show_progress))
    for name, b in order:
        if name != "linkwise":
            b.close()
    out["_rank"] = lw.rank if lw else 0
    out["_nranks"] = lw.size if lw else 1
    return out


GRAPH_SUFFIX = " [graph]"  # cli.GRAPH_SUFFIX


def measure(args, systems: list[str], comm=None, show_progress: bool = True) -> dict:
    """Run the sweep for each system this process can run; results valid on rank 0."""
    pl = plan(args)
    out: dict = {}
    lw: Optional[LinkwiseBackend] = None
    if "linkwise" in systems:
        lw = LinkwiseBackend(comm)
        if pl.test != "p2p" and not lw.available(pl.test):
            out["linkwise"] = {"status": "not available",
                               "reason": f"comm.{pl.test} is not available in this build yet"}
        else:
            out["linkwise"] = {"status": "ok", "runs": []}
    if getattr(args, "device", "cpu") == "cuda":
        return _measure_gpu(args, pl, systems, lw, out, show_progress)
    gloo = None
    if "gloo" in systems:
        why = compare.missing("gloo")
        if why:
            out["gloo"] = {"status": "skipped", "reason": why}
        elif lw is None:
            out["gloo"] = {"status": "skipped", "reason": "gloo runs beside linkwise only"}
        else:
            addr, port = _torch_store(lw)
            gloo = compare.GlooBackend(lw.rank, lw.size, port, addr)
            out["gloo"] = {"status": "ok", "runs": [],
                           "how": "torch.distributed gloo, same processes, right after linkwise"}
    mpi = None
    if "mpi" in systems:
        why = compare.missing("mpi")
        if why and not compare.under_mpirun():
            out["mpi"] = {"status": "skipped", "reason": why}
        else:
            mpi = compare.MpiBackend()
            out["mpi"] = {"status": "ok", "runs": [], "how": "mpi4py, same processes (mpirun)"
                          + (", right after linkwise" if lw else "")}
    order = [(name, b) for name, b in (("linkwise", lw), ("gloo", gloo), ("mpi", mpi))
             if b is not None and out[name]["status"] == "ok"]
    for _ in range(pl.reps):
        for name, b in order:
            try:
                out[name]["runs"].append(_sweep(b, pl, show_progress))
            except MemoryError as exc:
                raise OutOfMemory(f"rank {b.rank}: not enough memory for the {name} buffers of the sweep up to "
                                  f"-e {args.maxbytes} ({exc or 'MemoryError'}); lower -e") from None
    for b in (gloo, mpi):
        if b is not None:
            b.close()
    rank = lw.rank if lw else (mpi.rank if mpi else 0)
    out["_rank"] = rank
    out["_nranks"] = lw.size if lw else (mpi.size if mpi else 1)
    return out

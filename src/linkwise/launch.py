"""``linkwise launch -n N [--bind none|cpu|auto] [--master-port P] (script.py | -m module) args...``

Starts N ranks on this host, like ``torchrun --standalone``. Each child gets LINKWISE_RANK,
LINKWISE_SIZE, LINKWISE_LOCAL_RANK, LINKWISE_LOCAL_SIZE, LINKWISE_MASTER_ADDR=127.0.0.1,
LINKWISE_MASTER_PORT (a free port unless given) and LINKWISE_JOB_ID (random hex), runs in its
own process group, and has its stdout/stderr forwarded line by line with a ``[rank K] `` prefix.

Contract:
  * When a rank exits non-zero or is killed by a signal, the launcher prints
    ``linkwise launch: rank K exited with status S`` (or ``was killed by signal SIG...``),
    gives the others ``PEER_GRACE`` seconds to end by themselves (a rank blocked on the dead
    one raises PeerError, and its handlers run), then sends SIGTERM to every remaining rank's
    process group, SIGKILL after ``TERM_GRACE`` more seconds, and returns non-zero (S, or 128 +
    the signal number).
  * SIGINT, SIGTERM, SIGHUP (the terminal or ssh session closed) and SIGQUIT (Ctrl-\\)
    received by the launcher are forwarded to every rank; a second one escalates to SIGKILL.
    The launcher then exits 128 + the signal (130 for Ctrl-C), whatever status the ranks end
    with. A SIGHUP ignored when the launcher starts (``nohup``) stays ignored, in the ranks
    too. SIGTSTP (Ctrl-Z), SIGTTIN and SIGTTOU are sent on to every rank's group as SIGTSTP
    (a rank that ignores it runs on, as in a foreground job), then stop the launcher; SIGCONT
    (``fg``, ``bg``) is passed on, so the ranks resume with it (_launch_signals.Relay). One
    of the three ignored when the launcher starts stays ignored, as SIGHUP does.
    Timeouts count wall time: a rank's wait in progress that the pause outlasted raises
    TimeoutError once resumed.
  * A launcher that dies without ending its ranks (SIGKILL, a crash) leaves that to its
    watchdog, a small process it starts first: every rank's process group gets SIGTERM, once,
    then SIGKILL after ``TERM_GRACE`` seconds (linkwise._launch_watchdog). The watchdog exits
    with a launcher that ends normally, signalling nothing.
  * A rank is reaped only after its group has been killed at the end, so its pid, the
    group's id, stays taken: no signal meant for a group reaches another process.
  * A rank that exits without having called ``init()`` (and whose socket to the launcher no
    process holds any more) makes the others' ``init()`` raise BootstrapError naming it at once,
    not at LINKWISE_TIMEOUT; the launcher says so where ranks wait in ``init()`` (exit status
    0: it reports a non-zero one anyway). A rank that joined and then exits is no news
    (linkwise._launch_link).
  * Output the launcher cannot write (its reader gone, its terminal hung up, or the
    descriptor closed at start) is read and dropped, so ranks never block on it.
  * A ``linkwise launch`` started from inside a rank gives its ranks their own rank, size,
    port and job id (a job of its own). Another launcher started there (torchrun, mpirun)
    passes on the rank's LINKWISE_* variables; LINKWISE_LAUNCH_OTHERS records the other
    launchers' variables as the ranks got them, so that ``init()`` there refuses the mix rather
    than take the outer rank's place (bootstrap._refuse_inner_launcher).
  * When the launcher returns, every rank's process group is sent SIGKILL, also the groups of
    ranks that have exited: processes a rank started in its group do not outlive the job.
  * With more than one rank and OMP_NUM_THREADS unset, each rank gets OMP_NUM_THREADS: the
    CPUs of its binding (``--bind``), else its share of the launcher's CPUs (at least 1).
    A launch inside a rank of another does not take the variables the outer launcher set
    (LINKWISE_LAUNCH_SET records them) as the user's: the outer OMP_NUM_THREADS is the CPUs
    its ranks share, and an inner ``--bind auto`` replaces LINKWISE_DEVICE and
    LINKWISE_SOCKET_IFNAME (linkwise._launch_env). A value the user set is kept.
  * Whatever happens, any /dev/shm/linkwise-<job_id>-* is removed at the end. linkwise's own
    shared memory (CPU transports, executor, GPU host staging) is anonymous memfds and never
    named there; the sweep only guards against a build or extension that names segments.

Threading: the main thread spawns, waits, signals and reads the ranks' sockets (RankLinks);
one daemon thread per child pipe forwards output (writes are serialised by a lock); one daemon
thread per child waits for its exit.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import os
import queue
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Optional

from ._launch_env import complete_rank_env, outer_values, users_environ
from ._launch_link import RankLinks
from ._launch_signals import Relay, rank_preexec, signal_group
from ._launch_watchdog import Watchdog
from .bootstrap import SPARE_PORTS, other_launchers

__all__ = ["add_arguments", "run", "main", "cpu_slices", "SHM_DIR"]

PUMP_GRACE = 1.0  # after the last rank: how long its output threads get, all together
PEER_GRACE = 1.0  # a shared-memory wait notices a dead peer within ~0.1 s, a socket at once
TERM_GRACE = 3.0
SHM_DIR = "/dev/shm"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks to start")
    p.add_argument("--bind", choices=("none", "cpu", "auto"), default="none",
                   help="cpu: disjoint slices of the allowed CPUs, whole cores within a NUMA node where "
                        "the counts allow; auto: from the topology "
                        "(cores, GPU, NIC near each rank), else as cpu")
    p.add_argument("--master-port", type=_port, default=None,
                   help="port of rank 0's rendezvous store (default: a free port)")
    p.add_argument("-m", dest="module", action="store_true",
                   help="the first argument is a module to run, as with python -m")
    p.add_argument("--no-python", action="store_true",
                   help="run the first argument as a program, not as a Python script (as torchrun's "
                        "--no-python); implied when it is not a file but a command on PATH, such as "
                        "python3 (mpirun's form: linkwise launch -n 2 python3 script.py)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="script.py|module|program args...",
                   help="the program and its arguments")
    p.epilog = ("Ctrl-C, Ctrl-\\, SIGTERM and SIGHUP are passed on to every rank (a second one kills "
                "them); Ctrl-Z stops the ranks with the launcher, and fg or bg resume them (a wait "
                "that the pause outlasted, as LINKWISE_TIMEOUT counts, then raises TimeoutError); if the "
                "launcher is killed outright (kill -9), its watchdog ends the ranks and what they "
                "started. A rank that ends without calling linkwise.init() makes the others' init() "
                "raise BootstrapError naming it at once. The ranks' stdin is empty (/dev/null). "
                "With more than one rank, each gets OMP_NUM_THREADS (its --bind slice's CPUs, else "
                "its share) unless you set it. Inside a rank of another linkwise launch, the values "
                "that launcher set are not taken as yours: its OMP_NUM_THREADS is shared among the "
                "inner ranks, and --bind auto sets LINKWISE_DEVICE and LINKWISE_SOCKET_IFNAME "
                "afresh (without it the inner ranks keep the outer rank's).")


def _port(text: str) -> int:
    """argparse type of --master-port: a port number, checked before any rank starts."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not in 1..65535")
    return port


def _is_command(first: str) -> bool:
    """A first argument that is no file here but a program on PATH (python3, say): run as is."""
    return not os.path.exists(first) and shutil.which(first) is not None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_slices(allowed: list[int], n: int) -> list[list[int]]:
    """Split ``allowed`` cores into ``n`` contiguous, disjoint slices (sizes differ by at most
    one). With more ranks than cores, the ranks share cores round-robin (one core each)."""
    allowed = sorted(allowed)
    if n > len(allowed):
        return [[allowed[k % len(allowed)]] for k in range(n)]
    base, extra = divmod(len(allowed), n)
    out, start = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        out.append(allowed[start:start + size])
        start += size
    return out


def _bindings(mode: str, n: int, say, users_env=None) -> list[tuple[list[int], dict[str, str]]]:
    """Per rank: cores to bind to (empty: no binding) and the variables --bind auto sets.
    `users_env`: the environment the user set (an interface named there is kept)."""
    if mode == "none":
        return [([], {}) for _ in range(n)]
    if mode == "auto":
        try:
            from .topo.affinity import binding_env, binding_for
        except ImportError as exc:
            say(f"linkwise launch: topology-aware binding is not available ({exc}); "
                f"binding to cores")
        else:
            env_of = functools.partial(binding_env, environ=users_env)
            return _auto_bindings(binding_for, env_of, n, say) or _bindings("cpu", n, say)
    allowed = sorted(os.sched_getaffinity(0))
    if n > len(allowed):
        say(f"linkwise launch: {n} ranks on {len(allowed)} cores; ranks share cores")
    return [(s, {}) for s in _core_aware_slices(allowed, n)]


def _core_aware_slices(allowed: list[int], n: int) -> list[list[int]]:
    """As --bind auto without GPUs: whole physical cores within a NUMA node where the counts
    allow (the CPUs ordered by node, core, thread; linkwise.topo.affinity), read from sysfs
    without NVML; cpu_slices' cuts in number order if that cannot be read (they may give a
    rank both sockets, or one core's hyperthreads to two ranks)."""
    try:
        from .topo.affinity import slice_cpus
        from .topo.discover import discover
        topo = discover(use_nvml=False)
        return [slice_cpus(topo, allowed, k, n) for k in range(n)]
    except Exception:  # noqa: BLE001 - a topology bug must not stop the job from starting
        return cpu_slices(allowed, n)


def _auto_bindings(binding_for, binding_env, n: int, say) -> list:
    """Bindings from linkwise.topo.affinity (the variables as bind() sets them); [] (after a
    message) if it fails."""
    try:
        return [(list(b.cpus or []), binding_env(b)) for b in (binding_for(k, n) for k in range(n))]
    except Exception as exc:  # a topology bug must not stop the job from starting
        say(f"linkwise launch: topology-aware binding failed ({exc}); binding to cores")
        return []


class _Output:
    """Serialised, prefixed, line-by-line forwarding of child output."""

    def __init__(self):
        self.lock = threading.Lock()
        self.gone: set[int] = set()  # fds whose reader went away (`linkwise launch ... | head`)

    def pump(self, pipe: IO[bytes], dest: IO[bytes], prefix: bytes) -> None:
        """Forwards until the rank closes its end. If our reader goes away, the rank's output
        is read and dropped from then on (the rank must not block on a full pipe), and the
        job runs on, as it does with a closed terminal."""
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with self.lock:
                if dest is None or dest.fileno() in self.gone:
                    continue
                try:
                    _write_all(dest, prefix + line)
                except OSError:  # the reader went (EPIPE), the terminal hung up (EIO), a full disk
                    self.gone.add(dest.fileno())
                    # Later writes (and the flush at exit) go nowhere instead of raising.
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, dest.fileno())
                    os.close(devnull)
        pipe.close()

    def say(self, text: str) -> None:
        """The launcher's own message on stderr; dropped when nobody reads stderr any more
        (the job's stop sequence and exit code must not depend on a reader)."""
        with self.lock:
            try:
                sys.stderr.buffer.write(text.encode() + b"\n")
                sys.stderr.buffer.flush()
            except (OSError, ValueError, AttributeError):  # AttributeError: started with 2>&-
                pass


def _write_all(dest: IO[bytes], data: bytes) -> None:
    """Write and flush data, waiting for room where dest is non-blocking (BlockingIOError is
    no reason to drop the output); other OSErrors are raised."""
    while data:
        try:
            dest.write(data)
            data = b""
        except BlockingIOError as exc:  # what it took is in its buffer
            data = data[exc.characters_written:]
            select.select([], [dest.fileno()], [], 1.0)
    while True:
        try:
            dest.flush()
            return
        except BlockingIOError:
            select.select([], [dest.fileno()], [], 1.0)


def _buffer(stream) -> Optional[IO[bytes]]:
    """The byte stream under sys.stdout / sys.stderr; None where the launcher was started with
    that descriptor closed (>&-): the ranks' output is then read and dropped."""
    return stream.buffer if stream is not None else None


def _describe(rank: int, status: int) -> str:
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = str(-status)
        return f"linkwise launch: rank {rank} was killed by signal {name}"
    return f"linkwise launch: rank {rank} exited with status {status}"


def cleanup_shm(job_id: str) -> list[str]:
    """Remove /dev/shm/linkwise-<job_id>-*; return what was removed."""
    removed = []
    if not job_id:
        return removed
    for path in glob.glob(os.path.join(SHM_DIR, f"linkwise-{glob.escape(job_id)}-*")):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def run(args: argparse.Namespace) -> int:
    n = args.nproc
    if n < 1:
        print("linkwise launch: -n must be at least 1", file=sys.stderr)
        return 2
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if args.module and argv:
        cmd = [sys.executable, "-u", "-m", *argv]
    elif argv and (args.no_python or _is_command(argv[0])):
        cmd = argv
    elif argv:
        cmd = [sys.executable, "-u", *argv]
    else:
        print("linkwise launch: give a script (or -m module) to run", file=sys.stderr)
        return 2
    job_id = secrets.token_hex(8)
    port = args.master_port or _free_port()
    out = _Output()
    base = dict(os.environ, PYTHONUNBUFFERED="1", LINKWISE_SIZE=str(n), LINKWISE_LOCAL_SIZE=str(n),
                LINKWISE_MASTER_ADDR="127.0.0.1", LINKWISE_MASTER_PORT=str(port),
                LINKWISE_JOB_ID=job_id, LINKWISE_LAUNCH_OTHERS=other_launchers(os.environ))
    if "LINKWISE_JOB_ID" in os.environ:  # started from a rank of another linkwise launch: its
        base.pop("LINKWISE_MASTER_PORT_SPARE", None)  # launcher set this, not the user
    if not args.master_port:
        # The port was free a moment ago, not reserved: let the store move up if it is taken
        # by then (the ranks find it by the job id).
        base.setdefault("LINKWISE_MASTER_PORT_SPARE", str(SPARE_PORTS))
    procs: list[subprocess.Popen] = []
    guard = Watchdog(out.say)  # before the first rank: it ends their groups if we are killed
    try:
        return _run_ranks(cmd, n, base, args.bind, out, procs, guard)
    finally:
        for p in procs:  # normally all gone already; never leave a rank behind
            signal_group(p, signal.SIGKILL)
        for p in procs:  # only now reaped (_exit_status): their groups' ids were kept till here
            with contextlib.suppress(OSError):
                p.kill()  # a rank that left its group
            with contextlib.suppress(subprocess.TimeoutExpired):  # one stuck in the kernel: init reaps it
                p.wait(timeout=TERM_GRACE)
        guard.close()
        cleanup_shm(job_id)


def _run_ranks(cmd, n, base, bind, out: _Output, procs: list, guard: Watchdog) -> int:
    relay = Relay(procs)  # signal handlers: before the first rank starts (see Relay)
    links = RankLinks(out.say)
    try:
        code = _spawn(cmd, n, base, bind, out, procs, guard, links)
        if code:
            return code
        relay.caught_up()
        return _supervise(procs, out, relay.seen, links)
    finally:
        relay.restore()
        links.close()


@contextlib.contextmanager
def thread_affinity(cpus):
    """Within: this thread may run on ``cpus`` (empty: unchanged), so that processes it starts
    inherit them (affinity is per thread and inherited across fork); restored on exit. CPUs
    outside the container's set are dropped by the kernel, so ``range(os.cpu_count())`` means
    every CPU this process may get. Raises OSError if none of ``cpus`` may be used."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def _spawn(cmd, n, base, bind, out: _Output, procs: list, guard: Watchdog, links: RankLinks) -> int:
    """Start the n ranks into procs; 0, or 2 after a message if one cannot start."""
    outer = outer_values(os.environ)  # what an outer linkwise launch set for the rank we run in
    bindings = _bindings(bind, n, out.say, users_environ(os.environ, outer))
    # A bound rank starts its helpers (the benchmark's mpirun) on the CPUs given to this
    # launcher, not on its own slice nor on CPUs an outer taskset or cpuset left out.
    launcher_cpus = ",".join(map(str, sorted(os.sched_getaffinity(0)))) if hasattr(os, "sched_getaffinity") else ""
    # Each rank inherits its binding from this (the spawning) thread. The output threads are
    # started afterwards, so that they keep the full affinity.
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    try:
        for k in range(n):
            cpus, extra = bindings[k]
            env = dict(base, LINKWISE_RANK=str(k), LINKWISE_LOCAL_RANK=str(k))
            complete_rank_env(env, outer, auto=bind == "auto", n=n, cpus=cpus, allowed=allowed, bound=extra)
            if cpus and launcher_cpus:
                env["LINKWISE_LAUNCH_CPUS"] = launcher_cpus
            else:  # not an outer launch's, inherited
                env.pop("LINKWISE_LAUNCH_CPUS", None)
            fd, link_env = links.new(k)
            env.update(link_env)
            try:
                with thread_affinity(cpus):
                    procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                  pass_fds=(fd,), preexec_fn=rank_preexec(guard.fd)))
            finally:
                os.close(fd)
    except (OSError, subprocess.SubprocessError) as exc:
        out.say(f"linkwise launch: cannot start {shlex.join(cmd)}: {exc}")
        return 2
    return 0


def _exit_status(p: subprocess.Popen) -> int:
    """The rank's exit status once it has exited (as Popen.returncode: -N for signal N),
    without reaping it: its pid, which is its process group's id, stays taken until run()
    has killed the group, so no signal to the group (nor the watchdog's) can reach another
    process. Where waitid is missing, the rank is reaped here."""
    if not hasattr(os, "waitid"):
        return p.wait()
    try:
        info = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere
        return p.wait()
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _supervise(procs: list, out: _Output, signals_seen: list, links: RankLinks) -> int:
    """Forward output, wait for every rank, stop the others after a failure; the exit code."""
    pumps = []
    for k, p in enumerate(procs):
        prefix = f"[rank {k}] ".encode()
        for pipe, dest in ((p.stdout, _buffer(sys.stdout)), (p.stderr, _buffer(sys.stderr))):
            t = threading.Thread(target=out.pump, args=(pipe, dest, prefix), daemon=True)
            t.start()
            pumps.append(t)
    exits: "queue.Queue[tuple[int, int]]" = queue.Queue()
    for k, p in enumerate(procs):
        threading.Thread(target=lambda k=k, p=p: exits.put((k, _exit_status(p))), daemon=True).start()

    code, left, term_at, deadline = 0, len(procs), None, None
    while left:
        try:
            k, status = exits.get(timeout=0.1)
        except queue.Empty:
            links.poll()
            now = time.monotonic()
            if term_at is not None and now > term_at:
                out.say(f"linkwise launch: stopping the other {left} rank(s)")
                for p in procs:
                    signal_group(p, signal.SIGTERM)
                term_at, deadline = None, now + TERM_GRACE
            elif deadline is not None and now > deadline:
                for p in procs:
                    signal_group(p, signal.SIGKILL)
                deadline = None
            continue
        left -= 1
        links.exited(k, status)
        if status != 0 and code == 0 and not signals_seen:
            # The first failure decides the exit code; the ranks we stop are not news, nor
            # are ranks ending on a signal passed on to them (Ctrl-C: 130, as the shell says).
            out.say(_describe(k, status))
            code = status if status > 0 else 128 - status
            if left:
                term_at = time.monotonic() + PEER_GRACE
    end = time.monotonic() + PUMP_GRACE  # a grandchild may hold a pipe open: do not wait for it
    for t in pumps:
        t.join(timeout=max(0.0, end - time.monotonic()))
    if code == 0 and signals_seen:
        code = 128 + signals_seen[0]
    return code


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="linkwise launch", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Run a function on N ranks, each a forked process with its own world communicator.

    results = run_ranks(3, body, arg)      # body(comm, arg) runs on ranks 0..2

Each rank's return value comes back (pickled); an exception on any rank fails the call with
that rank's traceback. Ranks that hang are killed at `timeout` and reported. `env` adds
environment variables (e.g. LINKWISE_TRANSPORT=tcp) in the children only.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Optional

from linkwise.bootstrap import SPARE_PORTS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(AssertionError):
    pass


# Every run_ranks call gets its own job id, so that its shared-memory segments are named
# /dev/shm/linkwise-<JOB_PREFIX><n>-... and tests can check for leftovers of their own jobs
# only, whatever else runs on the machine.
JOB_PREFIX = f"t{os.getpid()}x"
_jobs = [0]


def shm_of_this_process() -> list:
    """Segments left by jobs that run_ranks started from this process."""
    import glob
    return sorted(glob.glob(f"/dev/shm/linkwise-{JOB_PREFIX}*"))


def _child(rank: int, n: int, port: int, fn, args, env: dict, wfd: int, init: bool) -> None:
    code = 0
    try:
        # a list or tuple gives each rank its own value (env[k][rank])
        os.environ.update({k: str(v[rank] if isinstance(v, (list, tuple)) else v) for k, v in env.items()})
        os.environ.update(LINKWISE_RANK=str(rank), LINKWISE_SIZE=str(n), LINKWISE_LOCAL_RANK=str(rank),
                          LINKWISE_LOCAL_SIZE=str(n), LINKWISE_MASTER_ADDR="127.0.0.1",
                          LINKWISE_MASTER_PORT=str(port))
        if os.environ.get("LINKWISE_TEST_DUMP_AFTER"):  # diagnosing a hang: every thread's stack
            import faulthandler
            faulthandler.dump_traceback_later(float(os.environ["LINKWISE_TEST_DUMP_AFTER"]))
        if init:
            import linkwise
            comm = linkwise.init()
            result = ("ok", fn(comm, *args))
            comm.close()
        else:
            result = ("ok", fn(rank, n, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
        code = 1
    try:
        data = pickle.dumps(result)
    except Exception:  # noqa: BLE001
        data = pickle.dumps(("error", "result not picklable:\n" + traceback.format_exc()))
    with os.fdopen(wfd, "wb") as f:
        f.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(n: int, fn: Callable, *args: Any, env: Optional[dict] = None, timeout: float = 60.0,
              init: bool = True, expect_fail: bool = False) -> list:
    """Run fn on n forked ranks; returns [result of rank 0, ...].

    With expect_fail=True, returns [("ok", value) | ("error", traceback) | ("died", status)]
    for every rank instead of raising."""
    port = free_port()
    _jobs[0] += 1
    env = dict(env or {})
    env.setdefault("LINKWISE_JOB_ID", f"{JOB_PREFIX}{_jobs[0]}")
    # free_port() was free a moment ago, not reserved: the store may move up if it is taken
    env.setdefault("LINKWISE_MASTER_PORT_SPARE", str(SPARE_PORTS))
    children = []
    for rank in range(n):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            _child(rank, n, port, fn, args, env or {}, wfd, init)
        os.close(wfd)
        children.append((pid, rfd))
    outcomes = []
    deadline = time.monotonic() + timeout
    for rank, (pid, rfd) in enumerate(children):
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                for p, _ in children:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.waitpid(pid, 0)
                status = -1
                break
            time.sleep(0.005)
        with os.fdopen(rfd, "rb") as f:
            data = f.read()
        if data:
            outcomes.append(pickle.loads(data))
        elif status == -1:
            outcomes.append(("died", f"rank {rank} hung past {timeout} s and was killed"))
        else:
            outcomes.append(("died", f"rank {rank} exited with wait status {status}"))
    if expect_fail:
        return outcomes
    problems = [f"--- rank {r}: {kind}\n{val}" for r, (kind, val) in enumerate(outcomes) if kind != "ok"]
    if problems:
        raise RankFailure("\n".join(problems))
    return [val for _, val in outcomes]


def collective_until_peer_error(comm, coll: str, x, victim: int = 2, linger: float = 0.0):
    """Rank `victim` SIGKILLs itself 0.3 s in; every rank repeats `coll` on x ("all_reduce"
    with max, "all_gather", "broadcast" from 0) until it raises PeerError. Returns the peer
    the error names ("finished" if none came); a survivor then stays alive `linger` seconds,
    as a program that handles the error would."""
    import threading
    from linkwise.errors import PeerError
    if comm.rank == victim:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    calls = {"all_reduce": lambda: comm.all_reduce(x, op="max"), "all_gather": lambda: comm.all_gather(x),
             "broadcast": lambda: comm.broadcast(x, root=0)}
    try:
        for _ in range(1_000_000):
            calls[coll]()
    except PeerError as exc:
        time.sleep(linger)
        return exc.peer
    return "finished"


def calls_until_peer_error(comm, step: Callable[[int], Any], victim: int = 2, after_s: float = 0.3):
    """Rank `victim` SIGKILLs itself after `after_s` seconds; every rank calls step(0), step(1),
    ... until a PeerError, and returns the peer it names (a survivor), or "finished"."""
    import threading
    from linkwise.errors import PeerError
    if comm.rank == victim:
        threading.Timer(after_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        for i in range(10_000_000):
            step(i)
    except PeerError as exc:
        return exc.peer
    return "finished"

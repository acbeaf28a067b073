"""A communicator's life around the process's: exit while a daemon thread is blocked in a
call (was SIGABRT: the exit-time close woke it during finalization), a forked child's exit (it
closed the parent's rendezvous store, so a later split failed), a failed init (its store kept
listening, so a retry could not bind the port), and timeouts that are not positive finite
seconds (NaN hung init, negative ones failed with socket errors)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import linkwise
from linkwise import config

SRC = str(Path(linkwise.__file__).resolve().parents[1])


def _run(tmp_path, body: str, *launch: str, env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(body)
    cmd = [sys.executable, "-m", "linkwise.cli", "launch", *launch, str(script)] if launch else [sys.executable, str(script)]
    e = dict(os.environ, PYTHONPATH=SRC, **(env or {}))
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=60)


BLOCKED_AT_EXIT = """
import threading, time
import numpy as np
import linkwise
c = linkwise.init()
threading.Thread(target=lambda: c.recv(np.empty(4), 0, tag=42, timeout=30), daemon=True).start()
time.sleep(0.3)
print("exiting", c.rank)
"""


@pytest.mark.parametrize("launch", [(), ("-n", "2")], ids=["alone", "two-ranks"])
def test_exit_with_a_daemon_thread_blocked_in_a_receive(tmp_path, launch):
    p = _run(tmp_path, BLOCKED_AT_EXIT, *launch)
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert "terminate" not in p.stderr and "Aborted" not in p.stderr and "leaked" not in p.stderr, p.stderr
    assert p.stdout.count("exiting") == (2 if launch else 1)


FORK_THEN_SPLIT = """
import os, sys
import numpy as np
import linkwise
c = linkwise.init()
if c.rank == int(os.environ["FORKER"]):
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # runs the exit hooks in the child
    os.waitpid(pid, 0)
c.barrier()
sub = c.split(0, c.rank)  # needs the store
x = np.ones(2); sub.all_reduce(x)
print("ok", c.rank, x[0])
"""


@pytest.mark.parametrize("forker", ["0", "1"])
def test_forked_child_exit_leaves_the_parents_communicator(tmp_path, forker):
    p = _run(tmp_path, FORK_THEN_SPLIT, "-n", "2", env={"FORKER": forker, "LINKWISE_TIMEOUT": "20"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(ln for ln in p.stdout.splitlines() if " ok " in ln) == ["[rank 0] ok 0 2.0", "[rank 1] ok 1 2.0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failed_init_closes_its_store(tmp_path):
    port = _free_port()
    body = f"""
import linkwise
for attempt in range(2):  # rank 1 never comes: each attempt times out, the second binds again
    try:
        linkwise.init(rank=0, size=2, addr="127.0.0.1:{port}", timeout=0.5)
    except linkwise.LinkwiseError as exc:
        print("attempt", attempt, type(exc).__name__)
"""
    p = _run(tmp_path, body)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:2] == ["attempt 0 TimeoutError", "attempt 1 TimeoutError"], p.stdout + p.stderr


@pytest.mark.parametrize("raw", ["nan", "inf", "0", "-1", "abc"])
def test_timeouts_must_be_positive_finite_seconds(raw, monkeypatch):
    monkeypatch.setenv("LINKWISE_TIMEOUT", raw)
    with pytest.raises(ValueError, match="LINKWISE_TIMEOUT"):
        config.get("LINKWISE_TIMEOUT")
    monkeypatch.delenv("LINKWISE_TIMEOUT")
    with pytest.raises(ValueError, match="timeout"):
        linkwise.init(timeout=float(raw) if raw != "abc" else raw)
    assert config.seconds("2.5") == 2.5


def _closed_subs_still_referenced(comm):
    """close() releases a communicator's shared memory and pidfds at once, not when the object
    is collected (before: ~16 MB of shared memory and 2 pidfds a closed split kept)."""
    import gc

    def held():
        with open("/proc/self/maps") as f:
            segments = sum("-coll-" in line for line in f)
        fds = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                fds += "pidfd" in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return segments, fds

    import numpy as np
    gc.disable()
    try:
        before = held()
        kept = []
        for _ in range(4):
            sub = comm.split(0)
            sub.all_reduce(np.ones(4, np.float32))
            sub.close()
            kept.append(sub)
        return before, held()
    finally:
        gc.enable()


def test_close_releases_shared_memory_while_the_object_lives():
    from multirank import run_ranks
    for before, after in run_ranks(2, _closed_subs_still_referenced, timeout=60):
        assert before[0] >= 1 and after == before, (before, after)


def _late_rank_0(rank, n):
    """Rank 1's first connections to the store are refused (rank 0 starts late); its world
    communicator must still be freed once closed and dropped, with no gc pass (before, the
    connect error's traceback formed a cycle that kept it, and its segments, alive)."""
    import gc
    import time
    import weakref
    gc.disable()
    try:
        if rank == 0:
            time.sleep(0.5)
        comm = linkwise.init()
        comm.barrier()
        ref = weakref.ref(comm)
        comm.close()
        del comm
        return ref() is None
    finally:
        gc.enable()


def test_a_world_made_after_store_retries_is_freed_without_gc():
    from multirank import run_ranks
    assert run_ranks(2, _late_rank_0, init=False, timeout=60) == [True, True]


def _worlds_dropped_without_close(rank, n):
    """init(), use, drop without close() and collect, a dozen times (the spare ports are 9 in
    tests): every init succeeds, and rank 0 keeps no store listener of the dropped worlds."""
    import gc
    import threading
    import numpy as np
    for _ in range(12):
        comm = linkwise.init()
        x = np.ones(2, np.float32)
        comm.all_reduce(x)
        del comm
        gc.collect()
    return sum(t.name == "linkwise-store-accept" and t.is_alive() for t in threading.enumerate())


def test_worlds_dropped_without_close_release_their_store():
    from multirank import run_ranks
    assert run_ranks(2, _worlds_dropped_without_close, init=False, timeout=120) == [0, 0]


def _child_drops_a_parent_communicator(comm):
    """A forked child that only drops its copy of the parent's sub-communicator: the parent's
    store must stay open (a first version's finalizer closed it from the child, and the
    parents' next split raised StoreClosedError)."""
    import gc
    import numpy as np
    sub = comm.split(0)
    comm.barrier()
    if comm.rank == 0:
        pid = os.fork()
        if pid == 0:
            del sub
            gc.collect()
            os._exit(0)
        os.waitpid(pid, 0)
    comm.barrier()
    again = comm.split(0)
    x = np.ones(2, np.float32)
    again.all_reduce(x)
    again.close()
    sub.close()
    return float(x[0])


def test_a_forked_child_dropping_a_communicator_leaves_the_store():
    from multirank import run_ranks
    assert run_ranks(2, _child_drops_a_parent_communicator, timeout=60) == [2.0, 2.0]

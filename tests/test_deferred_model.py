"""DeferredReceives (linkwise/cuda/deferred.py) and its native helper threads
(csrc/bindings/defer_workers.h) over real host communicators, with a recording stand-in for
the GPU engine (_native._DeferTestTarget), so routing, order, failure, close, the fast case and
the GIL-free handoff are checked without a GPU (the GPU tests are in test_gpu_deferred.py).
Rank 0 receives; the other ranks send the buffer descriptions as registered.send does."""
from __future__ import annotations

import gc
import sys
import time

import numpy as np
import pytest

from linkwise import _native
from linkwise.cuda.deferred import DeferredReceives
from linkwise.cuda.registered import DESC_BYTES, _REG_TAG
from linkwise.errors import PeerError
from multirank import run_ranks

MiB = 1 << 20
GO = 7  # tag of the plain messages that order the ranks


class FakeEngine:
    """The caller-thread half of GpuEngine: recv_defer_begin hands out events 1, 2, ...;
    recv_now (the fast case) is recorded."""

    def __init__(self):
        self.events = 0
        self.now = []  # (ptr, nbytes, src, desc)

    def recv_defer_begin(self, src, stream):
        self.events += 1
        return self.events

    def recv_now(self, ptr, nbytes, src, stream, desc):
        self.now.append((ptr, nbytes, src, desc))


class FakeGpuComm:
    def __init__(self, comm):
        self.size, self.comm, self._engine = comm.size, comm, FakeEngine()


def _receiver(comm):
    target = _native._DeferTestTarget()
    g = FakeGpuComm(comm)
    return g, target, DeferredReceives(g, target)


def _describe(comm, flag=1, fill=0xAB):
    """What registered.send sends rank 0 before its data: a flag byte and the description."""
    comm.send(np.array([flag] + [fill] * DESC_BYTES, np.uint8), 0, _REG_TAG)


def _go(comm, peer):
    comm.send(np.zeros(1, np.uint8), peer, GO)


def _wait_go(comm, peer):
    comm.recv(np.zeros(1, np.uint8), peer, GO, timeout=30)  # past a short LINKWISE_TIMEOUT


def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _posted_first(comm):
    if comm.rank == 1:
        _wait_go(comm, 0)
        _describe(comm)
        _describe(comm, flag=0)  # an unexportable buffer: the scratch receive
        return None
    g, target, d = _receiver(comm)
    t0 = time.monotonic()
    d.post(object(), 0x1000, 8 * MiB, 1, 7, registered=True)
    d.post(object(), 0x2000, 8 * MiB, 1, 7, registered=True)
    assert time.monotonic() - t0 < 0.5
    time.sleep(0.05)
    assert target.finished() == [] and d.busy(1)
    _go(comm, 1)
    _until(lambda: not d.busy(1))
    (ev1, x1, n1, src1, desc1, gil1, _), (ev2, x2, _, _, desc2, gil2, _) = target.finished()
    assert (ev1, x1, n1, src1) == (1, 0x1000, 8 * MiB, 1) and (ev2, x2) == (2, 0x2000)
    assert desc1 == bytes([0xAB]) * DESC_BYTES and desc2 == b""
    assert not gil1 and not gil2  # the helper never took the GIL
    assert g._engine.now == [] and target.dropped() == [] and target.aborted() == []
    d.close(1.0)
    return True


def test_post_returns_before_the_description_and_the_helper_finishes_without_the_gil():
    assert run_ranks(2, _posted_first, timeout=60)[0]


def _order(comm):
    if comm.rank in (1, 2):
        _wait_go(comm, 0)
        _describe(comm, fill=comm.rank)
        return None
    g, target, d = _receiver(comm)
    d.post(object(), 0xA, 8 * MiB, 1, 0, registered=True)   # waits for its description
    d.post(object(), 0xB, 4096, 1, 0, registered=False)     # queued behind it (same source)
    d.post(object(), 0xC, 8 * MiB, 2, 0, registered=True)   # another source
    _go(comm, 2)
    _until(lambda: not d.busy(2))
    assert [f[1] for f in target.finished()] == [0xC]       # source 2 went ahead
    assert d.busy(1)
    _go(comm, 1)
    _until(lambda: not d.busy(1))
    got = target.finished()
    assert [f[1] for f in got] == [0xC, 0xA, 0xB]
    assert got[1][4] == bytes([1]) * DESC_BYTES and got[2][4] == b""  # the small one took none
    d.close(1.0)
    return True


def test_receives_from_one_source_finish_in_issue_order_and_others_do_not_wait():
    assert run_ranks(3, _order, timeout=60)[0]


def _description_never_comes(comm):
    if comm.rank == 1:
        _wait_go(comm, 0)  # sent once rank 0 has seen its failure
        return None
    g, target, d = _receiver(comm)
    d.post(object(), 0xA, 8 * MiB, 1, 0, registered=True)
    d.post(object(), 0xB, 4096, 1, 0, registered=False)
    _until(lambda: d.failure is not None, timeout=10)
    assert "did not complete" in str(d.failure)
    assert target.aborted() == [1] and not d.busy(1) and target.finished() == []
    assert target.dropped() == [1, 2]  # the failed 0xA's event, then the queued 0xB's
    with pytest.raises(type(d.failure), match="did not complete"):
        d.post(object(), 0xC, 4096, 1, 0, registered=False)
    with pytest.raises(type(d.failure), match="did not complete"):  # one that raced the failure
        d._workers.post(1, None, object(), None, 99, 0xE, 4096)
    assert target.dropped() == [1, 2, 99]  # its event is released too
    _go(comm, 1)
    d.close(1.0)
    return True


def test_a_description_that_never_comes_aborts_and_is_raised_by_the_next_post():
    assert run_ranks(2, _description_never_comes, env={"LINKWISE_TIMEOUT": "1"}, timeout=60)[0]


def _finish_fails(comm):
    if comm.rank in (1, 2):
        _wait_go(comm, 0)
        if comm.rank == 1:
            _describe(comm)
        return None
    g, target, d = _receiver(comm)
    target.fail_src = 1
    target.hold(True)
    d.post(object(), 0xA, 8 * MiB, 1, 0, registered=True)
    d.post(object(), 0xB, 4096, 1, 0, registered=False)  # queued behind the one that fails
    _go(comm, 1)
    time.sleep(0.1)  # the helper is inside finish, held
    target.hold(False)
    _until(lambda: d.failure is not None)
    assert "refused source 1" in str(d.failure)
    assert target.aborted() == [1] and target.dropped() == [2] and target.finished() == []
    with pytest.raises(type(d.failure), match="refused source 1"):  # other sources too
        d.post(object(), 0xC, 8 * MiB, 2, 0, registered=True)
    _go(comm, 2)
    d.close(1.0)
    return True


def test_a_failing_enqueue_aborts_naming_the_source_and_drops_the_queue():
    assert run_ranks(3, _finish_fails, timeout=60)[0]


def _close_waits(comm):
    if comm.rank == 1:
        _wait_go(comm, 0)
        time.sleep(0.2)
        _describe(comm)
        return None
    g, target, d = _receiver(comm)
    d.post(object(), 0xA, 8 * MiB, 1, 0, registered=True)
    _go(comm, 1)
    t0 = time.monotonic()
    d.close(5.0)
    took = time.monotonic() - t0
    assert 0.1 < took < 3, took
    assert [f[1] for f in target.finished()] == [0xA] and target.aborted() == []
    return True


def test_close_lets_queued_receives_finish_then_stops_the_helpers():
    assert run_ranks(2, _close_waits, timeout=60)[0]


def _close_gives_up(comm, drop):
    if comm.rank == 1:
        _wait_go(comm, 0)  # after rank 0 closed: the description comes too late
        _describe(comm)
        return None
    g, target, d = _receiver(comm)
    d.post(object(), 0xA, 8 * MiB, 1, 0, registered=True)
    d.post(object(), 0xB, 8 * MiB, 1, 0, registered=True)
    t0 = time.monotonic()
    if drop:  # a GpuComm dropped without close(): collected, its helpers close
        del d
        gc.collect()
    else:
        d.close(0.3)
    took = time.monotonic() - t0
    assert took < 1.5, took  # the host waits were withdrawn, not waited out
    assert target.aborted() == [-1] and sorted(target.dropped()) == [1, 2]
    _go(comm, 1)
    time.sleep(0.2)
    assert target.finished() == []  # nothing enqueued into a closed engine
    return True


@pytest.mark.parametrize("drop", [False, True], ids=["closed", "dropped"])
def test_closing_with_receives_that_never_come_aborts_and_no_helper_calls_the_engine_after(drop):
    assert run_ranks(2, _close_gives_up, drop, timeout=60)[0]


def _already_here(comm):
    if comm.rank == 1:
        _describe(comm)
        _describe(comm)
        _wait_go(comm, 0)
        _describe(comm)
        _describe(comm)
        return None
    g, target, d = _receiver(comm)
    time.sleep(0.2)  # the sender got there first
    d.post(object(), 0xA, 8 * MiB, 1, 0, registered=True)
    assert g._engine.now == [(0xA, 8 * MiB, 1, bytes([0xAB]) * DESC_BYTES)]
    assert not d.busy(1) and g._engine.events == 0  # nothing deferred, no event made
    # still queued behind a deferred receive from the same source
    target.hold(True)
    d.post(object(), 0xB, 8 * MiB, 1, 0, registered=True)  # description here: fast case again
    d.post(object(), 0xC, 8 * MiB, 1, 0, registered=True)  # deferred: its description is not
    _go(comm, 1)
    time.sleep(0.2)
    d.post(object(), 0xD, 8 * MiB, 1, 0, registered=True)  # here, but 0xC is not done
    assert d.busy(1) and g._engine.events == 2
    target.hold(False)
    _until(lambda: not d.busy(1))
    assert [n[0] for n in g._engine.now] == [0xA, 0xB]
    assert [f[1] for f in target.finished()] == [0xC, 0xD]
    d.close(1.0)
    return True


def test_a_description_already_here_is_received_on_the_callers_thread_unless_one_is_deferred():
    assert run_ranks(2, _already_here, timeout=60)[0]


def _while_python_runs(comm):
    # Every rank past init() first: rank 0's process serves the rendezvous store from Python
    # threads, so a peer still setting up would wait for rank 0's loop below to let go.
    comm.barrier()
    if comm.rank == 1:
        _wait_go(comm, 0)
        time.sleep(0.1)
        sent = time.monotonic()
        _describe(comm)
        return sent
    g, target, d = _receiver(comm)
    d.post(object(), 0xA, 8 * MiB, 1, 0, registered=True)
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # a thread that needs the GIL waits until this loop ends
    try:
        _go(comm, 1)
        end = time.monotonic() + 0.6
        spins = 0
        while time.monotonic() < end:  # pure Python, never giving up the GIL
            spins += 1
    finally:
        sys.setswitchinterval(old)
    (_, _, _, _, _, had_gil, t), = target.finished()
    d.close(1.0)
    return t, end, had_gil


def test_the_copy_is_enqueued_while_the_caller_runs_python():
    (t, end, had_gil), sent = run_ranks(2, _while_python_runs, timeout=60)
    assert not had_gil
    assert t < end - 0.1, "the helper waited for the caller's Python to give up the GIL"
    assert t - sent < 0.1


def test_a_gpu_request_raises_the_communicators_recorded_failure_not_the_engines():
    """GpuComm hands its requests its own check: a deferred receive's failure (here a
    TimeoutError: the description never came) is what wait() raises, not the engine's "peer
    died or failed" of the abort that followed it."""
    from linkwise._request import GpuRequest
    from linkwise.errors import TimeoutError as LinkwiseTimeout

    class Engine:
        def event_wait(self, ev, seconds):
            return True

        def event_query(self, ev):
            return True

        def event_destroy(self, ev):
            pass

        def check(self):
            raise PeerError("rank 0: peer rank 1 died or failed")

    def recorded():
        raise LinkwiseTimeout("rank 0: recv with rank 1 (tag ...) did not complete within 20 s")
    with pytest.raises(LinkwiseTimeout, match="did not complete"):
        GpuRequest(Engine(), 7, 5.0, 8, check=recorded).wait()
    with pytest.raises(PeerError):  # without one, the engine's check as before
        GpuRequest(Engine(), 7, 5.0, 8).wait()


def test_workers_refuse_a_target_that_is_not_an_engine():
    with pytest.raises(TypeError, match="_GpuEngine or a _DeferTestTarget"):
        _native._DeferWorkers(object(), 2)

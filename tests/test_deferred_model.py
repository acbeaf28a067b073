"""DeferredReceives (linkwise/cuda/deferred.py) against a fake engine and a fake host channel,
so its routing, order, failure and close contracts are checked without a GPU (the GPU tests
are in test_gpu_deferred.py)."""
from __future__ import annotations

import collections
import threading
import time

import pytest

from linkwise.cuda.deferred import DeferredReceives
from linkwise.cuda.registered import DESC_BYTES, _REG_TAG
from linkwise.errors import PeerError


class FakeEngine:
    def __init__(self):
        self.events = 0
        self.finished = []  # (event, ptr, nbytes, src, desc, thread name); event None: recv_now
        self.aborted = []
        self.destroyed = []
        self.lock = threading.Lock()
        self.go_on = threading.Event()  # cleared by a test: helpers' finishes wait for it
        self.go_on.set()

    def recv_defer_begin(self, src, stream):
        self.events += 1
        return self.events

    def recv_defer_finish(self, event, ptr, nbytes, src, desc):
        assert self.go_on.wait(10)
        with self.lock:
            self.finished.append((event, ptr, nbytes, src, desc, threading.current_thread().name))

    def recv_now(self, ptr, nbytes, src, stream, desc):
        self.recv_defer_finish(None, ptr, nbytes, src, desc)

    def abort(self, peer):
        self.aborted.append(peer)

    def event_destroy(self, event):
        self.destroyed.append(event)


class FakeRequest:
    def __init__(self, msg):
        self.msg, self.error, self.filled = msg, None, threading.Event()

    def fill(self, got):
        if isinstance(got, BaseException):
            self.error = got
        else:
            self.msg[:] = list(got)
        self.filled.set()

    def test(self):
        return self.filled.is_set()

    def wait(self):
        assert self.filled.wait(10), "description never came"
        if self.error is not None:
            raise self.error


class FakeComm:
    """irecv(msg, src, tag): a request that the next message `deliver`ed (or `fail`ed) from src
    fills; requests from one source are filled in the order they were posted."""

    def __init__(self, size):
        self.waiting = [collections.deque() for _ in range(size)]
        self.early = [collections.deque() for _ in range(size)]
        self.lock = threading.Lock()

    def _arrive(self, src, got):
        with self.lock:
            if self.waiting[src]:
                self.waiting[src].popleft().fill(got)
            else:
                self.early[src].append(got)

    def deliver(self, src, flag=1, fill=0xAB):
        self._arrive(src, bytes([flag]) + bytes([fill]) * DESC_BYTES)

    def fail(self, src, exc):
        self._arrive(src, exc)

    def irecv(self, msg, src, tag):
        assert tag == _REG_TAG
        req = FakeRequest(msg)
        with self.lock:
            if self.early[src]:
                req.fill(self.early[src].popleft())
            else:
                self.waiting[src].append(req)
        return req


class FakeGpuComm:
    def __init__(self, size=3):
        self.size = size
        self._engine = FakeEngine()
        self.comm = FakeComm(size)


def _until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def setup():
    g = FakeGpuComm()
    d = DeferredReceives(g)
    yield g, d
    d.close(0.5)


def test_post_returns_before_the_description_and_finishes_once_it_comes(setup):
    g, d = setup
    t0 = time.monotonic()
    d.post(object(), 0x1000, 8 << 20, 1, 7, registered=True)
    assert time.monotonic() - t0 < 0.5
    time.sleep(0.05)
    assert g._engine.finished == [] and d.busy(1) and not d.busy(2)
    g.comm.deliver(1)
    _until(lambda: not d.busy(1))
    (ev, ptr, n, src, desc, thread), = g._engine.finished
    assert (ev, ptr, n, src) == (1, 0x1000, 8 << 20, 1)
    assert desc == bytes([0xAB]) * DESC_BYTES
    assert thread == "linkwise-gpu-recv-from-1"


def test_an_unexportable_sender_gives_the_scratch_receive(setup):
    g, d = setup
    d.post(object(), 0x1000, 8 << 20, 2, 0, registered=True)
    g.comm.deliver(2, flag=0)
    _until(lambda: not d.busy(2))
    assert g._engine.finished[0][4] == b""


def test_receives_from_one_source_finish_in_issue_order_and_others_do_not_wait(setup):
    g, d = setup
    d.post(object(), 0xA, 8 << 20, 1, 0, registered=True)   # waits for its description
    d.post(object(), 0xB, 4096, 1, 0, registered=False)     # queued behind it (same source)
    d.post(object(), 0xC, 8 << 20, 2, 0, registered=True)   # another source
    g.comm.deliver(2)
    _until(lambda: not d.busy(2))
    assert [f[1] for f in g._engine.finished] == [0xC]       # source 2 went ahead
    assert d.busy(1)
    g.comm.deliver(1)
    _until(lambda: not d.busy(1))
    assert [f[1] for f in g._engine.finished] == [0xC, 0xA, 0xB]
    assert g._engine.finished[2][4] == b""                   # the small one took no description


def test_a_failed_description_aborts_and_is_raised_by_the_next_post(setup):
    g, d = setup
    d.post(object(), 0xA, 8 << 20, 1, 0, registered=True)
    d.post(object(), 0xB, 4096, 1, 0, registered=False)
    g.comm.fail(1, PeerError("rank 1 died"))
    _until(lambda: d.failure is not None)
    _until(lambda: g._engine.aborted == [1])
    assert not d.busy(1) and g._engine.finished == []
    assert g._engine.destroyed == [1, 2]  # the failed 0xA's event, then the queued 0xB's
    with pytest.raises(PeerError, match="rank 1 died"):
        d.post(object(), 0xC, 8 << 20, 2, 0, registered=True)


def test_close_lets_queued_receives_finish_then_stops_the_helpers():
    g = FakeGpuComm()
    d = DeferredReceives(g)
    d.post(object(), 0xA, 8 << 20, 1, 0, registered=True)
    threading.Timer(0.2, g.comm.deliver, args=(1,)).start()
    t0 = time.monotonic()
    d.close(5.0)
    assert 0.15 < time.monotonic() - t0 < 3
    assert [f[1] for f in g._engine.finished] == [0xA] and g._engine.aborted == []


def test_close_with_a_receive_that_never_comes_aborts_and_no_helper_calls_the_engine_after():
    g = FakeGpuComm()
    d = DeferredReceives(g)
    d.post(object(), 0xA, 8 << 20, 1, 0, registered=True)
    t0 = time.monotonic()
    d.close(0.3)
    assert time.monotonic() - t0 < 2
    assert g._engine.aborted == [-1]
    g.comm.deliver(1)  # too late: the helper must not enqueue into a closed engine
    _until(lambda: g._engine.destroyed == [1])  # it releases the event instead
    assert g._engine.finished == []


def test_a_description_already_here_is_received_on_the_callers_thread(setup):
    g, d = setup
    g.comm.deliver(1)  # the sender got there first
    d.post(object(), 0xA, 8 << 20, 1, 0, registered=True)
    (ev, ptr, n, src, desc, thread), = g._engine.finished
    assert ev is None and ptr == 0xA and thread == threading.current_thread().name
    assert not d.busy(1) and g._engine.events == 0  # nothing deferred, no event made


def test_a_description_already_here_still_queues_behind_a_deferred_receive(setup):
    g, d = setup
    g._engine.go_on.clear()  # the helper of source 1 stays inside its first finish
    d.post(object(), 0xA, 8 << 20, 1, 0, registered=True)   # deferred: no description yet
    g.comm.deliver(1)
    g.comm.deliver(1)
    time.sleep(0.05)
    d.post(object(), 0xB, 8 << 20, 1, 0, registered=True)   # its description is here, 0xA is not done
    assert d.busy(1) and g._engine.events == 2               # so it was deferred too
    g._engine.go_on.set()
    _until(lambda: not d.busy(1))
    assert [(f[1], f[5]) for f in g._engine.finished] == [(0xA, "linkwise-gpu-recv-from-1"),
                                                          (0xB, "linkwise-gpu-recv-from-1")]


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

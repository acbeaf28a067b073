"""DeferredReceives (linkwise/cuda/deferred.py) against a fake engine and a fake host channel,
so its routing, order, failure and close contracts are checked without a GPU (the GPU tests
are in test_gpu_deferred.py)."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from linkwise.cuda.deferred import DeferredReceives
from linkwise.cuda.registered import DESC_BYTES, _REG_TAG
from linkwise.errors import PeerError


class FakeEngine:
    def __init__(self):
        self.events = 0
        self.finished = []  # (event, ptr, nbytes, src, desc, thread name)
        self.aborted = []
        self.lock = threading.Lock()

    def recv_defer_begin(self, src, stream):
        self.events += 1
        return self.events

    def recv_defer_finish(self, event, ptr, nbytes, src, desc):
        with self.lock:
            self.finished.append((event, ptr, nbytes, src, desc, threading.current_thread().name))

    def abort(self, peer):
        self.aborted.append(peer)


class FakeComm:
    """recv(msg, src, tag) takes the next description `deliver`ed from src (blocks until then)."""

    def __init__(self, size):
        self.boxes = [queue.Queue() for _ in range(size)]

    def deliver(self, src, flag=1, fill=0xAB):
        self.boxes[src].put(bytes([flag]) + bytes([fill]) * DESC_BYTES)

    def fail(self, src, exc):
        self.boxes[src].put(exc)

    def recv(self, msg, src, tag):
        assert tag == _REG_TAG
        got = self.boxes[src].get(timeout=10)
        if isinstance(got, BaseException):
            raise got
        msg[:] = list(got)


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
    time.sleep(0.2)
    assert g._engine.finished == []

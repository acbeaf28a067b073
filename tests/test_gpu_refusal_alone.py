"""A GPU collective argument that only one rank can check (the root's out of a broadcast),
refused there: the others may have enqueued their kernels already, so the refusing rank stops
every rank's GPU plane through the engine (GpuEngine::refuse) instead of leaving them waiting
until LINKWISE_TIMEOUT (bench/gpu_open_issues probe_10). These tests drive GpuComm.broadcast
with a stand-in engine, so they run without a GPU; the GPU test is in test_gpu_review_fixes.py.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from linkwise._coll_args import REFUSED_UNDER_NUMBER
from linkwise.cuda.gpu_comm import GpuComm
from multirank import run_ranks


class Arr:
    """A CUDA array known only by __cuda_array_interface__ (nothing dereferences it here)."""

    def __init__(self, ptr: int, count: int, typestr: str = "<f4"):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "stream": None}


class Engine:
    """Records what GpuComm asked of the engine."""

    def __init__(self):
        self.calls = []

    def check(self):
        pass

    def refuse(self, stream):
        self.calls.append(("refuse", stream))
        return True

    def broadcast_from(self, src, x, nbytes, root, stream):
        self.calls.append(("broadcast_from", nbytes, root, stream))


class HostComm:
    """The CPU communicator as _refused_alone sees it."""

    def __init__(self):
        self.skipped = 0

    def _skip_call(self):
        self.skipped += 1


def _gpu_comm(rank: int, size: int = 2, staged: bool = False, comm=None) -> GpuComm:
    g = GpuComm.__new__(GpuComm)  # no CUDA: only what broadcast reads
    g.comm = HostComm() if comm is None else comm
    g.rank, g.size, g._closed, g.device = rank, size, False, None
    g._engine, g._staged, g._bcast_reg_min = Engine(), object() if staged else None, 1 << 62
    return g


def test_the_roots_refusal_of_its_out_stops_the_others_on_the_stream_of_the_call():
    g = _gpu_comm(rank=0)
    with pytest.raises(ValueError) as err:
        g.broadcast(Arr(0x1000, 100), root=0, out=Arr(0x9000, 101), stream=77)
    assert g._engine.calls == [("refuse", 77)]  # before: nothing, the others waited
    assert "same size on the root" in str(err.value)
    assert "stopped on every rank" in str(err.value)
    # and the host collective number the others may be waiting in is refused, once
    assert g.comm.skipped == 1 and getattr(err.value, REFUSED_UNDER_NUMBER)


def test_an_out_of_another_dtype_is_refused_alone_too():
    g = _gpu_comm(rank=1)
    with pytest.raises(ValueError):
        g.broadcast(Arr(0x1000, 100), root=1, out=Arr(0x9000, 100, "<i4"), stream=5)
    assert g._engine.calls == [("refuse", 5)]


@pytest.mark.parametrize("rank, out_count", [(1, 101),  # a non-root's out sets the size it receives
                                             (0, 100)])  # the root's out matches x
def test_nothing_is_refused_when_the_call_is_valid_here(rank, out_count):
    g = _gpu_comm(rank=rank)
    g.broadcast(Arr(0x1000, 100), root=0, out=Arr(0x9000, out_count), stream=3)
    assert g._engine.calls == [("broadcast_from", out_count * 4, 0, 3)]
    assert g.comm.skipped == 0


@pytest.mark.parametrize("size, staged", [(1, False), (2, True)])
def test_nobody_to_stop_alone_or_host_staged(size, staged):
    g = _gpu_comm(rank=0, size=size, staged=staged)
    with pytest.raises(ValueError) as err:
        g.broadcast(Arr(0x1000, 100), root=0, out=Arr(0x9000, 101), stream=3)
    assert g._engine.calls == [] and "stopped" not in str(err.value)
    assert g.comm.skipped == (size > 1)  # host-staged: its host exchanges are told


# -- the others in a host exchange of the call (the registered path's descriptions) -------------
def _host_exchange_body(comm, via):
    if comm.rank == 0:
        g = _gpu_comm(rank=0, comm=comm)
        comm._gpu_comm = g  # comm.broadcast of CUDA arrays goes to this stand-in
        seq = comm._coll_seq
        try:
            call = comm.broadcast if via == "comm" else g.broadcast
            call(Arr(0x1000, 100), root=0, out=Arr(0x9000, 101))
            outcome = "no error"
        except ValueError as exc:
            outcome = str(exc)
        comm._gpu_comm = None
        comm._store.barrier("test/refused", 2, timeout=60)  # alive until the other is done
        return outcome, comm._coll_seq - seq
    t0 = time.monotonic()
    try:  # what registered.reg_many does on the others before anything is enqueued
        comm.all_gather(np.zeros(89, np.uint8))
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    comm._store.barrier("test/refused", 2, timeout=60)
    return outcome, seconds


@pytest.mark.parametrize("via", ["comm", "g"])
def test_the_others_in_a_host_exchange_of_the_call_are_told_at_once(via):
    """Through GpuComm.broadcast itself the others waited in the registered path's host
    all_gather until the timeout (through comm.broadcast its wrapper told them)."""
    (root, numbered), (other, seconds) = run_ranks(2, _host_exchange_body, via,
                                                   env={"LINKWISE_TIMEOUT": "10"}, timeout=60)
    assert "same size on the root" in root and numbered == 1, root
    assert other.startswith("ValueError") and "rank 0 refused" in other, other
    assert seconds < 5, (other, seconds)

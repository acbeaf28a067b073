"""GPU call arguments refused on one rank: the others may have enqueued their kernels already,
so the refusing rank stops every rank's GPU plane through the engine (GpuEngine::refuse, from
cuda/refusal.py) instead of leaving them waiting until LINKWISE_TIMEOUT: a check only the root
makes (its out of a broadcast, bench/gpu_open_issues probe_10) and every other check of every
entry (an out of another size or dtype on one rank, a bad op, stream, root...). These tests drive
GpuComm and _gpu_coll.dispatch with a stand-in engine, so they run without a GPU; the GPU tests
are in test_gpu_open_fixes.py.
"""
from __future__ import annotations

import time
import types

import numpy as np
import pytest

from linkwise._coll_args import REFUSED_UNDER_NUMBER
from linkwise import _gpu_coll
from linkwise.collectives import CollectivesMixin
from linkwise.cuda.gpu_comm import GpuComm
from linkwise.cuda.sendrecv import gpu_sendrecv
from multirank import run_ranks


class Arr:
    """A CUDA array known only by __cuda_array_interface__ (nothing dereferences it here);
    `strides` makes it non-contiguous, `device` names its CUDA ordinal (as cupy's .device.id)."""

    def __init__(self, ptr: int, count: int, typestr: str = "<f4", strides=None, device=None):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "stream": None,
                                         "strides": strides}
        self.shape = (count,)
        if device is not None:
            self.device = types.SimpleNamespace(id=device)


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
    """The CPU communicator as the refusal path (refusal.py) and _gpu_coll.dispatch see it."""

    size = 2
    _root = CollectivesMixin._root

    def __init__(self):
        self.skipped = 0
        self._gpu_comm = None

    def _skip_call(self):
        self.skipped += 1


class Staged:
    """The host-staged path as the refusal path sees it: the channels it stops."""

    def __init__(self, channels=1):
        self.stops = []
        self.channels = channels

    def stop(self, failed):
        self.stops.append(failed)
        return self.channels


def _gpu_comm(rank: int, size: int = 2, staged: bool = False, comm=None) -> GpuComm:
    g = GpuComm.__new__(GpuComm)  # no CUDA: only what broadcast reads
    g.comm = HostComm() if comm is None else comm
    g.rank, g.size, g._closed, g.device = rank, size, False, 0
    g._engine, g._staged, g._bcast_reg_min = Engine(), Staged() if staged else None, 1 << 62
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


def test_nobody_to_stop_alone():
    g = _gpu_comm(rank=0, size=1)
    with pytest.raises(ValueError) as err:
        g.broadcast(Arr(0x1000, 100), root=0, out=Arr(0x9000, 101), stream=3)
    assert g._engine.calls == [] and "stopped" not in str(err.value)
    assert g.comm.skipped == 0


def test_host_staged_stops_its_channels_instead_of_the_device_words():
    """Host-staged there are no mapped peers to write to: the refusal stops this rank's
    StageChannels (a peer waiting in one raises at once; before, it waited until the timeout)
    and, being a collective, refuses the host collective number too."""
    g = _gpu_comm(rank=0, staged=True)
    with pytest.raises(ValueError) as err:
        g.broadcast(Arr(0x1000, 100), root=0, out=Arr(0x9000, 101), stream=3)
    assert g._engine.calls == [] and g._staged.stops == [False]
    assert "stopped here and in its host-staged channels" in str(err.value)
    assert "every rank" not in str(err.value)  # only the ranks sharing a channel are told
    assert g.comm.skipped == 1


def test_host_staged_with_no_channel_yet_claims_no_stop():
    g = _gpu_comm(rank=0, staged=True)
    g._staged.channels = 0
    with pytest.raises(ValueError) as err:
        g.broadcast(Arr(0x1000, 100), root=0, out=Arr(0x9000, 101), stream=3)
    assert g._staged.stops == [False] and "stopped" not in str(err.value)


# -- the others in a host exchange of the call (the registered path's descriptions) -------------
def _waits_in_a_host_exchange(comm):
    """The other rank: waits in a host collective, as registered.reg_many does before anything is
    enqueued; returns what it raised (or "no error") and the seconds it waited."""
    t0 = time.monotonic()
    try:
        comm.all_gather(np.zeros(89, np.uint8))
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    comm._store.barrier("test/refused", 2, timeout=60)
    return outcome, seconds


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
    return _waits_in_a_host_exchange(comm)


@pytest.mark.parametrize("via", ["comm", "g"])
def test_the_others_in_a_host_exchange_of_the_call_are_told_at_once(via):
    """Through GpuComm.broadcast itself the others waited in the registered path's host
    all_gather until the timeout (through comm.broadcast its wrapper told them)."""
    (root, numbered), (other, seconds) = run_ranks(2, _host_exchange_body, via,
                                                   env={"LINKWISE_TIMEOUT": "10"}, timeout=60)
    assert "same size on the root" in root and numbered == 1, root
    assert other.startswith("ValueError") and "rank 0 refused" in other, other
    assert seconds < 5, (other, seconds)


# -- every argument refusal of the GPU plane's calls, not only the root's -------------------------
# An argument every rank checks alike but that is wrong on one rank only (an out of another size
# there) was raised there alone: the others' kernels waited until LINKWISE_TIMEOUT. Each case:
# (the call on a rank's GpuComm g, the error type, words of the message, the stream refused on).
X, OUT = 0x1000, 0x9000
REFUSED_CALLS = {
    "all_reduce out size": (lambda g: g.all_reduce(Arr(X, 100), out=Arr(OUT, 101), stream=7),
                            ValueError, "same size and dtype", 7),
    "all_reduce out dtype": (lambda g: g.all_reduce(Arr(X, 100), out=Arr(OUT, 100, "<i4"), stream=7),
                             ValueError, "same size and dtype", 7),
    "all_reduce dtype": (lambda g: g.all_reduce(Arr(X, 100, "|u1"), stream=7),
                         TypeError, "not supported on GPU", 7),
    "all_reduce op": (lambda g: g.all_reduce(Arr(X, 100), op="median", stream=7),
                      ValueError, "op must be one of", 7),
    "all_reduce algo": (lambda g: g.all_reduce(Arr(X, 100), algo="fast", stream=7),
                        ValueError, "algo must be one of", 7),  # before: KeyError
    "all_reduce strided": (lambda g: g.all_reduce(Arr(X, 100, strides=(8,)), stream=7),
                           ValueError, "C-contiguous", 7),
    "all_reduce device": (lambda g: g.all_reduce(Arr(X, 100, device=3), stream=7),
                          ValueError, "cuda:3", 7),
    "all_reduce stream": (lambda g: g.all_reduce(Arr(X, 100), stream="s"),
                          TypeError, "stream", 0),  # no stream to name: the legacy one
    "reduce_scatter out": (lambda g: g.reduce_scatter(Arr(X, 100), Arr(OUT, 49), stream=7),
                           ValueError, "size * len(out)", 7),
    "broadcast root": (lambda g: g.broadcast(Arr(X, 100), root=2, stream=7),
                       ValueError, "out of range", 7),
    "all_gather out dtype": (lambda g: g.all_gather(Arr(X, 100), Arr(OUT, 200, "<f8"), stream=7),
                             ValueError, "float32 array of 200", 7),
    "all_to_all count": (lambda g: g.all_to_all(Arr(X, 101), Arr(OUT, 101), stream=7),
                         ValueError, "not a multiple", 7),
    "all_to_all out": (lambda g: g.all_to_all(Arr(X, 100), Arr(OUT, 102), stream=7),
                       ValueError, "float32 array of 100", 7),
    "barrier stream": (lambda g: g.barrier(stream=object()), TypeError, "stream", 0),
}


@pytest.mark.parametrize("case", sorted(REFUSED_CALLS))
def test_a_collective_refused_on_one_rank_stops_the_others(case):
    call, kind, words, stream = REFUSED_CALLS[case]
    g = _gpu_comm(rank=1)
    with pytest.raises(kind) as err:
        call(g)
    assert type(err.value) is kind  # the type and the message the user sees are kept
    assert words in str(err.value) and "stopped on every rank" in str(err.value), err.value
    assert g._engine.calls == [("refuse", stream)]  # before: nothing, the others waited
    assert g.comm.skipped == 1 and getattr(err.value, REFUSED_UNDER_NUMBER)  # one number, once


POINT_TO_POINT = {
    "send strided": (lambda g: g.send(Arr(X, 100, strides=(8,)), 0, stream=7), ValueError),
    "recv device": (lambda g: g.recv(Arr(X, 100, device=3), 0, stream=7), ValueError),
    "sendrecv overlap": (lambda g: gpu_sendrecv(g, Arr(X, 100), 0, Arr(X + 200, 100), 0, 0, 0, 7),
                         ValueError),
}


@pytest.mark.parametrize("case", sorted(POINT_TO_POINT))
def test_a_refused_send_or_receive_stops_the_peer_without_a_collective_number(case):
    """The peer's receive (send) kernel waits for this rank's half; a point-to-point call takes
    no collective number, so none is refused on the host."""
    call, kind = POINT_TO_POINT[case]
    g = _gpu_comm(rank=1)
    with pytest.raises(kind) as err:
        call(g)
    assert g._engine.calls == [("refuse", 7)] and "stopped on every rank" in str(err.value)
    assert g.comm.skipped == 0 and not getattr(err.value, REFUSED_UNDER_NUMBER, False)


# Through the Communicator (comm.all_reduce and so on -> _gpu_coll.dispatch): its own checks
# of a CUDA call, made before GpuComm's, refuse the same way once the GPU plane exists.
DISPATCHED = {
    "dtype=": (dict(op="all_reduce", dtype="float32"), TypeError, "dtype= is for host arrays"),
    "host out": (dict(op="all_gather", out=np.zeros(200, np.float32)), TypeError, "out is not"),
    "root": (dict(op="broadcast", root=5), ValueError, "out of range"),
    "reduce_scatter count": (dict(op="reduce_scatter"), ValueError, "not a multiple"),
    "all_to_all in place": (dict(op="all_to_all"), TypeError, "cannot be copied"),
}


@pytest.mark.parametrize("case", sorted(DISPATCHED))
def test_the_communicators_own_checks_of_a_cuda_call_stop_the_others(case):
    kw, kind, words = DISPATCHED[case]
    g = _gpu_comm(rank=1)
    g.comm._gpu_comm = g
    op = kw.pop("op")
    x = Arr(X, 101 if op == "reduce_scatter" else 100)
    with pytest.raises(kind) as err:
        _gpu_coll.dispatch(g.comm, op, x, stream=7, **kw)
    assert words in str(err.value) and "stopped on every rank" in str(err.value), err.value
    assert g._engine.calls == [("refuse", 7)]
    assert g.comm.skipped == 1 and getattr(err.value, REFUSED_UNDER_NUMBER)


def test_before_the_plane_exists_the_communicators_checks_raise_plainly():
    """Making the GPU plane is collective: no peer's kernel can wait for a rank that has not
    made it, so nothing is stopped (and no GPU plane is made just to refuse)."""
    comm = HostComm()
    with pytest.raises(TypeError, match="dtype= is for host arrays") as err:
        _gpu_coll.dispatch(comm, "all_reduce", Arr(X, 100), dtype="float32")
    assert "stopped" not in str(err.value) and comm.skipped == 0 and comm._gpu_comm is None


def _comm_refusal_body(comm, op):
    """Rank 0 refuses a CUDA call through the Communicator (its GPU plane a stand-in); rank 1
    waits in a host exchange of that call number, as the registered path's would."""
    if comm.rank == 0:
        g = _gpu_comm(rank=0, comm=comm)
        comm._gpu_comm = g
        seq = comm._coll_seq
        try:
            if op == "all_reduce":
                comm.all_reduce(Arr(X, 100), out=Arr(OUT, 101))
            elif op == "all_gather":
                comm.all_gather(Arr(X, 100), out=Arr(OUT, 200, "<i4"))
            else:
                comm.barrier(stream=5, async_op=True)
            outcome = "no error"
        except (ValueError, TypeError) as exc:
            outcome = str(exc)
        calls = g._engine.calls
        comm._gpu_comm = None
        comm._store.barrier("test/refused", 2, timeout=60)
        return outcome, comm._coll_seq - seq, calls
    return (*_waits_in_a_host_exchange(comm), None)


@pytest.mark.parametrize("op, stream", [("all_reduce", 0), ("all_gather", 0), ("barrier", 5)])
def test_a_refusal_through_the_communicator_takes_one_number_and_tells_everyone(op, stream):
    (mine, numbered, calls), (other, seconds, _) = run_ranks(
        2, _comm_refusal_body, op, env={"LINKWISE_TIMEOUT": "10"}, timeout=60)
    assert "stopped on every rank" in mine and calls == [("refuse", stream)], (mine, calls)
    assert numbered == 1, numbered  # not a second skip by the Communicator's wrapper
    assert other.startswith("ValueError") and "rank 0 refused" in other, other
    assert seconds < 5, (other, seconds)

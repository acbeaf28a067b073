"""The GPU plane's setup (linkwise/cuda/plane_setup.py, GpuComm's constructor and close) with a
stand-in for the CUDA engine, so that its store exchanges run between real communicators
without a GPU (the GPU tests are in test_gpu_setup.py):
 * a rank that refuses the arguments of its first GPU call (before its plane exists) makes the
   ranks that passed theirs raise ValueError naming it at once; before, they waited for its card
   in the plane's setup until LINKWISE_TIMEOUT. The ranks stay in step: the next plane is made
   and the next host collective pairs;
 * a rank that dies during the setup (before its card, before its IPC handle, before the
   barrier after mapping) makes the others raise PeerError naming it at once, as a split's
   setup does; before, they waited until LINKWISE_TIMEOUT. A rank that dies before close()'s
   barrier no longer holds the others' close() up until the timeout either.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from multirank import run_ranks

TIMEOUT = "30"  # LINKWISE_TIMEOUT: far longer than any rank may take here
PROMPT = 5.0    # seconds within which the others must have raised


class Arr:
    """A CUDA array known only by __cuda_array_interface__ (the stand-in engine never reads it)."""

    def __init__(self, ptr: int = 0x1000, count: int = 100):
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": "<f4", "data": (ptr, False),
                                         "version": 3, "stream": None, "strides": None}
        self.shape = (count,)


class FakeGpuEngine:
    """What GpuComm's constructor, gpu_comm()'s FastPath and close() ask of a GpuEngine.
    `die_in` (class attribute, set on one rank): the method whose call SIGKILLs the process."""

    die_in = ""

    def __init__(self, rank, size, device, slot, timeout):
        self.rank, self.slot_bytes = rank, slot
        self.opened = None
        self._die("init")

    def _die(self, where: str) -> None:
        if self.die_in == where:
            os.kill(os.getpid(), signal.SIGKILL)

    def reg_cache_limits(self, entries, nbytes):
        pass

    def watch_peers(self, pids):
        pass

    def ipc_handle(self) -> bytes:
        self._die("ipc_handle")
        return f"handle of rank {self.rank}".encode()

    def open_peers(self, handles):
        self._die("open_peers")
        self.opened = [bytes(h) for h in handles]

    def all_reduce_fast(self, *args):
        raise AssertionError("no GPU work here")

    broadcast_fast = all_reduce_fast

    def synchronize(self, stream):
        pass

    def error_code(self) -> int:
        return 0

    def close(self):
        pass


def _stand_in(die_in: str = "") -> None:
    """This process's native module makes FakeGpuEngines and sees one CUDA device."""
    from linkwise import _native
    FakeGpuEngine.die_in = die_in
    _native._GpuEngine = FakeGpuEngine
    _native.cuda_device_count = lambda: 1


# -- a refusal of the first GPU call ------------------------------------------------------------
FIRST_CALLS = {  # case -> (the refusing rank's call, the others' call, words of its error)
    "all_reduce dtype=": (lambda comm: comm.all_reduce(Arr(), dtype="float32"),
                          lambda comm: comm.all_reduce(Arr()), "dtype= is for host arrays"),
    "broadcast root": (lambda comm: comm.broadcast(Arr(), root=7),
                       lambda comm: comm.broadcast(Arr(), root=0), "out of range"),
    "all_gather host out": (lambda comm: comm.all_gather(Arr(), out=np.zeros(200, np.float32)),
                            lambda comm: comm.all_gather(Arr(), out=Arr(0x9000, 200)), "out is not"),
    "barrier async_op": (lambda comm: comm.barrier(stream=5, async_op=True),
                         lambda comm: comm.barrier(stream=5), "async_op=True cannot be combined"),
}


def _first_call_refused(comm, case):
    _stand_in()
    mine, theirs, _ = FIRST_CALLS[case]
    comm.barrier()
    t0 = time.monotonic()
    try:
        (mine if comm.rank == 0 else theirs)(comm)
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - the kind is what is tested
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    # In step afterwards: the next plane is made on every rank (the same store key) and the
    # next host collective pairs with the same call on the other rank.
    g = comm.cuda()
    total = comm.all_reduce(np.array([comm.rank + 1.0]))
    return outcome, seconds, g._engine.opened, float(total[0])


@pytest.mark.parametrize("case", sorted(FIRST_CALLS))
def test_a_refusal_of_the_first_gpu_call_reaches_the_ranks_making_the_plane(case):
    out = run_ranks(3, _first_call_refused, case, env={"LINKWISE_TIMEOUT": TIMEOUT}, timeout=90)
    words = FIRST_CALLS[case][2]
    assert words in out[0][0] and "stopped" not in out[0][0], out  # its own error, plainly
    for rank in (1, 2):
        outcome, seconds, _, _ = out[rank]
        assert outcome.startswith(f"ValueError: rank {rank}: rank 0 refused the arguments of its "
                                  "first GPU call"), out
        assert words in outcome and seconds < PROMPT, out
    handles = [f"handle of rank {r}".encode() for r in range(3)]
    assert all(o[2] == handles and o[3] == 6.0 for o in out), out


def test_a_barriers_refusal_reaches_them_under_linkwise_check_too():
    """barrier(stream=) has no agreement exchange: the others go straight to making the plane."""
    out = run_ranks(2, _first_call_refused, "barrier async_op", timeout=90,
                    env={"LINKWISE_TIMEOUT": TIMEOUT, "LINKWISE_CHECK": "1"})
    assert out[0][0].startswith("TypeError") and out[1][0].startswith("ValueError: rank 1: rank 0 refused"), out
    assert out[1][1] < PROMPT and out[0][2] == out[1][2] and out[0][3] == 3.0, out


def _refused_under_check(comm):
    """LINKWISE_CHECK: the others of a collective meet the refusing rank in the agreement
    exchange first, which tells them; no card is sent to a setup nobody makes."""
    _stand_in()
    try:
        if comm.rank == 0:
            comm.all_reduce(Arr(), dtype="float32")
        else:
            comm.all_reduce(Arr())
        outcome = "no error"
    except (ValueError, TypeError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    g = comm.cuda()  # the plane's store key is still the same on both ranks
    return outcome, g._engine.opened


def test_under_linkwise_check_the_agreement_exchange_tells_them_and_keys_stay_in_step():
    out = run_ranks(2, _refused_under_check, env={"LINKWISE_TIMEOUT": TIMEOUT, "LINKWISE_CHECK": "1"},
                    timeout=90)
    assert out[0][0].startswith("TypeError") and out[1][0].startswith("ValueError"), out
    assert out[0][1] == out[1][1] == [b"handle of rank 0", b"handle of rank 1"], out


# -- a rank that dies during the setup ---------------------------------------------------------------
def _death_in_setup(comm, point):
    victim = comm.size - 1
    _stand_in(point if comm.rank == victim else "")
    comm.barrier()  # every rank's init() is done: the store no longer watches any of them
    if comm.rank == victim and point == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        comm.cuda()
        outcome = ("made", None, "")
    except Exception as exc:  # noqa: BLE001 - the kind is what is tested
        outcome = (type(exc).__name__, getattr(exc, "peer", None), str(exc))
    seconds = time.monotonic() - t0
    time.sleep(1.0 if comm.rank == 0 else 0.5)  # rank 0 hosts the store: the last to leave
    return outcome, seconds


@pytest.mark.parametrize("point, transport", [
    ("before", "auto"),      # never reaches its first GPU call: the others wait for its card
    ("init", "auto"),        # dies making its engine: the others wait for its IPC handle
    ("ipc_handle", "tcp"),   # the same over TCP links (its end shows once the stream is read)
    ("open_peers", "auto"),  # dies mapping the others' areas: they wait at the barrier after
])
def test_a_rank_that_dies_in_the_planes_setup_is_named_at_once(point, transport):
    out = run_ranks(3, _death_in_setup, point, expect_fail=True, timeout=90,
                    env={"LINKWISE_TIMEOUT": TIMEOUT, "LINKWISE_TRANSPORT": transport})
    assert out[2][0] == "died", out
    for rank in (0, 1):
        assert out[rank][0] == "ok", out
        (name, peer, message), seconds = out[rank][1]
        assert (name, peer) == ("PeerError", 2), out
        assert f"rank {rank}: rank 2 died or left during the GPU plane's setup" in message, out
        assert seconds < PROMPT, out


def _death_before_close(comm):
    _stand_in()
    g = comm.cuda()
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    g.close()  # its barrier: rank 1 never comes
    return time.monotonic() - t0


def test_a_rank_that_dies_before_close_does_not_hold_the_others_close_up():
    out = run_ranks(2, _death_before_close, expect_fail=True, timeout=90,
                    env={"LINKWISE_TIMEOUT": TIMEOUT})
    assert out[1][0] == "died" and out[0][0] == "ok" and out[0][1] < PROMPT, out

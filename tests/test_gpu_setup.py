"""The GPU plane's setup on a GPU (cuda/plane_setup.py; the same logic against a stand-in engine,
without a GPU, is in test_gpu_setup_model.py):
 * a rank that refuses the arguments of its first GPU call, before its plane exists, makes the
   other ranks, waiting for it in the plane's setup, raise ValueError naming it at once instead
   of at LINKWISE_TIMEOUT; afterwards every rank makes the plane on its next call and the
   results are right;
 * a rank that dies during the setup makes the others raise PeerError naming it at once.
Two or more ranks (two share the GPU on a one-GPU machine: the setup maps the peer's area
through CUDA IPC as between GPUs). The timeout is long (30 s): only the fixes can end the others'
waits within the few seconds allowed.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from multirank import run_ranks
from test_gpu_collectives import SAFE_ENV, _two_or_more

pytestmark = pytest.mark.gpu

TIMEOUT = 30.0  # LINKWISE_TIMEOUT
PROMPT_S = 8.0  # the others must have raised within this many seconds of their call


def _own_device(comm):
    """torch, with this rank's current device the one its plane will pick (local_rank % count)."""
    import torch
    torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
    return torch


def _first_call_refused(comm):
    import numpy as np
    torch = _own_device(comm)
    x = torch.ones(1000, device="cuda")
    torch.cuda.synchronize()
    comm.barrier()
    t0 = time.monotonic()
    try:
        if comm.rank == 0:
            comm.all_reduce(x, dtype="float32")  # refused here, before rank 0's plane exists
        else:
            comm.all_reduce(x)  # makes the plane: waits there for rank 0's card
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - the kind is what is tested
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    comm.all_reduce(x)  # every rank makes the plane now, under the same store key
    torch.cuda.synchronize()
    total = comm.all_reduce(np.array([1.0]))  # the host collectives' numbers are in step too
    return outcome, seconds, float(x.sum().item()), float(total[0])


def test_a_refusal_of_the_first_gpu_call_reaches_the_ranks_making_the_plane():
    n = _two_or_more()
    out = run_ranks(n, _first_call_refused, env={**SAFE_ENV, "LINKWISE_TIMEOUT": str(TIMEOUT)},
                    timeout=4 * TIMEOUT)
    assert out[0][0].startswith("TypeError: all_reduce: dtype= is for host arrays"), out
    for r in range(1, n):
        outcome, seconds, _, _ = out[r]
        assert outcome.startswith(f"ValueError: rank {r}: rank 0 refused the arguments of its first "
                                  "GPU call (TypeError: all_reduce: dtype= is for host arrays"), out
        assert seconds < PROMPT_S, out  # before: TimeoutError after 30 s
    assert all(o[2] == 1000.0 * n and o[3] == float(n) for o in out), out


class _DiesMapping:
    """A GpuEngine whose open_peers SIGKILLs the process (the others then wait at the barrier
    after mapping); everything else goes to the real engine."""

    def __init__(self, engine):
        object.__setattr__(self, "_engine", engine)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        setattr(self._engine, name, value)

    def open_peers(self, handles):
        os.kill(os.getpid(), signal.SIGKILL)


def _death_in_setup(comm, point):
    from linkwise import PeerError, _native
    from linkwise.cuda import gpu_comm
    from linkwise.cuda.gpu_comm import GpuComm
    torch = _own_device(comm)
    victim = comm.size - 1
    # A first plane, closed again: module loading (and a JIT of the PTX on a build without
    # code for this GPU) is done before the clock starts. The timed plane is a second one.
    g0 = gpu_comm(comm)
    x = torch.ones(1000, device="cuda")
    g0.all_reduce(x)
    g0.synchronize()
    g0.close()
    comm.barrier()
    if comm.rank == victim:
        if point == "before":  # never starts the second plane: the others wait for its card
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        real = _native._GpuEngine
        _native._GpuEngine = lambda *args: _DiesMapping(real(*args))
    made = []  # the engines GpuComm makes here
    real_engine = _native._GpuEngine
    _native._GpuEngine = lambda *args: made.append(real_engine(*args)) or made[-1]
    t0 = time.monotonic()
    kept = None  # the exception, held as a logger or a retry loop would hold it
    try:
        GpuComm(comm).close()
        outcome = ("made", -1, "")
    except PeerError as exc:
        outcome, kept = ("PeerError", exc.peer, str(exc)), exc
    except Exception as exc:  # noqa: BLE001 - the kind is what is tested
        outcome, kept = (type(exc).__name__, -1, str(exc)), exc
    seconds = time.monotonic() - t0
    # The failed GpuComm is still alive (kept's traceback holds it), its engine must not be:
    # it held the scratch, the pinned flags, the watcher thread until the exception went.
    outcome += (kept is not None and bool(made) and made[-1].closed,)
    time.sleep(1.0 if comm.rank == 0 else 0.5)  # rank 0 hosts the store: the last to leave
    return outcome, seconds


@pytest.mark.parametrize("point", ["before", "open_peers"])
def test_a_rank_that_dies_in_the_planes_setup_is_named_at_once(point):
    n = _two_or_more()
    out = run_ranks(n, _death_in_setup, point, env={**SAFE_ENV, "LINKWISE_TIMEOUT": str(TIMEOUT)},
                    timeout=4 * TIMEOUT, expect_fail=True)
    assert out[-1][0] == "died", out
    for r in range(n - 1):
        assert out[r][0] == "ok", out
        (name, peer, message, released), seconds = out[r][1]
        assert (name, peer) == ("PeerError", n - 1), out  # before: TimeoutError after 30 s
        assert f"rank {n - 1} died or left during the GPU plane's setup" in message, out
        assert seconds < PROMPT_S, out
        if point == "open_peers":  # the engine was made before the failure: released at once
            assert released, out

"""Host-staged GPU path (LINKWISE_P2P_DISABLE=1), ranks of one host: a rank that refuses a
call's arguments, or whose GPU plane stops for a failure of its own, stops the StageChannels it
has (csrc/cuda/stage_channel.h, "Stopping"; staged.py). A peer waiting in one of them used to
wait until LINKWISE_TIMEOUT; now it raises at once, naming that rank, and so does every later
GPU call of the communicator on every rank.

Each body first moves data through the channel it then waits in, so the channel exists (a peer
with no channel yet waits in a host exchange, which the refusal's host notice ends).
"""
from __future__ import annotations

import time

import pytest

from multirank import run_ranks
from test_gpu_collectives import SAFE_ENV, _setup, _two_or_more

pytestmark = pytest.mark.gpu

ENV = {**SAFE_ENV, "LINKWISE_P2P_DISABLE": "1", "LINKWISE_CHUNK_SIZE": "65536",
       "LINKWISE_TIMEOUT": "30"}
PROMPT_S = 8.0  # well under LINKWISE_TIMEOUT


def _outcome(fn):
    """(what fn raised or "no error", seconds it took)."""
    t0 = time.monotonic()
    try:
        fn()
        return "no error", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0


def _stop_body(comm, case):
    g, torch = _setup(comm)
    n = (1 << 20) // 4  # 16 chunks of the channel's 64 KiB
    x = torch.full((n,), float(comm.rank + 1), device="cuda")
    y = torch.zeros(n, device="cuda")
    if case == "broadcast":  # the root's out is refused (only the root checks it)
        g.broadcast(x, root=0)  # makes the broadcast channel
        bad_out = torch.empty(n + 1, device="cuda")
        call = (lambda: g.broadcast(x, root=0, out=bad_out)) if comm.rank == 0 else \
            (lambda: (g.broadcast(y, root=0), g.synchronize()))
    else:  # rank 1 -> rank 0 send / recv; rank 1 refuses its send (non-contiguous) or aborts
        if comm.rank == 1:
            g.send(x, 0)
        elif comm.rank == 0:
            g.recv(y, 1)
        if comm.rank == 0:
            call = lambda: (g.recv(y, 1), g.synchronize())  # noqa: E731
        elif comm.rank == 1:
            call = (lambda: g.send(x[::2], 0)) if case == "send" else g.abort
        else:
            call = g.synchronize  # ranks past the first two take no part
    torch.cuda.synchronize()
    comm._store.barrier(f"test/stop/{case}", comm.size, timeout=60)
    first = _outcome(call)
    later = _outcome(lambda: g.all_reduce(torch.ones(4, device="cuda")))
    comm._store.barrier(f"test/stop/{case}/end", comm.size, timeout=60)  # all alive until here
    return first, later


@pytest.mark.parametrize("case", ["broadcast", "send", "abort"])
def test_a_stopping_rank_ends_the_waits_in_its_channels(case):
    # A point-to-point stop reaches only the pair's channel: a third rank would go on into the
    # all_reduce below and wait there for the two that raise, so those cases run two ranks.
    n = _two_or_more() if case == "broadcast" else 2
    res = run_ranks(n, _stop_body, case, env=ENV, timeout=150)
    stopper = 0 if case == "broadcast" else 1
    waiters = range(1, n) if case == "broadcast" else [0]
    (mine, _), (my_later, _) = res[stopper]
    if case == "abort":
        assert mine == "no error", res
        assert my_later.startswith("PeerError"), res
        want = ("PeerError", f"rank {stopper}'s GPU operations")
    else:
        assert mine.startswith("ValueError") and "stopped here and in its host-staged channels" in mine, res
        assert my_later.startswith("CommAbortedError") and "this rank refused" in my_later, res
        want = ("CommAbortedError", f"rank {stopper} refused")
    for r in waiters:
        (first, took), (later, _) = res[r]
        assert first.startswith(want[0]) and want[1] in first, (r, res)
        assert took < PROMPT_S, (r, res)
        assert later.startswith(want[0]) and want[1] in later, (r, res)

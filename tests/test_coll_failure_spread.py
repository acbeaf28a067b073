"""A collective that fails on one rank must not leave the others' later calls pairing with
calls the failure put out of step: whatever form the failed call took (blocking, async_op,
await, or with the next call already queued behind it) and whether or not the shared-memory
executor was attached yet. Before these fixes, an async failure gave shifted all_reduce sums
(1001, 11 instead of 1, 21) and a failure before the executor attached made every later call
wait at the setup barrier and then fail with BootstrapError.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from multirank import run_ranks


def _kind_mismatch_then_go_on(comm, form, attached):
    """Rank 0 all_reduce (shared memory) against rank 1 all_gather (point-to-point): rank 1
    times out (LINKWISE_TIMEOUT=3); then two more all_reduces on both ranks. Returns (the
    mismatched call's outcome, the later calls' outcomes: their sums or the error's name)."""
    import linkwise

    def outcome(call):
        try:
            return call()
        except (linkwise.TimeoutError, linkwise.PeerError, linkwise.CommAbortedError) as exc:
            return type(exc).__name__

    def all_reduce(i):
        y = np.full(4, 10.0 * i + comm.rank, np.float32)
        comm.all_reduce(y)
        return float(y[0])

    if attached:
        comm.all_reduce(np.ones(4, np.float32))
    x = np.full(4, 1000.0 + comm.rank, np.float32)
    later = []
    if comm.rank == 0:
        first = outcome(lambda: comm.all_reduce(x) and "ok")
    elif form == "blocking":
        first = outcome(lambda: comm.all_gather(x) is not None and "ok")
    elif form == "async":
        first = outcome(lambda: comm.all_gather(x, async_op=True).wait() is not None and "ok")
    elif form == "await":
        first = outcome(lambda: asyncio.run(comm.aall_gather(x)) is not None and "ok")
    else:  # queued: the next all_reduce is submitted behind the failing call before any wait
        req = comm.all_gather(x, async_op=True)
        later.append(outcome(lambda: all_reduce(0)))
        first = outcome(lambda: req.wait() is not None and "ok")
    while len(later) < 2:
        later.append(outcome(lambda: all_reduce(len(later))))
    return first, later


@pytest.mark.parametrize("form,attached", [("blocking", True), ("async", True), ("await", True), ("queued", True),
                                           ("blocking", False), ("async", False)])
def test_a_failed_collective_stops_the_others(form, attached):
    out = run_ranks(2, _kind_mismatch_then_go_on, form, attached, env={"LINKWISE_TIMEOUT": "3"}, timeout=60)
    assert out[1][0] == "TimeoutError", out
    if attached:
        assert out[0][0] == "PeerError", out  # rank 1 stopped the executor rank 0 waited in
    else:
        assert out[0][0] == "TimeoutError", out  # rank 0 waited at the executor's setup
    for _, later in out:
        # Never a number: any sum would pair a call with one the failure left behind.
        assert later == ["CommAbortedError", "CommAbortedError"], out

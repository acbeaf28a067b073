"""A collective that fails on one rank must not leave the others' later calls pairing with
calls the failure put out of step: whatever form the failed call took (blocking, async_op,
await, or with the next call already queued behind it) and whether or not a collective ran
before it (the shared-memory executor was once attached at the first one). Before these
fixes, an async failure gave shifted all_reduce sums (1001, 11 instead of 1, 21) and a failure before the executor attached made every later call
wait at the setup barrier and then fail with BootstrapError.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from multirank import run_ranks


def _kind_mismatch_then_go_on(comm, form, warm):
    """Rank 0 all_reduce (shared memory) against rank 1 gather to itself, point-to-point
    (LINKWISE_ALGO set on rank 1 only, for this call: every collective within a host runs in
    the executor otherwise, where it would meet the all_reduce and raise ValueError at once,
    test_coll_mismatch.py): rank 1 times out (LINKWISE_TIMEOUT=3); then two more all_reduces on
    both ranks. Returns (the mismatched call's outcome, the later calls' outcomes: their sums
    or the error's name)."""
    import os

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

    if warm:
        comm.all_reduce(np.ones(4, np.float32))
    x = np.full(16384, 1000.0 + comm.rank, np.float32)
    later = []
    if comm.rank == 0:
        first = outcome(lambda: comm.all_reduce(x) is not None and "ok")
    else:
        os.environ["LINKWISE_ALGO"] = "ring"  # read when the call is issued
        try:
            if form == "blocking":
                first = outcome(lambda: comm.gather(x, root=1) is not None and "ok")
            elif form == "async":
                req = comm.gather(x, root=1, async_op=True)
            elif form == "await":
                first = outcome(lambda: asyncio.run(comm.agather(x, root=1)) is not None and "ok")
            else:  # queued: the next all_reduce is submitted behind the failing call before any wait
                req = comm.gather(x, root=1, async_op=True)
        finally:
            del os.environ["LINKWISE_ALGO"]
        if form == "async":
            first = outcome(lambda: req.wait() is not None and "ok")
        elif form == "queued":
            later.append(outcome(lambda: all_reduce(0)))
            first = outcome(lambda: req.wait() is not None and "ok")
    while len(later) < 2:
        later.append(outcome(lambda: all_reduce(len(later))))
    return first, later


@pytest.mark.parametrize("form,warm", [("blocking", True), ("async", True), ("await", True), ("queued", True),
                                       ("blocking", False), ("async", False)])
def test_a_failed_collective_stops_the_others(form, warm):
    """warm: a collective ran before the failing one. Either way the executor is attached
    (when the communicator was made); before that, a first collective that failed left rank
    0 waiting at the executor's set-up (TimeoutError or CommAbortedError there)."""
    # Rank 0 has the longer timeout: with equal ones it entered its wait a little earlier and
    # could time out first (its slow-wait checks come every ~0.1 s), a rare other outcome.
    out = run_ranks(2, _kind_mismatch_then_go_on, form, warm, env={"LINKWISE_TIMEOUT": ["6", "3"]}, timeout=60)
    assert out[1][0] == "TimeoutError", out
    assert out[0][0] == "PeerError", out  # rank 1 stopped the executor rank 0 waited in
    for _, later in out:
        # Never a number: any sum would pair a call with one the failure left behind.
        assert later == ["CommAbortedError", "CommAbortedError"], out


def _argument_error(comm, case, everywhere):
    """Rank 0's arguments (every rank's, with everywhere) are refused with ValueError before
    any data moves, while the others enter the call; then two all_reduces on every rank.
    Returns (first outcome, later outcomes: the sums, or the errors' names)."""
    import linkwise
    x = np.full(4, 1000.0 + comm.rank, np.float32)
    bad = everywhere or comm.rank == 0
    if case in ("latency_path_out", "async_pending"):
        comm.all_reduce(np.ones(4, np.float32))  # attach the executor: the latency path exists
    try:
        if case == "latency_path_out":  # out of another size: refused natively, on the latency path
            comm.all_reduce(np.ones(4, np.float32), out=np.zeros(5 if bad else 4, np.float32))
        elif case == "general_path_op":
            comm.all_reduce(x, op="nope" if bad else "sum")
        elif case == "point_to_point_out":
            comm.all_gather(x, out=np.zeros(7 if bad else 8, np.float32))
        elif case == "gather_read_only_out":  # out matters on the root only, but is checked everywhere
            out = np.zeros(4 * comm.size, np.float32)
            out.setflags(write=not bad)
            comm.gather(x, root=0, out=out)
        elif case == "async_pending":  # refused while an async all_reduce is still queued
            req = comm.all_reduce(np.ones(300_000, np.float32), async_op=True)
            try:
                comm.broadcast(x, root=7 if bad else 0)
            finally:
                req.wait()
        first = "ok"
    except (ValueError, TypeError, linkwise.PeerError, linkwise.CommAbortedError, linkwise.TimeoutError) as exc:
        # PeerError covers StoreClosedError: rank 0 may be gone (with the store) before rank
        # 1 reads rank 0's state while setting up the executor.
        first = "PeerError" if isinstance(exc, linkwise.PeerError) else type(exc).__name__
    later = []
    for i in range(2):
        y = np.full(4, 10.0 * i + comm.rank, np.float32)
        try:
            comm.all_reduce(y)
            later.append(float(y[0]))
        except (ValueError, linkwise.PeerError, linkwise.CommAbortedError, linkwise.TimeoutError) as exc:
            later.append("PeerError" if isinstance(exc, linkwise.PeerError) else type(exc).__name__)
    return first, later


CASES = ["latency_path_out", "general_path_op", "point_to_point_out", "gather_read_only_out", "async_pending"]


@pytest.mark.parametrize("case", CASES)
def test_arguments_refused_on_one_rank_never_pair_with_its_next_call(case):
    # Before: rank 1's call paired with rank 0's next one (sums 2001 instead of 3000 and 3),
    # with or without LINKWISE_CHECK.
    out = run_ranks(2, _argument_error, case, False, env={"LINKWISE_TIMEOUT": "3"}, timeout=60)
    assert out[0][0] == "ValueError", out
    # A gather's non-root only sends: it may return before it could notice (README)
    assert out[1][0] != "ok" or case == "gather_read_only_out", out
    for _, later in out:
        assert all(isinstance(r, str) for r in later), out  # never a sum


@pytest.mark.parametrize("case", CASES)
def test_arguments_refused_on_every_rank_leave_the_communicator_usable(case):
    out = run_ranks(2, _argument_error, case, True, env={"LINKWISE_TIMEOUT": "10"}, timeout=60)
    for first, later in out:
        assert first == "ValueError", out
        assert later == [1.0, 21.0], out  # 0+1, then 10+11


def _first_collective_fails_then_attach(comm):
    """A point-to-point gather (LINKWISE_ALGO set for this call on every rank: it never sets
    up the shared-memory executor) with another size on the root fails there (ValueError)
    while the other ranks return; the root then sleeps past the timeout before its next call.
    The others' next all_reduce (through the shared-memory executor, attached when the
    communicator was made) must raise at once, naming the root (when the executor was set up
    at the first collective instead, the set-up barrier waited for the timeout)."""
    import os

    import linkwise
    os.environ["LINKWISE_ALGO"] = "ring"
    try:
        comm.gather(np.ones(11_000 if comm.rank == 0 else 10_000, np.float32), root=0)
    except ValueError:
        pass
    finally:
        del os.environ["LINKWISE_ALGO"]
    if comm.rank == 0:
        time.sleep(4)
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(4, np.float32))
        return "ok", time.monotonic() - t0, ""
    except (linkwise.CommAbortedError, linkwise.PeerError, linkwise.TimeoutError) as exc:
        return type(exc).__name__, time.monotonic() - t0, str(exc)


def test_setup_after_a_failure_raises_at_once():
    out = run_ranks(3, _first_collective_fails_then_attach, env={"LINKWISE_TIMEOUT": "3"}, timeout=60)
    assert out[0][0] == "CommAbortedError", out  # the root's own communicator was aborted
    for kind, seconds, message in out[1:]:
        # A rank already waiting in the all_reduce when the root's gather failed reads the
        # root's `failed` word (PeerError naming it); one that enters the call after the root
        # stopped the executor finds the stop (CommAbortedError naming rank 0, as documented
        # in architecture.md). Which one depends on timing; both name the root, neither waits.
        assert seconds < 2, out
        assert (kind == "PeerError" and "failed on peer rank 0" in message) or (
            kind == "CommAbortedError" and "failed on rank 0" in message), out


def _refusals_then_broadcasts(comm, refusals, size):
    """Rank 1 refuses the first `refusals` broadcasts (out= of another size), every rank calls
    the same broadcasts from root 0. Returns each later outcome of rank 1: "ok" (its own data
    of that call), "WRONG" (another call's data) or the error's name."""
    import linkwise
    got = []
    for c in range(refusals + 3):
        x = np.full(size, 100.0 + c if comm.rank == 0 else -1.0, np.float32)
        try:
            if comm.rank == 1 and c < refusals:
                comm.broadcast(x, root=0, out=np.zeros(size + 1, np.float32))
            else:
                comm.broadcast(x, root=0)
                got.append("ok" if np.all(x == 100.0 + c) else "WRONG")
        except ValueError:
            if not (comm.rank == 1 and c < refusals):
                got.append("ValueError")
        except (linkwise.PeerError, linkwise.CommAbortedError, linkwise.TimeoutError) as exc:
            got.append(type(exc).__name__)
    return got


@pytest.mark.parametrize("refusals,size,env,nranks", [
    (16, 8, {}, 2),  # the first piece stamps kept the call number mod 16: calls 16 apart passed
    # the single-copy path (3 ranks: 2 ranks send a broadcast this large point-to-point)
    (1, 3 << 20, {"LINKWISE_COLL_THREADS": "2", "LINKWISE_COLL_CMA_BCAST_MIN": "1M"}, 3),
])
def test_refused_broadcasts_never_shift_later_ones(refusals, size, env, nranks):
    out = run_ranks(nranks, _refusals_then_broadcasts, refusals, size, env={"LINKWISE_TIMEOUT": "5", **env},
                    timeout=90)
    assert not any("WRONG" in got for got in out), out  # before: rank 1 got the data of calls 16 (1) earlier
    assert out[1] and out[1][0] != "ok", out


def _fortran_order(comm):
    x = np.ones((4, 3), np.float32, order="F")
    comm.all_reduce(np.ones(4, np.float32))  # attach: the latency path exists
    outcomes = []
    for call in (lambda: comm.all_reduce(x), lambda: comm.all_reduce(x, async_op=True).wait()):
        try:
            call()
            outcomes.append("ok")
        except ValueError as exc:
            outcomes.append("C-contiguous" if "C-contiguous" in str(exc) else str(exc))
    y = np.ones(4, np.float32)
    comm.all_reduce(y)  # refused on every rank: the communicator goes on
    return outcomes, float(y[0])


def test_fortran_order_is_refused_on_every_path():
    # Before: the latency path took it, the general path (async, LINKWISE_CHECK) refused it.
    assert run_ranks(2, _fortran_order, timeout=60) == [(["C-contiguous"] * 2, 2.0)] * 2


def _dies_before_the_first_collective(comm, call, split):
    """Rank 2 is SIGKILLed before any collective of the communicator (or, with split, after
    a split communicator's PeerError, before the parent's first collective); the others then
    call one. Returns (seconds, the error's name, the rank it names)."""
    import os
    import signal

    import linkwise
    if split:
        sub = comm.split(0, comm.rank)
        if comm.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        with pytest.raises(linkwise.PeerError):
            sub.all_reduce(np.ones(4))
    elif comm.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # rank 2 is gone by now
    t0 = time.monotonic()
    try:
        if call == "barrier":
            comm.barrier()
        else:
            comm.all_reduce(np.ones(4))
    except linkwise.LinkwiseError as exc:
        return time.monotonic() - t0, type(exc).__name__, getattr(exc, "peer", None)
    return time.monotonic() - t0, "no error", None


@pytest.mark.parametrize("call,split", [("all_reduce", False), ("barrier", False), ("all_reduce", True)])
def test_rank_dead_before_the_executor_is_set_up(call, split):
    """The executor's setup waits in slices and looks whether the rank it waits for died:
    PeerError naming rank 2 on both survivors, well before LINKWISE_TIMEOUT (20 s here; before,
    one survivor raised TimeoutError at it and the other CommAbortedError naming a survivor)."""
    got = run_ranks(3, _dies_before_the_first_collective, call, split, env={"LINKWISE_TIMEOUT": "20"},
                    timeout=60, expect_fail=True)
    assert got[2][0] == "died", got[2]
    for status, value in got[:2]:
        assert status == "ok", value
        seconds, name, peer = value
        assert (name, peer) == ("PeerError", 2), value
        assert seconds < 5, value

"""A collective that fails stops the communicator's collectives from that call on, on every
rank, but not the calls before it: a rank that is behind must still finish them with the
data its peers already sent. Over messages (LINKWISE_ALGO, TCP) the abort notice used to
fail every pending request of the rank that read it, so a late rank's earlier call raised
CommAbortedError although every rank called it alike (seen with async calls still queued,
and with a rank that closed right after a call with an async one pending).

Here rank 2 is late on purpose: ranks 0 and 1 finish a reduce to rank 2 (they only send,
small eager messages), then fail the next call between themselves; only then does rank 2
call the reduce, whose messages and the abort notices behind them wait in its links.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from multirank import run_ranks

_PATHS = {"ring": {"LINKWISE_ALGO": "ring"}, "tree": {"LINKWISE_ALGO": "tree"}, "tcp": {"LINKWISE_TRANSPORT": "tcp"}}


def _outcome(call):
    import linkwise
    try:
        return call()
    except (ValueError, linkwise.PeerError, linkwise.CommAbortedError, linkwise.TimeoutError) as exc:
        return type(exc).__name__


def _late_rank(comm, kind, failure):
    """Returns (rank 2's result of the call before the failure, or its error's name; the
    failed call's outcome; the outcome of one more call)."""
    x = np.arange(1000, dtype=np.float32) + comm.rank
    comm.barrier()
    if comm.rank == 2:
        time.sleep(1.0)  # the others finish the reduce and fail the next call meanwhile
    if kind == "reduce":
        before = _outcome(lambda: comm.reduce(x, root=2))
    else:
        before = _outcome(lambda: comm.gather(x, root=2))
    if comm.rank == 2 and not isinstance(before, str):
        before = np.asarray(before).tolist()
    if failure == "mismatch":  # ranks 0 and 1 disagree on the dtype; rank 2 calls it too, later
        y = np.ones(256, np.float32 if comm.rank != 1 else np.int32)
        failed = _outcome(lambda: comm.all_reduce(y) is not None and "ok")
    else:  # "close": rank 0 closes with an async all_reduce pending; the others call it
        y = np.ones(256, np.float32)
        if comm.rank == 0:
            comm.all_reduce(y, async_op=True)
            comm.close()
            return before, "closed", "closed"
        failed = _outcome(lambda: comm.all_reduce(y) is not None and "ok")
    after = _outcome(lambda: comm.all_reduce(np.ones(4, np.float32)) is not None and "ok")
    return before, failed, after


@pytest.mark.parametrize("path", sorted(_PATHS))
@pytest.mark.parametrize("kind,failure", [("reduce", "mismatch"), ("gather", "mismatch"), ("reduce", "close")])
def test_a_late_rank_finishes_the_calls_before_a_failure(path, kind, failure):
    env = {"LINKWISE_TIMEOUT": "20", **_PATHS[path]}
    out = run_ranks(3, _late_rank, kind, failure, env=env, timeout=90)
    x = [np.arange(1000, dtype=np.float32) + r for r in range(3)]
    want = (x[0] + x[1] + x[2]) if kind == "reduce" else np.concatenate(x)
    got = out[2][0]
    assert not isinstance(got, str), f"rank 2's {kind} before the failure raised {got}; later: {out[2][1:]}"
    np.testing.assert_array_equal(np.asarray(got, np.float32).ravel(), want.ravel())
    for r in range(3):
        if failure == "close" and r == 0:
            continue
        # The all_reduce rank 0 closed under may still complete on a rank that took all of
        # rank 0's data before its notice (a small all_reduce sends first: the direct
        # algorithm over TCP); the call after it never does.
        if failure == "mismatch":
            assert out[r][1] != "ok", f"rank {r}'s mismatched all_reduce returned"
        assert out[r][2] != "ok", f"rank {r} went on after the failure: {out[r][1:]}"


def _p2p_in_flight(comm, big):
    """Rank 0 has a large point-to-point send in flight to rank 1 (TCP: half written, rank 1
    not reading; shared memory: a single-copy send rank 1 has not copied) with a broadcast from
    it queued behind; rank 2 takes its part of the broadcast, then fails the next call alone on
    a short timeout. The stop used to cut rank 0's stream to rank 1 (TCP) or withdraw the
    point-to-point message and take rank 0 for dead (shared memory), so rank 1's broadcast
    raised PeerError naming rank 0, which was alive; now every rank finishes it."""
    def outcome(call):
        import linkwise
        try:
            return call()
        except (linkwise.PeerError, linkwise.CommAbortedError, linkwise.TimeoutError) as exc:
            return type(exc).__name__

    comm.barrier()
    x = np.arange(256, dtype=np.float32) if comm.rank == 0 else np.zeros(256, np.float32)
    bcast = lambda: comm.broadcast(x, root=0) is not None and float(x.sum())  # noqa: E731
    if comm.rank == 0:
        req = comm.isend(np.ones(big, np.uint8), 1, tag=7)
        got = outcome(bcast)
        time.sleep(3)
        outcome(req.wait)
        return got
    if comm.rank == 1:
        time.sleep(3)  # rank 2 times out meanwhile
        return outcome(bcast)
    got = outcome(bcast)
    comm.timeout = 1.0
    outcome(lambda: comm.all_reduce(np.ones(4, np.float32)))
    return got


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_point_to_point_in_flight_does_not_cut_an_earlier_collective(path):
    env = {"LINKWISE_TIMEOUT": "10", "LINKWISE_ALGO": "tree", **({"LINKWISE_TRANSPORT": "tcp"} if path == "tcp" else {})}
    big = (64 << 20) if path == "tcp" else (1 << 20)
    assert run_ranks(3, _p2p_in_flight, big, env=env, timeout=90) == [float(np.arange(256).sum())] * 3


def _late_broadcast(comm, before_over, fail_over):
    """Rank 2 is late to a broadcast from rank 0, which ranks 0 and 1 finish without it (the
    root posts its data, rank 1 takes it); then ranks 0 and 1 fail the next call between
    themselves (their all_reduce dtypes differ: over messages the ring's first step, rank 0
    to rank 1, shows it). Each call goes through the shared-memory executor or over messages
    (LINKWISE_ALGO=ring for that call alone). Rank 2's engine reads what arrived (the
    broadcast's messages and the abort notices behind them) before it calls the broadcast, as
    it would while waiting in another call. Returns rank 2's broadcast result (or its error's
    name) and the outcomes of the failed call and one more."""
    import os

    def over(path, call):
        if path == "messages":
            os.environ["LINKWISE_ALGO"] = "ring"
        try:
            return _outcome(call)
        finally:
            os.environ.pop("LINKWISE_ALGO", None)

    comm.all_reduce(np.ones(4, np.float32))  # the executor is set up (a collective step) before anyone is late
    x = (np.arange(1000, dtype=np.float32) + 1) if comm.rank == 0 else np.zeros(1000, np.float32)
    comm.barrier()
    if comm.rank == 2:
        time.sleep(1.0)  # the others finish the broadcast and fail the next call meanwhile
        comm._native.poll()
    before = over(before_over, lambda: comm.broadcast(x, root=0) is not None and x.tolist())
    y = np.ones(256, np.int32 if comm.rank == 1 else np.float32)
    failed = over(fail_over, lambda: comm.all_reduce(y) is not None and "ok")
    after = _outcome(lambda: comm.all_reduce(np.ones(4, np.float32)) is not None and "ok")
    return before, failed, after


@pytest.mark.parametrize("before_over,fail_over", [("executor", "executor"), ("executor", "messages"),
                                                   ("messages", "executor"), ("messages", "messages")])
def test_a_late_rank_finishes_a_broadcast_across_the_executor_and_messages(before_over, fail_over):
    """The shared-memory executor numbers its calls on its own: a failure in it stops its calls
    from the failed one (and the messages' collectives from the first this rank had not
    started), a failure over messages stops the executor from the failing rank's next call.
    Before, either stopped everything, so rank 2's broadcast raised CommAbortedError."""
    out = run_ranks(3, _late_broadcast, before_over, fail_over, env={"LINKWISE_TIMEOUT": "20"}, timeout=90)
    got = out[2][0]
    assert not isinstance(got, str), f"rank 2's broadcast before the failure raised {got}; later: {out[2][1:]}"
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.arange(1000, dtype=np.float32) + 1)
    for r in range(3):
        assert out[r][1] != "ok", f"rank {r}'s mismatched all_reduce returned"
        assert out[r][2] != "ok", f"rank {r} went on after the failure: {out[r][1:]}"


def _stop_between_calls(comm):
    """Rank 0 is a non-root of a reduce to rank 1 (it posts its input and returns), then stops
    its executor between calls, as a close with async calls pending does when none has started
    yet; rank 1, the root, still waits in that reduce for rank 2, which is late. Returns rank
    1's reduce result (or its error's name) and the outcome of one more call."""
    comm.all_reduce(np.ones(4, np.float32))  # the executor is set up before anyone is late
    x = np.arange(1000, dtype=np.float32) + comm.rank
    comm.barrier()
    if comm.rank == 2:
        time.sleep(1.0)
    got = _outcome(lambda: comm.reduce(x, root=1))
    if comm.rank == 0:
        comm._shm.stop()
    if comm.rank == 1 and not isinstance(got, str):
        got = np.asarray(got).tolist()
    after = _outcome(lambda: comm.all_reduce(np.ones(4, np.float32)) is not None and "ok")
    return got, after


def test_a_rank_that_stops_between_calls_does_not_fail_the_call_it_finished():
    """A stop that is not a failure of a call (close, a given-up wait) stops from the rank's
    next call: a first version stopped from its last one, so rank 1, still waiting in the
    reduce rank 0 had finished, raised CommAbortedError within ~0.1 s of the stop."""
    out = run_ranks(3, _stop_between_calls, env={"LINKWISE_TIMEOUT": "20"}, timeout=90)
    got = out[1][0]
    assert not isinstance(got, str), f"rank 1's reduce raised {got}"
    want = sum(np.arange(1000, dtype=np.float32) + r for r in range(3))
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    assert all(after != "ok" for _, after in out), out  # the call after the stop raises everywhere

"""Collectives called with different arguments on different ranks, without LINKWISE_CHECK.

The issue's contract: a mismatch (size, dtype, op, kind) is detected where cheap and raises
on every rank instead of corrupting data or hanging. The shared-memory executor compares call
descriptors (csrc/algo/shm_coll_check.cc); the point-to-point algorithms check that every
message has the size the receiving rank expects (CollCtx::wait). Each case runs with a 20 s
timeout, so a hang shows as a TimeoutError (or a killed rank), not as a pass.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from multirank import run_ranks

LANES = {"LINKWISE_COLL_THREADS": "2"}
CMA = {"LINKWISE_COLL_THREADS": "2", "LINKWISE_COLL_CMA_MIN": "1M", "LINKWISE_COLL_CMA_BCAST_MIN": "1M"}


def _mismatched(comm, case):
    """Runs rank-dependent calls; returns (exception type name, message, seconds)."""
    import linkwise  # noqa: F401 - the ranks' package
    odd = comm.rank == comm.size - 1  # the last rank calls differently
    t0 = time.monotonic()
    try:
        if case == "size_one_shot":
            comm.all_reduce(np.ones(8 if odd else 4, np.float32))
        elif case == "size_two_shot":
            comm.all_reduce(np.ones(200_000 if odd else 100_000, np.float32))
        elif case == "one_shot_vs_two_shot":
            comm.all_reduce(np.ones(300_000 if odd else 4, np.float32))
        elif case == "size_large":
            comm.all_reduce(np.ones(2_000_001 if odd else 2_000_000, np.float32))
        elif case == "dtype_same_bytes":
            comm.all_reduce(np.ones(1000, np.int32 if odd else np.float32))
        elif case == "op":
            comm.all_reduce(np.ones(1000, np.float32), op="max" if odd else "sum")
        elif case == "kind":
            if odd:
                comm.broadcast(np.ones(1000, np.float32))
            else:
                comm.all_reduce(np.ones(1000, np.float32))
        elif case == "barrier_vs_all_reduce":
            if odd:
                comm.barrier()
            else:
                comm.all_reduce(np.ones(4, np.float32))
        elif case == "bcast_reader_size":
            comm.broadcast(np.ones(3_000_004 if odd else 3_000_000, np.uint8), root=0)
        elif case == "async_size":
            comm.all_reduce(np.ones(16 if odd else 8, np.float64), async_op=True).wait()
        elif case == "all_gather_size":  # small: through the shared-memory executor when on it
            comm.all_gather(np.ones(200 if odd else 100, np.float32))
        elif case == "reduce_scatter_size":
            comm.reduce_scatter(np.ones(comm.size * (20 if odd else 10), np.float32))
        elif case == "all_gather_size_large":  # past 32 KiB: point-to-point messages
            comm.all_gather(np.ones(20_000 if odd else 10_000, np.float32))
        elif case == "reduce_scatter_size_large":
            comm.reduce_scatter(np.ones(comm.size * (20_000 if odd else 10_000), np.float32))
        elif case == "exchange_kind":
            x = np.ones(comm.size * 8, np.float32)
            comm.all_to_all(x) if odd else comm.all_gather(x)
        elif case == "reduce_scatter_op":
            comm.reduce_scatter(np.ones(comm.size * 8, np.float32), op="max" if odd else "sum")
        else:
            raise AssertionError(case)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


SHM_CASES = ["size_one_shot", "size_two_shot", "one_shot_vs_two_shot", "size_large", "dtype_same_bytes", "op",
             "kind", "barrier_vs_all_reduce", "async_size", "all_gather_size", "reduce_scatter_size",
             "exchange_kind", "reduce_scatter_op"]


@pytest.mark.parametrize("env", [{}, LANES, CMA], ids=["default", "lanes", "cma"])
@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("case", SHM_CASES)
def test_every_rank_raises_value_error(case, nranks, env):
    out = run_ranks(nranks, _mismatched, case, env={"LINKWISE_TIMEOUT": "20", **env}, timeout=60)
    # A rank that enters the call after another one found the mismatch raises
    # CommAbortedError at once (the executor stopped); at least one rank names the mismatch.
    assert [k for k, _, _ in out].count("ValueError") >= 1, out
    for rank, (kind, message, seconds) in enumerate(out):
        assert kind in ("ValueError", "CommAbortedError"), (rank, kind, message)
        assert seconds < 10, (rank, seconds)
        if kind == "ValueError":
            assert "differs between ranks" in message or "were expected" in message, message


@pytest.mark.parametrize("env", [{}, CMA], ids=["ring", "cma"])
def test_broadcast_readers_of_another_size_raise(env):
    # The root finishes as soon as its pieces are out (it waits for no reader), so it may end
    # this call cleanly; every reader whose size differs raises, and no reader hangs.
    out = run_ranks(3, _mismatched, "bcast_reader_size", env={"LINKWISE_TIMEOUT": "20", **env}, timeout=60)
    kinds = [k for k, _, _ in out]
    assert out[2][0] in ("ValueError", "CommAbortedError") and "ValueError" in kinds, out
    assert any("broadcast of 3000004 bytes" in m for _, m, _ in out), out
    assert all(s < 10 for _, _, s in out), out
    assert out[1][0] in ("ok", "PeerError", "ValueError", "CommAbortedError"), out


def test_message_names_both_calls():
    out = run_ranks(2, _mismatched, "op", env={"LINKWISE_TIMEOUT": "20"}, timeout=60)
    kind, message, _ = out[0]
    assert kind == "ValueError"
    assert "all_reduce of 4000 bytes of float32 (sum)" in message and "(max)" in message, message


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("case", ["all_gather_size", "reduce_scatter_size", "all_gather_size_large",
                                  "reduce_scatter_size_large"])
def test_point_to_point_collectives_raise_on_every_rank(case, transport):
    out = run_ranks(3, _mismatched, case, env={"LINKWISE_TIMEOUT": "20", "LINKWISE_TRANSPORT": transport},
                    timeout=60)
    kinds = [k for k, _, _ in out]
    # The ranks whose messages were the wrong size raise ValueError; the others see the
    # communicator aborted (or their own size error); nobody returns normally.
    assert "ok" not in kinds, out
    assert kinds.count("ValueError") >= 1, out
    assert all(s < 10 for _, _, s in out), out


def _matched_after_mismatch_free_run(comm):
    """Many correct calls mixing forms and paths: the checks must never fire."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        n = int(rng.choice([1, 7, 1000, 40_000, 300_000]))
        x = np.full(n, comm.rank + 1, np.float32)
        form = int(rng.integers(4))
        if form == 0:
            comm.all_reduce(x)
        elif form == 1:
            comm.all_reduce(x, async_op=True).wait()
        elif form == 2:
            comm.broadcast(x, root=int(rng.integers(comm.size)))
        else:
            comm.barrier()
            continue
        if form < 2:
            assert np.all(x == comm.size * (comm.size + 1) / 2)
    return "ok"


@pytest.mark.parametrize("env", [{}, LANES], ids=["default", "lanes"])
def test_matched_calls_never_trip_the_check(env):
    assert run_ranks(3, _matched_after_mismatch_free_run, env=env, timeout=120) == ["ok"] * 3


def _go_on_after_mismatch(comm):
    """A small broadcast whose root returns before the reader notices the other size, then
    more collectives: every rank's later calls must raise, none may use out-of-step counters."""
    import linkwise
    first = "ok"
    try:
        comm.broadcast(np.ones(100_000 if comm.rank == 0 else 200_000, np.float32), root=0)
    except ValueError:
        first = "ValueError"
    later = []
    for call in (lambda: comm.all_reduce(np.ones(8, np.float32)), lambda: comm.broadcast(np.ones(8, np.float32)),
                 lambda: comm.all_reduce(np.ones(300_000, np.float32))):
        try:
            call()
            later.append("ok")
        except linkwise.CommAbortedError:
            later.append("aborted")
        except linkwise.PeerError:  # the root got there before the reader stopped the executor
            later.append("peer")
    return first, later


def test_later_collectives_raise_after_a_mismatch():
    out = run_ranks(2, _go_on_after_mismatch, env={"LINKWISE_TIMEOUT": "20"}, timeout=60)
    assert out[1][0] == "ValueError", out  # the reader, whose size differs
    for first, later in out:
        assert later[0] in ("aborted", "peer") and later[1:] == ["aborted"] * 2, out


def _reduced_differently(comm, case):
    """A reducing collective with another op or dtype (same bytes) on the last rank (a
    point-to-point one, or over shm a reduce or reduce_scatter, which run in the shared-memory
    executor); returns (first call's outcome, the next collective's outcome)."""
    import linkwise
    odd = comm.rank == comm.size - 1
    outcome = []
    for call in (lambda: _reduce_case(comm, case, odd), lambda: comm.all_gather(np.ones(4, np.float32))):
        try:
            call()
            outcome.append("ok")
        except ValueError as exc:
            # the point-to-point check's words, or the shared-memory executor's (reduce over shm)
            named = "dtypes or ops" in str(exc) or "differs between ranks" in str(exc)
            outcome.append("ValueError" if named else f"ValueError: {exc}")
        except (linkwise.CommAbortedError, linkwise.PeerError):
            # PeerError: over shm, a rank still waiting in the executor when a peer that found
            # the mismatch first (a one-shot reduce's non-root, in its next call) marked itself failed
            outcome.append("aborted")
    return outcome


def _reduce_case(comm, case, odd):
    if case == "reduce_op":
        comm.reduce(np.ones(1000, np.float32), op="max" if odd else "sum")
    elif case == "reduce_scatter_dtype":
        # 40 KB a rank: past the executor's one-shot reduce_scatter (32 KiB); over shm its
        # two-shot rounds (stamps), over tcp the point-to-point ring (the messages' check)
        comm.reduce_scatter(np.ones(10_000 * comm.size, np.int32 if odd else np.float32))
    elif case == "all_reduce_op":  # over TCP: the ring / recursive doubling, not the executor
        comm.all_reduce(np.ones(100_000, np.float32), op="min" if odd else "sum")


@pytest.mark.parametrize("case,transport", [("reduce_op", "shm"), ("reduce_op", "tcp"), ("reduce_scatter_dtype", "shm"),
                                            ("reduce_scatter_dtype", "tcp"), ("all_reduce_op", "tcp")])
def test_point_to_point_reductions_check_dtype_and_op(case, transport):
    out = run_ranks(3, _reduced_differently, case,
                    env={"LINKWISE_TIMEOUT": "20", "LINKWISE_TRANSPORT": transport}, timeout=60)
    firsts = [first for first, _ in out]
    # Named by a rank that received a message reduced otherwise, or (reduce over shm: a
    # one-shot non-root returns, then checks that round's stamps first) in its next call.
    assert "ValueError" in firsts or (case == "reduce_op" and transport == "shm"
                                      and any(later == "ValueError" for _, later in out)), out
    # No rank goes on: whoever returned from the call (a reduce's senders) fails the next one,
    # stopped, or (a non-root of the executor's one-shot reduce, which checks that round's
    # stamps before its next one) by finding the mismatch itself.
    assert all(first in ("ValueError", "aborted", "ok") for first in firsts), out
    assert all(later == "aborted" or (later == "ValueError" and first == "ok") for first, later in out), out


def _other_count_on_one_rank(comm, kind, count, odd_count):
    """The last rank passes odd_count elements, the others count; then four correct broadcasts.
    Returns (the first call's outcome, each later broadcast's: "ok", "WRONG" or the error's name)."""
    import linkwise
    odd = comm.rank == comm.size - 1
    x = np.ones(odd_count if odd else count, np.float32)
    try:
        comm.broadcast(x, root=0) if kind == "broadcast" else comm.all_reduce(x)
        first = "ok"
    except (ValueError, linkwise.CommAbortedError, linkwise.PeerError) as exc:
        first = type(exc).__name__
    later = []
    for i in range(4):
        y = np.full(10, 42.0 + i if comm.rank == 0 else -1.0, np.float32)
        try:
            comm.broadcast(y, root=0)
            later.append("ok" if np.all(y == 42.0 + i) else "WRONG")
        except (linkwise.CommAbortedError, linkwise.PeerError) as exc:
            later.append(type(exc).__name__)
    return first, later


@pytest.mark.parametrize("kind,count,odd_count", [
    ("broadcast", 2, 0), ("all_reduce", 2, 0), ("broadcast", 2, 1), ("broadcast", 2, 3),
    ("broadcast", 1, 65536), ("broadcast", 65536, 1)])
def test_other_count_on_one_rank_raises_and_never_shifts_later_calls(kind, count, odd_count):
    # Before: the 0-byte broadcast skipped the ring's piece numbering on that rank, so every
    # later broadcast there returned the previous one's data, silently; and a small broadcast
    # whose root had already gone on to its next call went unchecked (wrong bytes, silently).
    # 4 against 262144 bytes: sizes that the first piece stamp (a 16-bit fold of the call's
    # descriptor) could not tell apart, found by an acceptance run.
    out = run_ranks(3, _other_count_on_one_rank, kind, count, odd_count, env={"LINKWISE_TIMEOUT": "20"},
                    timeout=60)
    assert out[2][0] == "ValueError", out  # the odd rank meets the others' call
    for first, later in out:
        assert "WRONG" not in later, out
        # A rank may finish calls that need no one else's data (a root) before it learns
        # of the failure; once a call raised, every later one raises.
        raised = [r != "ok" for r in later]
        assert raised == sorted(raised), out
    assert all(r != "ok" for r in out[2][1]), out


def _prefix_sizes(comm, kind):
    """The receiver's size is a whole number of 512 KiB chunks, the sender's larger: every
    message fits, so only the size hash in each message tells the calls apart."""
    import linkwise
    big, small = 262144, 131072  # float32: 1 MiB and 512 KiB
    try:
        if kind == "broadcast":
            comm.broadcast(np.full(big if comm.rank == 0 else small, 7.0, np.float32), root=0)
        elif kind == "reduce":
            comm.reduce(np.ones(small if comm.rank == 0 else big, np.float32), root=0)
        else:  # broadcast with 0 elements on the reader
            comm.broadcast(np.full(big if comm.rank == 0 else 0, 7.0, np.float32), root=0)
        first = "ok"
    except (ValueError, linkwise.CommAbortedError, linkwise.PeerError) as exc:
        first = type(exc).__name__
    try:
        comm.all_reduce(np.ones(4))
        later = "ok"
    except (linkwise.CommAbortedError, linkwise.PeerError):
        later = "raised"
    return first, later


@pytest.mark.parametrize("env", [{"LINKWISE_TRANSPORT": "tcp"}, {"LINKWISE_ALGO": "chain"}], ids=["tcp", "chain"])
@pytest.mark.parametrize("kind", ["broadcast", "reduce", "broadcast_zero"])
def test_message_based_prefix_sizes_raise(kind, env):
    # Before: the reader of a broadcast (the root of a reduce) silently took the prefix.
    out = run_ranks(2, _prefix_sizes, kind, env={"LINKWISE_TIMEOUT": "10", **env}, timeout=60)
    receiver = 1 if kind.startswith("broadcast") else 0
    assert out[receiver][0] == "ValueError", out
    assert all(later == "raised" for _, later in out), out


def _zero_on_last_rank(comm, kind):
    import linkwise
    cnt = 0 if comm.rank == comm.size - 1 else 4
    t0 = time.monotonic()
    try:
        if kind == "gather":
            comm.gather(np.ones(cnt, np.float32), root=0)
        elif kind == "scatter":
            comm.scatter(np.ones(cnt * comm.size, np.float32), root=0)
        elif kind == "all_gather":
            comm.all_gather(np.ones(cnt, np.float32))
        elif kind == "reduce_scatter":
            comm.reduce_scatter(np.ones(cnt * comm.size, np.float32))
        elif kind == "all_reduce":  # over TCP: the message-based algorithms
            comm.all_reduce(np.ones(cnt * 1000, np.float32))
        else:
            comm.all_to_all(np.ones(cnt * comm.size, np.float32))
        first = "ok"
    except (ValueError, linkwise.CommAbortedError, linkwise.PeerError) as exc:
        first = type(exc).__name__
    return first, time.monotonic() - t0


@pytest.mark.parametrize("kind", ["gather", "scatter", "all_to_all", "all_gather", "reduce_scatter", "all_reduce"])
def test_zero_elements_on_one_rank_of_a_message_based_collective_raise(kind):
    # Before: the rank with 0 elements returned at once and the others waited for the timeout.
    env = {"LINKWISE_TIMEOUT": "20", "LINKWISE_TRANSPORT": "tcp" if kind == "all_reduce" else "auto"}
    out = run_ranks(3, _zero_on_last_rank, kind, env=env, timeout=60)
    assert "ValueError" in [first for first, _ in out], out
    assert all(seconds < 10 for _, seconds in out), out


def _zero_everywhere(comm):
    comm.all_gather(np.ones(0, np.float32))
    comm.reduce_scatter(np.ones(0, np.float32))
    comm.all_reduce(np.ones(0, np.float32))
    comm.gather(np.ones(0, np.float32), root=0)
    comm.scatter(np.ones(0, np.float32), root=0)
    comm.all_to_all(np.ones(0, np.float32))
    comm.broadcast(np.ones(0, np.float32), root=1)
    comm.reduce(np.ones(0, np.float32), root=1)
    x = np.ones(3, np.float32)
    comm.all_reduce(x)
    return float(x[0])


@pytest.mark.parametrize("env", [{}, {"LINKWISE_TRANSPORT": "tcp"}], ids=["shm", "tcp"])
def test_zero_elements_everywhere_still_work(env):
    assert run_ranks(3, _zero_everywhere, env=env, timeout=60) == [3.0] * 3

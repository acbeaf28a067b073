"""all_gather and all_to_all through the shared-memory executor's rounds in the two-shot
areas (x larger than the one-shot area's 32 KiB; ShmColl::block_rounds). Checked against
NumPy for every dtype, 2, 3, 5 and 8 ranks, one round and several, one lane and several,
out= and out None, in place (all_gather: x is out's own block; all_to_all: x is out) and
with x overlapping out otherwise; the point-to-point sequence, which the executor leaves
alone, proves the path. Also mismatched calls against the other two-shot-area protocols, and
a rank killed mid-call."""
import numpy as np
import pytest

from coll_ref import DTYPES, call_outcome, data, np_dtype
from multirank import calls_until_peer_error, run_ranks

LANES_ENV = {"LINKWISE_COLL_THREADS": "3", "LINKWISE_COLL_LANE_MIN": "4K"}


def _gather_everywhere(comm, dtypes, counts):
    n, r = comm.size, comm.rank
    seq, calls = comm._coll_seq, 0
    for dt in dtypes:
        for count in counts:
            ins = [data(q, count, dt, "sum", salt=5) for q in range(n)]
            full = np.concatenate(ins)
            assert ins[r].nbytes > 32 << 10, "the test's sizes must pass the one-shot area"
            tag = f"all_gather {dt} count={count}"
            x = ins[r].copy()
            np.testing.assert_array_equal(comm.all_gather(x), full, err_msg=tag + " out None")
            out = np.full(n * count, 3, np_dtype(dt))
            assert comm.all_gather(x, out=out) is out
            np.testing.assert_array_equal(out, full, err_msg=tag + " out=")
            np.testing.assert_array_equal(x, ins[r], err_msg=tag + " x untouched")
            out = np.full(n * count, 3, np_dtype(dt))
            out[r * count:(r + 1) * count] = ins[r]
            comm.all_gather(out[r * count:(r + 1) * count], out=out)  # in place
            np.testing.assert_array_equal(out, full, err_msg=tag + " in place")
            out = np.full(n * count + 1, 3, np_dtype(dt))
            other = (r + 1) % n  # x straddles the start of another rank's block of out
            out[other * count + 1:other * count + 1 + count] = ins[r]
            comm.all_gather(out[other * count + 1:other * count + 1 + count], out=out[:n * count])
            np.testing.assert_array_equal(out[:n * count], full, err_msg=tag + " x overlapping another block")
            calls += 4
    assert comm._coll_seq == seq, "an all_gather went point-to-point instead of through the executor"
    return calls, comm._shm.lane_calls[0], comm._shm.max_lanes


def _a2a_everywhere(comm, dtypes, counts):
    """all_to_all: rank q's block j is data(q, count, salt=j); rank r gets every q's block r."""
    n, r = comm.size, comm.rank
    seq, calls = comm._coll_seq, 0
    for dt in dtypes:
        for count in counts:
            mine = np.concatenate([data(r, count, dt, "sum", salt=j) for j in range(n)])
            want = np.concatenate([data(q, count, dt, "sum", salt=r) for q in range(n)])
            assert mine.nbytes > 32 << 10, "the test's sizes must pass the one-shot area"
            tag = f"all_to_all {dt} count={count}"
            x = mine.copy()
            out = np.full(n * count, 3, np_dtype(dt))
            assert comm.all_to_all(x, out=out) is out
            np.testing.assert_array_equal(out, want, err_msg=tag + " out=")
            np.testing.assert_array_equal(x, mine, err_msg=tag + " x untouched")
            assert comm.all_to_all(x) is x  # in place
            np.testing.assert_array_equal(x, want, err_msg=tag + " in place")
            y = np.empty(n * count + 1, np_dtype(dt))
            y[1:] = mine
            comm.all_to_all(y[1:], out=y[:-1])  # out overlaps x, shifted by one element
            np.testing.assert_array_equal(y[:-1], want, err_msg=tag + " out overlapping x")
            calls += 3
    assert comm._coll_seq == seq, "an all_to_all went point-to-point instead of through the executor"
    return calls, comm._shm.lane_calls[0], comm._shm.max_lanes


@pytest.mark.parametrize("n", [2, 3, 5])
def test_one_round(n):
    got = run_ranks(n, _gather_everywhere, ["float32", "int8", "bfloat16"], [33_001, 100_003], timeout=240)
    assert got[0][0] > 0, got


def test_every_dtype():
    run_ranks(2, _gather_everywhere, DTYPES, [40_001], timeout=240)


def test_several_rounds_eight_ranks():
    run_ranks(8, _gather_everywhere, ["float64"], [600_001], timeout=240)  # 4.8 MB a block: 3 rounds


@pytest.mark.parametrize("n", [2, 3])
def test_lanes(n):
    got = run_ranks(n, _gather_everywhere, ["float32", "uint8"], [40_001, 700_001], env=LANES_ENV, timeout=240)
    assert all(lanes > 0 for _, lanes, _ in got), got  # lane_calls counts every two-shot-area call


@pytest.mark.parametrize("n", [2, 3, 5])
def test_all_to_all_one_round(n):
    got = run_ranks(n, _a2a_everywhere, ["float32", "int8", "bfloat16"], [17_011, 40_003], timeout=240)
    assert got[0][0] > 0, got


def test_all_to_all_every_dtype_and_rounds():
    run_ranks(2, _a2a_everywhere, DTYPES, [40_001], timeout=240)
    run_ranks(8, _a2a_everywhere, ["float64"], [70_001], timeout=240)  # 4.5 MB x: 4 rounds of 32 KiB a block


@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all_lanes(n):
    got = run_ranks(n, _a2a_everywhere, ["float32", "uint8"], [40_001, 300_001], env=LANES_ENV, timeout=240)
    assert all(lanes > 0 for _, lanes, _ in got), got


def _mismatch(comm, case):
    odd = comm.rank == comm.size - 1
    x = np.ones(20_000, np.float32)
    calls = {"reduce_scatter": lambda: comm.reduce_scatter(np.ones(20_000 * comm.size, np.float32))
             if odd else comm.all_gather(x),
             "all_reduce": lambda: comm.all_reduce(np.ones(20_000 * comm.size, np.float32)) if odd else comm.all_gather(x),
             "size": lambda: comm.all_gather(x[:10_000] if odd else x),
             "all_to_all": lambda: comm.all_to_all(np.ones(20_000 * comm.size, np.float32)) if odd
             else comm.all_gather(x)}
    return [call_outcome(call) for call in (calls[case], lambda: comm.all_gather(x))]


@pytest.mark.parametrize("case", ["reduce_scatter", "all_reduce", "size", "all_to_all"])
def test_mismatched_calls_raise(case):
    out = run_ranks(3, _mismatch, case, env={"LINKWISE_TIMEOUT": "20"}, timeout=90)
    assert any(first == "ValueError" for first, _ in out), out
    assert all(first in ("ValueError", "stopped") and later == "stopped" for first, later in out), out


def _until_peer_error(comm, kind):
    x = np.ones(300_001, np.float32)
    return calls_until_peer_error(comm, lambda i: comm.all_gather(x) if kind == "all_gather"
                                  else comm.all_to_all(x[:300_000]))


@pytest.mark.parametrize("kind", ["all_gather", "all_to_all"])
def test_rank_killed_mid_call(kind):
    out = run_ranks(3, _until_peer_error, kind, env={"LINKWISE_TIMEOUT": "30"}, expect_fail=True, timeout=90)
    assert out[2][0] == "died"
    assert out[:2] == [("ok", 2), ("ok", 2)], out

"""reduce_scatter through the shared-memory executor's two-shot rounds (x larger than the
one-shot area's 32 KiB; ShmColl::reduce_scatter): every block's piece per round, each rank
combining its own block straight into out. Checked against the NumPy reference for every op
and dtype, 2, 3, 5 and 8 ranks, one round and several, on one lane and several, with out=,
with out None, in place (out is x's own block) and with out overlapping another block of x;
the point-to-point sequence, which the executor leaves alone, proves the path. Also: the
result has the same bits as all_reduce's block, mismatched calls raise on every rank, async
calls keep issue order, and a rank killed mid-call makes the others raise PeerError."""
import numpy as np
import pytest

from coll_ref import DTYPES, INT, call_outcome, check_equal, data, np_dtype, ops_for, reduce_ref
from multirank import calls_until_peer_error, run_ranks

# Block sizes (elements per rank) whose x passes 32 KiB for every dtype and rank count used
# here; 300_007 float32 blocks take two rounds at 2 ranks (ShmColl::kTwoPiece / n / 4 bytes).
ONE_ROUND = [17_011, 33_001]
LANES_ENV = {"LINKWISE_COLL_THREADS": "3", "LINKWISE_COLL_LANE_MIN": "4K"}


def _scatter_everywhere(comm, dtypes, blocks):
    """Every op, block size and output form; returns (calls, lane calls so far)."""
    n, r = comm.size, comm.rank
    seq, calls = comm._coll_seq, 0
    for dt in dtypes:
        for op in ops_for(dt):
            for block in blocks:
                ins = [data(q, n * block, dt, op, salt=3) for q in range(n)]
                want = reduce_ref(ins, op, dt)[r * block:(r + 1) * block]
                fl = op == "avg" and dt not in INT
                tag = f"reduce_scatter {dt} {op} block={block}"
                assert ins[r].nbytes > 32 << 10, "the test's sizes must pass the one-shot area"
                x = ins[r].copy()
                out = np.full(block, 5, np_dtype(dt))
                assert comm.reduce_scatter(x, op=op, out=out) is out
                check_equal(out, want, tag + " out=", fl)
                check_equal(x, ins[r], tag + " input untouched")
                check_equal(comm.reduce_scatter(x, op=op), want, tag + " out None", fl)
                x = ins[r].copy()
                own = x[r * block:(r + 1) * block]
                assert comm.reduce_scatter(x, op=op, out=own) is own
                check_equal(own, want, tag + " in place", fl)
                other = (r + 1) % n
                check_equal(np.delete(x, np.s_[r * block:(r + 1) * block]),
                            np.delete(ins[r], np.s_[r * block:(r + 1) * block]), tag + " other blocks untouched")
                x = ins[r].copy()
                start = other * block + (1 if other < n - 1 else -1)  # straddles another block's edge
                spot = x[start:start + block]
                comm.reduce_scatter(x, op=op, out=spot)
                check_equal(spot, want, tag + " out overlapping another block", fl)
                calls += 4
    assert comm._coll_seq == seq, "a reduce_scatter went point-to-point instead of through the executor"
    return calls, comm._shm.lane_calls[0], comm._shm.max_lanes


@pytest.mark.parametrize("n", [2, 3, 5])
def test_one_round(n):
    got = run_ranks(n, _scatter_everywhere, ["float32", "int8", "bfloat16"], ONE_ROUND, timeout=240)
    assert got[0][0] > 0, got
    # One lane where the ranks have one helper thread each (2 CPUs a rank or fewer, as in CI);
    # a larger host gives lanes by default.
    assert all(lanes == 0 for _, lanes, most in got if most == 1), got


def test_every_dtype_two_ranks():
    got = run_ranks(2, _scatter_everywhere, DTYPES, [17_011], timeout=240)
    assert got[0][0] > 0


def test_several_rounds():
    run_ranks(2, _scatter_everywhere, ["float32"], [300_007], timeout=240)


def test_several_rounds_eight_ranks():
    run_ranks(8, _scatter_everywhere, ["float64"], [40_001], timeout=240)  # 4 rounds of 8192 a block


@pytest.mark.parametrize("n", [2, 3])
def test_lanes(n):
    got = run_ranks(n, _scatter_everywhere, ["float32", "int32"], [17_011, 100_003], env=LANES_ENV, timeout=240)
    assert all(lanes > 0 for _, lanes, _ in got), got


def _same_bits_as_all_reduce(comm, block):
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(comm.size * block).astype(np.float32)  # rounding depends on the order
    full = comm.all_reduce(x.copy())
    got = comm.reduce_scatter(x)
    mine = full[comm.rank * block:(comm.rank + 1) * block]
    return bool(np.array_equal(got.view(np.uint32), mine.view(np.uint32)))


@pytest.mark.parametrize("n", [2, 3, 5])
def test_same_bits_as_all_reduce(n):
    assert run_ranks(n, _same_bits_as_all_reduce, 70_001, timeout=120) == [True] * n


def _mismatch(comm, case):
    """The last rank calls something else; returns (first outcome, next call's outcome)."""
    odd = comm.rank == comm.size - 1
    x = np.ones(comm.size * 20_000, np.float32)
    calls = {"all_reduce": lambda: comm.all_reduce(x) if odd else comm.reduce_scatter(x),
             "op": lambda: comm.reduce_scatter(x, op="max" if odd else "sum"),
             "size": lambda: comm.reduce_scatter(x[:comm.size * (10_000 if odd else 20_000)])}
    return [call_outcome(call) for call in (calls[case], lambda: comm.reduce_scatter(x))]


@pytest.mark.parametrize("case", ["all_reduce", "op", "size"])
def test_mismatched_calls_raise(case):
    out = run_ranks(3, _mismatch, case, env={"LINKWISE_TIMEOUT": "20"}, timeout=90)
    assert any(first == "ValueError" for first, _ in out), out
    assert all(first in ("ValueError", "stopped") and later == "stopped" for first, later in out), out


def _async_in_order(comm, block):
    n, r = comm.size, comm.rank
    ins = [[data(q, n * block, "float32", "sum", salt=k) for q in range(n)] for k in range(3)]
    reqs = [comm.reduce_scatter(ins[k][r], async_op=True) for k in range(3)]
    for k, req in enumerate(reqs):
        check_equal(req.wait(), reduce_ref(ins[k], "sum", "float32")[r * block:(r + 1) * block], f"async {k}")

    async def main():
        return await comm.areduce_scatter(ins[0][r])

    import asyncio
    check_equal(asyncio.run(main()), reduce_ref(ins[0], "sum", "float32")[r * block:(r + 1) * block], "coroutine")
    return True


def test_async_and_coroutine():
    assert run_ranks(3, _async_in_order, 30_001, timeout=120) == [True] * 3


def _until_peer_error(comm):
    x = np.ones(comm.size * 300_001, np.float32)  # several rounds a call
    return calls_until_peer_error(comm, lambda i: comm.reduce_scatter(x))


def test_rank_killed_mid_call():
    out = run_ranks(3, _until_peer_error, env={"LINKWISE_TIMEOUT": "30"}, expect_fail=True, timeout=90)
    assert out[2][0] == "died"
    assert out[:2] == [("ok", 2), ("ok", 2)], out

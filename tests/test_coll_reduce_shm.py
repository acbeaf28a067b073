"""reduce through the shared-memory executor (ShmColl::reduce): the all_reduce's one-shot,
two-shot (on one lane or several) and single-copy (CMA) protocols with the result kept on the
root. Checked against the NumPy reference for every root, in place and out=, with the
non-roots' x and out untouched; the executor's counters (and the point-to-point sequence,
which a reduce through the executor leaves alone) prove which path ran. Also: the root's
result has the same bits as all_reduce's, mismatched calls raise instead of hanging, async
reduces keep issue order, and a rank killed mid-reduce makes the others raise PeerError."""
import numpy as np
import pytest

from coll_ref import INT, call_outcome, check_equal, data, np_dtype, ops_for, reduce_ref
from multirank import calls_until_peer_error, run_ranks
from test_coll_cma import CMA_ENV, _cma_permitted

# 1000 elements: one-shot; 20_011 float32 (80 KB): two-shot; 600_001 float32 (2.4 MB): two
# two-shot rounds (ShmColl::kTwoPiece is 2 MiB).
COUNTS = [0, 1, 7, 1000, 20_011]
LANES_ENV = {"LINKWISE_COLL_THREADS": "3", "LINKWISE_COLL_LANE_MIN": "4K"}


def _reduce_everywhere(comm, dtypes, counts):
    """Every root, op, count of `counts`, in place and out=; returns how many calls ran."""
    calls = 0
    seq = comm._coll_seq
    for dt in dtypes:
        for op in ops_for(dt):
            for count in counts:
                ins = [data(r, count, dt, op, salt=7) for r in range(comm.size)]
                want = reduce_ref(ins, op, dt)
                fl = op == "avg" and dt not in INT
                for root in range(comm.size):
                    tag = f"reduce {dt} {op} count={count} root={root}"
                    x = ins[comm.rank].copy()
                    out = np.full(count, 5, np_dtype(dt))
                    assert comm.reduce(x, root=root, op=op, out=out) is out
                    check_equal(x, ins[comm.rank], tag + " input untouched")
                    if comm.rank == root:
                        check_equal(out, want, tag + " out=", fl)
                    else:
                        check_equal(out, np.full(count, 5, np_dtype(dt)), tag + " a non-root's out untouched")
                    x = ins[comm.rank].copy()
                    assert comm.reduce(x, root=root, op=op) is x
                    check_equal(x, want if comm.rank == root else ins[comm.rank], tag + " in place", fl)
                    calls += 2
    if comm.size > 1:
        assert comm._coll_seq == seq, "a reduce went point-to-point instead of through the executor"
    shm = comm._shm if comm.size > 1 else None
    return calls, (shm.cma_calls[0], shm.lane_calls[0]) if shm else None


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_one_and_two_shot(n):
    got = run_ranks(n, _reduce_everywhere, ["float32", "int8", "bfloat16"], COUNTS, timeout=240)
    assert got[0][0] > 0
    if n > 1:
        assert all(paths == (0, 0) for _, paths in got), got  # neither CMA nor lanes by default here


def test_every_dtype_two_ranks():
    got = run_ranks(2, _reduce_everywhere, ["uint8", "int32", "int64", "float16", "float64"], [1, 7, 20_011],
                    timeout=240)
    assert got[0][0] > 0


def test_several_two_shot_rounds_eight_ranks():
    run_ranks(8, _reduce_everywhere, ["float32"], [600_001], timeout=240)


@pytest.mark.parametrize("n", [2, 3])
def test_lanes(n):
    got = run_ranks(n, _reduce_everywhere, ["float32", "int32"], [20_011, 100_003], env=LANES_ENV, timeout=240)
    assert all(lanes > 0 for _, (_, lanes) in got), got


@pytest.mark.skipif(not _cma_permitted(), reason="ptrace_scope forbids process_vm_readv between ranks")
@pytest.mark.parametrize("n,threads", [(2, 1), (3, 2), (5, 1)])
def test_single_copy(n, threads):
    env = dict(CMA_ENV, LINKWISE_COLL_THREADS=str(threads))
    got = run_ranks(n, _reduce_everywhere, ["float32", "int8", "bfloat16"], [1, 7, 5003], env=env, timeout=240)
    for calls, (cma, _) in got:
        assert cma == calls, (calls, cma)  # every call of at least one byte, and none of 0 here


def _same_bits_as_all_reduce(comm, count):
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(count).astype(np.float32)  # rounding depends on the order of the sums
    full = np.empty_like(x)
    comm.all_reduce(x, out=full)
    got = []
    for root in range(comm.size):
        out = np.zeros_like(x)
        comm.reduce(x, root=root, out=out)
        if comm.rank == root:
            got.append(bool(np.array_equal(out.view(np.uint32), full.view(np.uint32))))
    return got


@pytest.mark.parametrize("count", [5000, 300_007])
def test_root_gets_the_all_reduce_bits(count):
    got = run_ranks(3, _same_bits_as_all_reduce, count, timeout=120)
    assert got == [[True]] * 3


@pytest.mark.skipif(not _cma_permitted(), reason="ptrace_scope forbids process_vm_readv between ranks")
def test_root_gets_the_all_reduce_bits_single_copy():
    got = run_ranks(3, _same_bits_as_all_reduce, 50_001, env=CMA_ENV, timeout=120)
    assert got == [[True]] * 3


def _mismatch(comm, case, count):
    """The last rank calls something else; returns (first outcome, next call's outcome)."""
    odd = comm.rank == comm.size - 1
    x = np.ones(count, np.float32)
    calls = {"all_reduce": lambda: comm.all_reduce(x) if odd else comm.reduce(x, root=0),
             "root": lambda: comm.reduce(x, root=1 if odd else 0),
             "op": lambda: comm.reduce(x, root=0, op="max" if odd else "sum")}
    return [call_outcome(call) for call in (calls[case], lambda: comm.reduce(x, root=0))]


@pytest.mark.parametrize("case", ["all_reduce", "root", "op"])
@pytest.mark.parametrize("count", [100, 20_011])
def test_mismatched_calls_raise(case, count):
    out = run_ranks(3, _mismatch, case, count, env={"LINKWISE_TIMEOUT": "20"}, timeout=90)
    # Named somewhere: in the call, or (a one-shot non-root that returned and then found the
    # mismatch first, stopping the others) in that rank's next call.
    assert any("ValueError" in pair for pair in out), out
    assert all(first in ("ValueError", "stopped", "ok") for first, _ in out), out
    # Nobody goes on out of step. A one-shot non-root returns once its input is posted, so it
    # may learn of the mismatch in its next call: from the stopped executor, or from its own
    # check of that reduce's stamps (a ValueError).
    assert all(later == "stopped" or (later == "ValueError" and first == "ok") for first, later in out), out
    if count > 1000:  # two-shot: every rank waits in the call itself
        assert all(later == "stopped" for _, later in out), out


def _async_mixed(comm):
    import asyncio
    count, reqs, outs = 20_011, [], []
    for i in range(6):
        x = data(comm.rank, count, "float32", "sum", salt=i)
        outs.append(x)
        root = i % comm.size
        if i % 2:
            reqs.append(comm.reduce(x, root=root, async_op=True))
        else:
            comm.reduce(x, root=root)
    for r in reqs:
        r.wait()
    y = data(comm.rank, 5, "int32", "max")
    asyncio.run(comm.areduce(y, root=comm.size - 1, op="max"))
    ok = []
    for i, x in enumerate(outs):
        ins = [data(r, count, "float32", "sum", salt=i) for r in range(comm.size)]
        want = reduce_ref(ins, "sum", "float32") if comm.rank == i % comm.size else ins[comm.rank]
        ok.append(bool(np.array_equal(x, want)))
    ins = [data(r, 5, "int32", "max") for r in range(comm.size)]
    ok.append(bool(np.array_equal(y, reduce_ref(ins, "max", "int32") if comm.rank == comm.size - 1 else ins[comm.rank])))
    return ok


def test_async_and_coroutine_reduce_keep_issue_order():
    got = run_ranks(3, _async_mixed, timeout=120)
    assert all(all(ok) for ok in got), got


def _until_peer_error(comm):
    x = np.ones(300_001, np.float32)
    return calls_until_peer_error(comm, lambda i: comm.reduce(x, root=0))


@pytest.mark.parametrize("env", [{}, CMA_ENV], ids=["two-shot", "single-copy"])
def test_rank_killed_mid_reduce(env):
    if env and not _cma_permitted():
        pytest.skip("ptrace_scope forbids process_vm_readv between ranks")
    out = run_ranks(3, _until_peer_error, env=dict(env, LINKWISE_TIMEOUT="30"), expect_fail=True, timeout=90)
    assert out[2][0] == "died"
    assert out[:2] == [("ok", 2), ("ok", 2)], out

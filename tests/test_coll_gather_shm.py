"""Small gather and scatter through the shared-memory executor (ShmColl::gather / scatter:
one one-shot round when all size blocks fit its 32 KiB area). Checked against NumPy for every
root, every dtype, 1, 2, 3, 5 and 8 ranks, out= and out None, with the root's x overlapping
its out; the point-to-point sequence, which the executor leaves alone, proves the path (and
that larger ones still go point-to-point). Also: sequences that mix gather, scatter, reduce
and all_reduce with changing roots (the owed rounds of ranks that return early), async calls
and coroutines in issue order, mismatched calls raising on every rank, and a killed rank."""
import numpy as np
import pytest

from coll_ref import DTYPES, call_outcome, data, np_dtype
from multirank import calls_until_peer_error, run_ranks

COUNTS = [0, 1, 7, 300]  # 300 float64 x 8 ranks = 19 KB: every case here fits the area


def _gather_scatter_everywhere(comm, dtypes, counts):
    n, r = comm.size, comm.rank
    seq, calls = comm._coll_seq, 0
    for dt in dtypes:
        for count in counts:
            ins = [data(q, count, dt, "sum", salt=11) for q in range(n)]
            full = np.concatenate(ins)
            for root in range(n):
                tag = f"{dt} count={count} root={root}"
                x = ins[r].copy()
                got = comm.gather(x, root=root)
                if r == root:
                    np.testing.assert_array_equal(got, full, err_msg="gather " + tag)
                else:
                    assert got is None, tag
                out = np.full(n * count, 3, np_dtype(dt))
                if r == root:
                    out[r * count:(r + 1) * count] = ins[r]  # x is out's own block: in place
                    assert comm.gather(out[r * count:(r + 1) * count], root=root, out=out) is out
                    np.testing.assert_array_equal(out, full, err_msg="gather in place " + tag)
                else:
                    assert comm.gather(x, root=root) is None
                np.testing.assert_array_equal(x, ins[r], err_msg="gather left x alone " + tag)
                got = comm.scatter(full.copy() if r == root else None, root=root,
                                   out=np.full(count, 3, np_dtype(dt)))
                np.testing.assert_array_equal(got, ins[r], err_msg="scatter " + tag)
                if r == root:  # out overlapping x (the blocks shifted by one element)
                    y = np.concatenate([full, full[:1]]) if count else full.copy()
                    spot = y[1:1 + count] if count else y[:0]
                    comm.scatter(y[:n * count], root=root, out=spot)
                    np.testing.assert_array_equal(spot, ins[r], err_msg="scatter overlapping " + tag)
                else:
                    np.testing.assert_array_equal(comm.scatter(None, root=root, out=np.empty(count, np_dtype(dt))),
                                                  ins[r], err_msg="scatter " + tag)
                calls += 4
    if n > 1:
        assert comm._coll_seq == seq, "a small gather or scatter went point-to-point"
    return calls


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_every_root(n):
    assert run_ranks(n, _gather_scatter_everywhere, ["float32", "int8"], COUNTS, timeout=240)[0] > 0


def test_every_dtype():
    run_ranks(3, _gather_scatter_everywhere, DTYPES, [1, 9], timeout=240)


def _larger_goes_point_to_point(comm):
    n = comm.size
    x = np.arange(32 * 1024 // n // 4 + 1, dtype=np.float32) + comm.rank  # n blocks pass 32 KiB
    seq = comm._coll_seq
    got = comm.gather(x, root=n - 1)
    s = comm.scatter(np.concatenate([x] * n) if comm.rank == 0 else None, root=0, out=np.empty_like(x))
    ok = comm._coll_seq == seq + 2 and np.array_equal(s, np.arange(x.size, dtype=np.float32))
    if comm.rank == n - 1:
        ok = ok and np.array_equal(got, np.concatenate([np.arange(x.size, dtype=np.float32) + q for q in range(n)]))
    return ok


def test_larger_ones_go_point_to_point():
    assert run_ranks(3, _larger_goes_point_to_point, timeout=60) == [True] * 3


def _mixed_sequence(comm, rounds):
    """gather, scatter, reduce, all_reduce and all_gather in turn with moving roots: the ranks
    that return from a rooted call early owe its round, which every later call must respect."""
    n, r = comm.size, comm.rank
    ok = []
    for i in range(rounds):
        root = (i * 7 + 3) % n
        ins = [np.arange(5, dtype=np.int64) * (q + 1) + i for q in range(n)]
        g = comm.gather(ins[r], root=root)
        ok.append(g is None if r != root else np.array_equal(g, np.concatenate(ins)))
        s = comm.scatter(np.concatenate(ins) if r == (root + 1) % n else None, root=(root + 1) % n,
                         out=np.empty(5, np.int64))
        ok.append(np.array_equal(s, ins[r]))
        y = ins[r].copy()
        comm.reduce(y, root=(root + 2) % n)
        ok.append(np.array_equal(y, sum(ins) if r == (root + 2) % n else ins[r]))
        ok.append(np.array_equal(comm.all_reduce(ins[r].copy()), sum(ins)))
        ok.append(np.array_equal(comm.all_gather(ins[r]), np.concatenate(ins)))
    return all(ok)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_mixed_sequences_with_moving_roots(n):
    assert run_ranks(n, _mixed_sequence, 200, timeout=120) == [True] * n


def _async_in_order(comm):
    import asyncio
    n, r = comm.size, comm.rank
    ins = [[np.full(4, 10 * k + q, np.float32) for q in range(n)] for k in range(4)]
    reqs = [comm.gather(ins[0][r], root=1, async_op=True),
            comm.scatter(np.concatenate(ins[1]) if r == 2 else None, root=2, out=np.empty(4, np.float32),
                         async_op=True),
            comm.gather(ins[2][r], root=0, async_op=True)]
    got = [q.wait() for q in reqs]

    async def coro():
        return (await comm.agather(ins[3][r], root=n - 1),
                await comm.ascatter(np.concatenate(ins[3]) if r == 0 else None, root=0, out=np.empty(4, np.float32)))

    g3, s3 = asyncio.run(coro())
    ok = [got[0] is None if r != 1 else np.array_equal(got[0], np.concatenate(ins[0])),
          np.array_equal(got[1], ins[1][r]),
          got[2] is None if r != 0 else np.array_equal(got[2], np.concatenate(ins[2])),
          g3 is None if r != n - 1 else np.array_equal(g3, np.concatenate(ins[3])),
          np.array_equal(s3, ins[3][r])]
    return ok


def test_async_and_coroutines_keep_issue_order():
    got = run_ranks(3, _async_in_order, timeout=60)
    assert all(all(ok) for ok in got), got


def _mismatch(comm, case):
    """The last rank calls something else; returns (first outcome, second call's, third's)."""
    n, odd = comm.size, comm.rank == comm.size - 1
    x = np.ones(4, np.float32)
    calls = {"root": lambda: comm.gather(x, root=1 if odd else 0),
             "size": lambda: comm.gather(np.ones(5 if odd else 4, np.float32), root=0),
             "kind": lambda: (comm.scatter(np.ones(4 * n, np.float32) if comm.rank == 0 else None, root=0,
                                           out=np.empty(4, np.float32)) if odd else comm.gather(x, root=0)),
             "scatter_root": lambda: comm.scatter(np.ones(4 * n, np.float32), root=1 if odd else 0,
                                                  out=np.empty(4, np.float32))}
    return [call_outcome(call) for call in (calls[case], lambda: comm.all_reduce(x), lambda: comm.all_reduce(x))]


@pytest.mark.parametrize("case", ["root", "size", "kind", "scatter_root"])
def test_mismatched_calls_raise(case):
    out = run_ranks(3, _mismatch, case, env={"LINKWISE_TIMEOUT": "20"}, timeout=90)
    # Named somewhere: in the call, or by a rank that returned early (it owed the round) in
    # its next call; every rank fails by its second call after it, and nobody goes on.
    assert any("ValueError" in o for o in out), out
    assert all(o[0] in ("ValueError", "stopped", "ok") for o in out), out
    assert all(o[1] in ("ValueError", "stopped") or o[0] != "ok" for o in out), out
    assert all(o[2] == "stopped" for o in out), out
    if case == "scatter_root":  # the last rank reads from a rank that posted no block for it
        assert out[-1][0] != "ok", out


def _until_peer_error(comm, kind):
    x = np.ones(8, np.float32)
    out = np.empty(8, np.float32)
    if kind == "gather":
        return calls_until_peer_error(comm, lambda i: comm.gather(x, root=i % 2))
    return calls_until_peer_error(comm, lambda i: comm.scatter(np.ones(8 * comm.size, np.float32)
                                                               if comm.rank == i % 2 else None, root=i % 2, out=out))


@pytest.mark.parametrize("kind", ["gather", "scatter"])
def test_rank_killed_mid_loop(kind):
    out = run_ranks(3, _until_peer_error, kind, env={"LINKWISE_TIMEOUT": "30"}, expect_fail=True, timeout=90)
    assert out[2][0] == "died"
    assert out[:2] == [("ok", 2), ("ok", 2)], out

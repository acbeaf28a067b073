"""gather and scatter through the shared-memory executor: one one-shot round when all size
blocks fit its 32 KiB area (ShmColl::gather / scatter), else, for gather, block rounds in its
two-shot areas (ShmColl::block_rounds; the non-roots post and return) and, for scatter, the
point-to-point path. Checked against NumPy for every root, every dtype, 1, 2, 3, 5 and 8
ranks, one round and several, lanes, out= and out None, in place (the root's x is its block
of out; its out its block of x) and with x overlapping out otherwise; the point-to-point
sequence proves the path (and the same cases run on the point-to-point path under
LINKWISE_ALGO and over TCP). Also: sequences that mix gather, scatter, reduce, all_reduce and
all_gather with changing roots, small and large (the ranks that return early), async calls and
coroutines in issue order, mismatched calls raising on every rank, and a killed rank."""
import numpy as np
import pytest

from coll_ref import DTYPES, call_outcome, data, np_dtype
from multirank import calls_until_peer_error, run_ranks

COUNTS = [0, 1, 7, 300]  # 300 float64 x 8 ranks = 19 KB: every case here fits the area
LARGE = [9_001]  # float32 x 2+ ranks: past the one-shot area, one round
LANES_ENV = {"LINKWISE_COLL_THREADS": "3", "LINKWISE_COLL_LANE_MIN": "4K"}


def _gather_scatter_everywhere(comm, dtypes, counts, roots=None, p2p=False):
    n, r = comm.size, comm.rank
    seq, calls, sent = comm._coll_seq, 0, 0
    for dt in dtypes:
        for count in counts:
            ins = [data(q, count, dt, "sum", salt=11) for q in range(n)]
            full = np.concatenate(ins)
            for root in range(n) if roots is None else roots:
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
                # The root's x at the start of out (another rank's block), then straddling the
                # start of the next rank's block: staged, not overwritten before it is read
                for at in ([0] if r else [count + 1]) + [((r + 1) % n) * count + 1]:
                    if r == root and n > 1:
                        out = np.full(n * count + 1, 3, np_dtype(dt))
                        out[at:at + count] = ins[r]
                        comm.gather(out[at:at + count], root=root, out=out[:n * count])
                        np.testing.assert_array_equal(out[:n * count], full, err_msg=f"gather x at {at} " + tag)
                    else:
                        comm.gather(x, root=root)
                got = comm.scatter(full.copy() if r == root else None, root=root,
                                   out=np.full(count, 3, np_dtype(dt)))
                np.testing.assert_array_equal(got, ins[r], err_msg="scatter " + tag)
                if r == root:  # out overlapping x (the blocks shifted by one element), then x's own block
                    y = np.concatenate([full, full[:1]]) if count else full.copy()
                    spot = y[1:1 + count] if count else y[:0]
                    comm.scatter(y[:n * count], root=root, out=spot)
                    np.testing.assert_array_equal(spot, ins[r], err_msg="scatter overlapping " + tag)
                    y = full.copy()
                    comm.scatter(y, root=root, out=y[r * count:(r + 1) * count])
                    np.testing.assert_array_equal(y, full, err_msg="scatter in place " + tag)
                else:
                    for _ in range(2):
                        got = comm.scatter(None, root=root, out=np.empty(count, np_dtype(dt)))
                        np.testing.assert_array_equal(got, ins[r], err_msg="scatter " + tag)
                calls += 7
                # Point-to-point (a collective sequence number each): all 4 gathers and 3
                # scatters when forced, else the scatters past the one-shot area only
                sent += 7 if p2p else 3 * (full.nbytes > 32 << 10)
    if n > 1:
        assert comm._coll_seq == seq + sent, "a gather or scatter took the other path"
    return calls


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_every_root(n):
    assert run_ranks(n, _gather_scatter_everywhere, ["float32", "int8"], COUNTS, timeout=240)[0] > 0


def test_every_dtype():
    run_ranks(3, _gather_scatter_everywhere, DTYPES, [1, 9], timeout=240)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_larger_ones_every_root(n):
    assert run_ranks(n, _gather_scatter_everywhere, ["float32", "int8"], LARGE + [40_003], timeout=240)[0] > 0


def test_larger_ones_every_dtype_and_eight_ranks():
    run_ranks(2, _gather_scatter_everywhere, DTYPES, [20_001], timeout=240)
    run_ranks(8, _gather_scatter_everywhere, ["float64"], [5_001], [0, 5], timeout=240)


def test_larger_ones_several_rounds():
    # 2.4 MB a block: gather 2 rounds of the 2 MiB area
    run_ranks(3, _gather_scatter_everywhere, ["float64"], [300_001], [1], timeout=240)


@pytest.mark.parametrize("env", [{"LINKWISE_ALGO": "ring"}, {"LINKWISE_TRANSPORT": "tcp", "LINKWISE_ALGO": "tree"}])
def test_the_same_cases_point_to_point(env):
    # The linear gather and scatter: the root's own block copied before its receives may
    # overwrite x, and after its sends when its out overlaps x (both gave wrong blocks before;
    # 20_001 float32: past the 64 KiB single-copy threshold, where sends read x late)
    run_ranks(3, _gather_scatter_everywhere, ["float32", "int8"], [0, 7, 9_001, 20_001], None, True, env=env, timeout=240)


@pytest.mark.parametrize("n", [2, 3])
def test_larger_ones_on_lanes(n):
    def lanes_used(comm):
        _gather_scatter_everywhere(comm, ["float32", "uint8"], [40_001, 300_001], [n - 1])
        return comm._shm.lane_calls[0]
    assert all(lanes > 0 for lanes in run_ranks(n, lanes_used, env=LANES_ENV, timeout=240))


def _mixed_sequence(comm, rounds, sizes):
    """gather, scatter, reduce, all_reduce and all_gather in turn with moving roots and sizes
    taken in turn: the ranks that return from a rooted call early (one-shot: they owe its
    round; block rounds: their next round waits for every peer's reads), which every later
    call must respect."""
    n, r = comm.size, comm.rank
    ok = []
    for i in range(rounds):
        root = (i * 7 + 3) % n
        ins = [np.arange(sizes[i % len(sizes)], dtype=np.int64) * (q + 1) + i for q in range(n)]
        g = comm.gather(ins[r], root=root)
        ok.append(g is None if r != root else np.array_equal(g, np.concatenate(ins)))
        s = comm.scatter(np.concatenate(ins) if r == (root + 1) % n else None, root=(root + 1) % n,
                         out=np.empty(ins[r].size, np.int64))
        ok.append(np.array_equal(s, ins[r]))
        y = ins[r].copy()
        comm.reduce(y, root=(root + 2) % n)
        ok.append(np.array_equal(y, sum(ins) if r == (root + 2) % n else ins[r]))
        ok.append(np.array_equal(comm.all_reduce(ins[r].copy()), sum(ins)))
        ok.append(np.array_equal(comm.all_gather(ins[r]), np.concatenate(ins)))
    return all(ok)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_mixed_sequences_with_moving_roots(n):
    assert run_ranks(n, _mixed_sequence, 200, [5], timeout=120) == [True] * n


@pytest.mark.parametrize("n", [2, 3, 5])
def test_mixed_sizes_with_moving_roots(n):
    # 5 KiB-2.4 MB a rank: one-shot, block and two-shot rounds, one lane and several, in turn
    assert run_ranks(n, _mixed_sequence, 60, [5_000, 700, 300_001, 9], env=LANES_ENV, timeout=180) == [True] * n


def _async_in_order(comm, count):
    import asyncio
    n, r = comm.size, comm.rank
    ins = [[np.full(count, 10 * k + q, np.float32) for q in range(n)] for k in range(4)]
    reqs = [comm.gather(ins[0][r], root=1, async_op=True),
            comm.scatter(np.concatenate(ins[1]) if r == 2 else None, root=2, out=np.empty(count, np.float32),
                         async_op=True),
            comm.gather(ins[2][r], root=0, async_op=True)]
    got = [q.wait() for q in reqs]

    async def coro():
        return (await comm.agather(ins[3][r], root=n - 1),
                await comm.ascatter(np.concatenate(ins[3]) if r == 0 else None, root=0,
                                    out=np.empty(count, np.float32)))

    g3, s3 = asyncio.run(coro())
    # On the worker too: the root's x at the start of out, rank 0's block (staged first)
    over = np.zeros(n * count, np.float32)
    over[:count] = ins[0][r]
    g4 = comm.gather(over[:count] if r == 1 else ins[0][r], root=1, out=over if r == 1 else None,
                     async_op=True).wait()
    ok = [got[0] is None if r != 1 else np.array_equal(got[0], np.concatenate(ins[0])),
          np.array_equal(got[1], ins[1][r]),
          got[2] is None if r != 0 else np.array_equal(got[2], np.concatenate(ins[2])),
          g3 is None if r != n - 1 else np.array_equal(g3, np.concatenate(ins[3])),
          np.array_equal(s3, ins[3][r]),
          g4 is None if r != 1 else np.array_equal(g4, np.concatenate(ins[0]))]
    return ok + [comm._coll_seq == (2 if count * 4 * n > 32 << 10 else 0)]  # large scatters: messages


@pytest.mark.parametrize("count", [4, 20_000])
def test_async_and_coroutines_keep_issue_order(count):
    got = run_ranks(3, _async_in_order, count, timeout=60)
    assert all(all(ok) for ok in got), got


def _mismatch(comm, case, k):
    """The last rank calls something else; returns (first outcome, second call's, third's)."""
    n, odd = comm.size, comm.rank == comm.size - 1
    x = np.ones(k, np.float32)
    calls = {"root": lambda: comm.gather(x, root=1 if odd else 0),
             "size": lambda: comm.gather(np.ones(k + 1 if odd else k, np.float32), root=0),
             "kind": lambda: (comm.scatter(np.ones(k * n, np.float32) if comm.rank == 0 else None, root=0,
                                           out=np.empty(k, np.float32)) if odd else comm.gather(x, root=0)),
             "scatter_root": lambda: comm.scatter(np.ones(k * n, np.float32), root=1 if odd else 0,
                                                  out=np.empty(k, np.float32)),
             "all_gather": lambda: comm.all_gather(x) if odd else comm.gather(x, root=0)}
    return [call_outcome(call) for call in (calls[case], lambda: comm.all_reduce(x), lambda: comm.all_reduce(x))]


# 20_000 float32: a gather's block rounds (a scatter that large goes point-to-point, where
# only LINKWISE_CHECK names a mismatch before the timeout)
@pytest.mark.parametrize("case,k", [(c, 4) for c in ["root", "size", "kind", "scatter_root", "all_gather"]]
                         + [(c, 20_000) for c in ["root", "size", "all_gather"]])
def test_mismatched_calls_raise(case, k):
    out = run_ranks(3, _mismatch, case, k, env={"LINKWISE_TIMEOUT": "20"}, timeout=90)
    # Named somewhere: in the call, or by a rank that returned early (it owed the round) in
    # its next call; every rank fails by its second call after it, and nobody goes on.
    assert any("ValueError" in o for o in out), out
    assert all(o[0] in ("ValueError", "stopped", "ok") for o in out), out
    assert all(o[1] in ("ValueError", "stopped") or o[0] != "ok" for o in out), out
    assert all(o[2] == "stopped" for o in out), out
    if case == "scatter_root":  # the last rank reads from a rank that posted no block for it
        assert out[-1][0] != "ok", out


def _until_peer_error(comm, kind, k):
    x = np.ones(k, np.float32)
    out = np.empty(k, np.float32)
    if kind == "gather":
        return calls_until_peer_error(comm, lambda i: comm.gather(x, root=i % 2))
    return calls_until_peer_error(comm, lambda i: comm.scatter(np.ones(k * comm.size, np.float32)
                                                               if comm.rank == i % 2 else None, root=i % 2, out=out))


@pytest.mark.parametrize("kind,k", [("gather", 8), ("scatter", 8), ("gather", 300_001)])
def test_rank_killed_mid_loop(kind, k):
    out = run_ranks(3, _until_peer_error, kind, k, env={"LINKWISE_TIMEOUT": "30"}, expect_fail=True, timeout=90)
    assert out[2][0] == "died"
    assert out[:2] == [("ok", 2), ("ok", 2)], out

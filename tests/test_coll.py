"""Every collective × op × dtype × size × in/out-of-place against the NumPy reference, on
1, 2, 3, 5 and 8 ranks, with every algorithm forced in turn and a tiny chunk size so the
pipelined paths run. Cases are batched inside one run_ranks call per rank count."""
import hashlib
import os

import numpy as np
import pytest
from coll_ref import DTYPES, INT, check_equal, data, np_dtype, ops_for, reduce_ref
from multirank import run_ranks

SIZES = [0, 1, 7, 1000]
BIG = 5000  # > one chunk (LINKWISE_CHUNK_SIZE=256 bytes below) on every path


def reductions(comm, algos, sizes, dtypes=DTYPES):
    n, r = comm.size, comm.rank
    cases = 0
    for algo in algos:
        os.environ["LINKWISE_ALGO"] = algo
        for dt in dtypes:
            for op in ops_for(dt):
                for count in sizes:
                    ins = [data(q, count, dt, op) for q in range(n)]
                    want = reduce_ref(ins, op, dt)
                    fl = op == "avg" and dt not in INT
                    tag = f"all_reduce {algo} {dt} {op} n={n} count={count}"
                    x = ins[r].copy()
                    assert comm.all_reduce(x, op=op) is x
                    check_equal(x, want, tag + " in-place", fl)
                    out = np.empty_like(x)
                    x = ins[r].copy()
                    comm.all_reduce(x, op=op, out=out)
                    check_equal(out, want, tag, fl)
                    check_equal(x, ins[r], tag + " input untouched")
                    # reduce to a root other than 0, out-of-place and in-place
                    root = (count + 1) % n
                    x = ins[r].copy()
                    out = np.zeros_like(x)
                    comm.reduce(x, root=root, op=op, out=out)
                    check_equal(x, ins[r], tag + " reduce input untouched")
                    if r == root:
                        check_equal(out, want, f"reduce {algo} {dt} {op} root={root} count={count}", fl)
                    x = ins[r].copy()
                    comm.reduce(x, root=root, op=op)
                    check_equal(x, want if r == root else ins[r], f"reduce in-place {dt} {op}", fl)
                    # reduce_scatter: x has n blocks of count elements
                    xs = [np.concatenate([data(q, count, dt, op, salt=b) for b in range(n)]) for q in range(n)]
                    full = reduce_ref(xs, op, dt)
                    got = comm.reduce_scatter(xs[r].copy(), op=op)
                    check_equal(got, full[r * count:(r + 1) * count], f"reduce_scatter {dt} {op} count={count}", fl)
                    cases += 5
    os.environ.pop("LINKWISE_ALGO", None)
    return cases


def movers(comm, algos, sizes):
    n, r = comm.size, comm.rank
    cases = 0
    for algo in algos:
        os.environ["LINKWISE_ALGO"] = algo
        for dt in ["int8", "float16", "bfloat16", "float64", "int32"]:
            for count in sizes:
                ins = [data(q, count, dt, "sum", salt=7) for q in range(n)]
                for root in sorted({0, n - 1, n // 2}):
                    x = ins[r].copy()
                    comm.broadcast(x, root=root)
                    check_equal(x, ins[root], f"broadcast {algo} {dt} root={root} count={count}")
                    out = np.zeros_like(x)
                    comm.broadcast(ins[r].copy(), root=root, out=out)
                    check_equal(out, ins[root], f"broadcast out= {dt} root={root}")
                    g = comm.gather(ins[r], root=root)
                    if r == root:
                        check_equal(g, np.concatenate(ins), f"gather {dt} root={root} count={count}")
                    else:
                        assert g is None
                    full = np.concatenate(ins)
                    s = comm.scatter(full if r == root else None, root=root,
                                     out=np.empty(count, np_dtype(dt)))
                    check_equal(s, ins[r], f"scatter {dt} root={root} count={count}")
                    cases += 4
                got = comm.all_gather(ins[r])
                check_equal(got, np.concatenate(ins), f"all_gather {dt} count={count}")
                out = np.empty(n * count, np_dtype(dt))
                assert comm.all_gather(ins[r], out=out) is out
                check_equal(out, np.concatenate(ins), f"all_gather out= {dt} count={count}")
                # all_to_all: rank q's block j is data(q, count, salt=j)
                blocks = [[data(q, count, dt, "min", salt=j) for j in range(n)] for q in range(n)]
                x = np.concatenate(blocks[r])
                want = np.concatenate([blocks[q][r] for q in range(n)])
                out = np.empty_like(x)
                comm.all_to_all(x, out=out)
                check_equal(out, want, f"all_to_all {dt} count={count}")
                comm.all_to_all(x)
                check_equal(x, want, f"all_to_all in-place {dt} count={count}")
                comm.barrier()
                cases += 5
    os.environ.pop("LINKWISE_ALGO", None)
    return cases


def identical_bits(comm):
    """Random floats (rounding differs by order): every rank must hold the same bits."""
    digests = []
    for algo in ["ring", "tree", "direct"]:
        os.environ["LINKWISE_ALGO"] = algo
        for dt in ["float32", "float16", "bfloat16", "float64"]:
            for op in ["sum", "prod", "avg"]:
                x = np.random.default_rng(comm.rank).standard_normal(3001).astype(np_dtype(dt))
                comm.all_reduce(x, op=op)
                digests.append(hashlib.sha1(x.tobytes()).hexdigest())  # results go through a pipe: keep small
    os.environ.pop("LINKWISE_ALGO", None)
    return digests


def body(comm, sizes, algos):
    cases = reductions(comm, algos, sizes)
    cases += movers(comm, algos, sizes)
    return cases, identical_bits(comm)


SMALL_CHUNK = {"LINKWISE_CHUNK_SIZE": "256"}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_matrix(n, shm_clean):
    algos = ["", "ring", "tree", "direct", "chain"] if n <= 3 else ["", "ring", "tree"]
    sizes = SIZES + [BIG] if n <= 5 else SIZES
    results = run_ranks(n, body, sizes, algos, env=SMALL_CHUNK, timeout=150)
    assert all(c > 0 for c, _ in results)
    for c, d in results[1:]:
        assert d == results[0][1], "all_reduce results differ in bits between ranks"


def test_over_transport(transport_env):
    """The same checks over shared memory and forced TCP (3 ranks, default algorithms)."""
    env = dict(transport_env, **SMALL_CHUNK)
    results = run_ranks(3, body, [0, 7, 3000], ["", "chain", "direct"], env=env, timeout=120)
    assert all(c > 0 for c, _ in results)


def test_big_default_chunks():
    """Messages bigger than the default chunk (512K), through the single-copy path."""
    def big(comm):
        n, r = comm.size, comm.rank
        count = 300_001
        for dt in ["float32", "bfloat16", "int64"]:
            ins = [data(q, count, dt, "sum") for q in range(n)]
            x = ins[r].copy()
            comm.all_reduce(x)
            check_equal(x, reduce_ref(ins, "sum", dt), f"big all_reduce {dt}")
            x = ins[r].copy()
            comm.broadcast(x, root=n - 1)
            check_equal(x, ins[n - 1], f"big broadcast {dt}")
            out = comm.all_gather(ins[r][:100_000])
            check_equal(out, np.concatenate([i[:100_000] for i in ins]), f"big all_gather {dt}")
        return True
    assert run_ranks(3, big, timeout=120) == [True] * 3

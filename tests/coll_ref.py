"""NumPy reference for the collective tests: per-rank inputs every rank can recompute, and
the expected result of each reduction computed exactly (small integer values, wide types)."""
from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np

DTYPES = ["int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
INT = ("int8", "uint8", "int32", "int64")


def np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def ops_for(dtype: str) -> list[str]:
    return OPS if dtype in INT else OPS[:5]


def data(rank: int, count: int, dtype: str, op: str, salt: int = 0) -> np.ndarray:
    """Rank's input: small integers so that every reduction is exact in every dtype."""
    seed = zlib.crc32(f"{rank}/{count}/{dtype}/{op}/{salt}".encode())
    rng = np.random.default_rng(seed)
    if op == "prod":
        lo, hi = (1, 3) if dtype == "uint8" else (-1, 3)
        v = rng.integers(lo, hi, count)
        v[v == 0] = 1
    elif dtype == "uint8" or op in ("band", "bor", "bxor"):
        v = rng.integers(0, 100 if op.startswith("b") else 4, count)
    else:
        v = rng.integers(-2, 4, count)
    return v.astype(np.float64).astype(np_dtype(dtype))


def reduce_ref(arrays: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    """Exact result of combining `arrays` (all the same dtype) with op."""
    n = len(arrays)
    if dtype in INT:
        a = np.stack([x.astype(np.int64) for x in arrays])
    else:
        a = np.stack([x.astype(np.float64) for x in arrays])
    if a.shape[1] == 0:
        return np.empty(0, np_dtype(dtype))
    if op == "sum" or op == "avg":
        r = a.sum(0)
    elif op == "prod":
        r = a.prod(0)
    elif op == "min":
        r = a.min(0)
    elif op == "max":
        r = a.max(0)
    else:
        f = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
        r = f.reduce(a, 0)
    if dtype in INT:
        r = r.astype(np_dtype(dtype))  # wraps like the native two's-complement arithmetic
        if op == "avg":
            r = np.trunc(r.astype(np.float64) / n).astype(np_dtype(dtype))
        return r
    if op == "avg":
        return (r / n).astype(np_dtype(dtype))
    return r.astype(np_dtype(dtype))


def check_equal(got: np.ndarray, want: np.ndarray, what: str, avg_float: bool = False) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    if avg_float:
        ok = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2, atol=1e-2)
    else:
        ok = np.array_equal(got.view(np.uint8), want.view(np.uint8))
    if not ok:
        bad = np.flatnonzero(got.astype(np.float64) != want.astype(np.float64))[:5]
        raise AssertionError(f"{what}: mismatch at {bad.tolist()}: got {got[bad].tolist()} want {want[bad].tolist()}")


def check_all_reduce_matrix(comm, dtypes, sizes_for) -> int:
    """On every rank: all_reduce of every (dtype, op) of `dtypes` and every count in
    sizes_for(dtype, op), in place and with out=, against reduce_ref (and the input of the
    out= form untouched). Returns how many calls it checked."""
    checked = 0
    for dt in dtypes:
        for op in ops_for(dt):
            for count in sizes_for(dt, op):
                want = reduce_ref([data(r, count, dt, op) for r in range(comm.size)], op, dt)
                avg_float = op == "avg" and dt not in INT
                x = data(comm.rank, count, dt, op)
                comm.all_reduce(x, op=op)
                check_equal(x, want, f"in place {dt} {op} {count}", avg_float)
                x = data(comm.rank, count, dt, op)
                keep = x.copy()
                out = np.full(count, 7, np_dtype(dt))
                comm.all_reduce(x, op=op, out=out)
                check_equal(out, want, f"out= {dt} {op} {count}", avg_float)
                check_equal(x, keep, f"input untouched {dt} {op} {count}")
                checked += 2
    return checked


def check_broadcast(comm, dt: str, count: int, root: int) -> None:
    """On every rank: broadcast of `count` `dt` elements from `root`, in place (over a buffer
    of 3s) and with out= (over 5s), against the root's data; the root's input of the out= form
    must be untouched."""
    ref = data(root, count, dt, "sum", salt=7)
    x = ref.copy() if comm.rank == root else np.full(count, 3, np_dtype(dt))
    comm.broadcast(x, root=root)
    check_equal(x, ref, f"broadcast {dt} {count} root {root}")
    src = ref.copy() if comm.rank == root else np.zeros(count, np_dtype(dt))
    out = np.full(count, 5, np_dtype(dt))
    comm.broadcast(src, root=root, out=out)
    check_equal(out, ref, f"broadcast out= {dt} {count} root {root}")
    if comm.rank == root:
        check_equal(src, ref, "root's input untouched")


def check_bitwise_sum(comm, n: int) -> list:
    """Random float32 all_reduce (out=) of n elements: every rank must get the bits of a
    rank-order left fold. Returns a sample of the result's bits for comparing across ranks."""
    mine = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    out = np.empty(n, np.float32)
    comm.all_reduce(mine, out=out)
    want = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    for r in range(1, comm.size):
        want = want + np.random.default_rng(r).standard_normal(n).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    return out.view(np.uint32)[::997].tolist()


def call_outcome(call) -> str:
    """Runs call(): "ok"; "ValueError" for a mismatch named as such ("differs between ranks"),
    "ValueError: <text>" for any other; "stopped" for CommAbortedError or PeerError (the
    executor stopped after a failure elsewhere, or a peer failed first)."""
    import linkwise
    try:
        call()
        return "ok"
    except ValueError as exc:
        return "ValueError" if "differs between ranks" in str(exc) else f"ValueError: {exc}"
    except (linkwise.CommAbortedError, linkwise.PeerError):
        return "stopped"

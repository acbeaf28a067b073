"""Collectives whose out overlaps x without being x (out = x shifted by one element either
way, both views of one buffer): every kind must read x as it was when the call began, on the
shared-memory executor, on each message-based algorithm (small chunks reach the pipelined
paths) and over TCP, blocking and async, against a NumPy reference. (The message-based
all_to_all and reduce once read x after received blocks had overwritten it.)"""
import numpy as np
import pytest

from multirank import run_ranks

SIZES = (2, 7, 1000, 3000)  # elements of a rank's block; 3000 float64 exceed a 1 KiB chunk


def _input(kind, r, n, m):
    """Rank r's x: small integers, so sums are exact."""
    length = n * m if kind in ("reduce_scatter", "all_to_all", "scatter") else m
    return (np.arange(length) % 97 + 1000 * r + 1).astype(np.float64)


def _expected(kind, r, n, m, root):
    ins = [_input(kind, q, n, m) for q in range(n)]
    if kind == "all_reduce":
        return sum(ins)
    if kind == "broadcast":
        return ins[root]
    if kind == "reduce":
        return sum(ins) if r == root else None
    if kind == "all_gather":
        return np.concatenate(ins)
    if kind == "reduce_scatter":
        return sum(ins)[r * m:(r + 1) * m]
    if kind == "all_to_all":
        return np.concatenate([x[r * m:(r + 1) * m] for x in ins])
    if kind == "gather":
        return np.concatenate(ins) if r == root else None
    return ins[root][r * m:(r + 1) * m]  # scatter


def _out_length(kind, n, m):
    return n * m if kind in ("all_gather", "all_to_all", "gather") else m


def _call(comm, kind, x, out, root, async_op):
    f = getattr(comm, kind)
    if kind in ("broadcast", "reduce", "gather", "scatter"):
        r = f(x, root=root, out=out, async_op=async_op)
    else:
        r = f(x, out=out, async_op=async_op)
    return r.wait() if async_op else r


KINDS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")


def _overlapping_calls(comm):
    n, r = comm.size, comm.rank
    root = n - 1
    checked = 0
    for kind in KINDS:
        for m in SIZES:
            lx, lo = len(_input(kind, r, n, m)), _out_length(kind, n, m)
            for shift in (1, -1):
                for async_op in (False, True):
                    buf = np.zeros(max(lx, lo) + 1)
                    x, out = (buf[:lx], buf[1:1 + lo]) if shift > 0 else (buf[1:1 + lx], buf[:lo])
                    x[:] = _input(kind, r, n, m)
                    _call(comm, kind, x, out, root, async_op)
                    want = _expected(kind, r, n, m, root)
                    if want is not None:
                        np.testing.assert_array_equal(out, want, err_msg=f"{kind} m={m} shift={shift} async={async_op}")
                        checked += 1
    x = np.full(3, r + 1.0)  # the communicator goes on
    comm.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(3, n * (n + 1) / 2))
    return checked


PATHS = {
    "executor": {},
    "ring": {"LINKWISE_ALGO": "ring", "LINKWISE_CHUNK_SIZE": "1K"},
    "tree": {"LINKWISE_ALGO": "tree", "LINKWISE_CHUNK_SIZE": "1K"},
    "chain": {"LINKWISE_ALGO": "chain", "LINKWISE_CHUNK_SIZE": "1K"},
    "direct": {"LINKWISE_ALGO": "direct", "LINKWISE_CHUNK_SIZE": "1K"},
    "tcp": {"LINKWISE_TRANSPORT": "tcp"},
}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("path", list(PATHS))
def test_out_overlapping_x(n, path):
    checked = run_ranks(n, _overlapping_calls, env=PATHS[path], timeout=120)
    assert min(checked) >= 6 * len(SIZES) * 4  # the six kinds whose out every rank holds, at least

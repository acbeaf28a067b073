"""NaN in min / max reductions: the result follows np.minimum / np.maximum (a NaN anywhere
gives NaN), whichever rank holds it, on every algorithm and path (one-shot, two-shot, lanes,
point-to-point ring and tree), and every rank gets the same bits."""
import numpy as np
import pytest

from coll_ref import np_dtype
from multirank import run_ranks

# Counts: one-shot, two-shot (above 32 KiB), and two-shot on several lanes (3 helper threads).
COUNTS = [5, 20_001, 300_001]
ENVS = {
    "shm": {"LINKWISE_COLL_THREADS": "3", "LINKWISE_COLL_LANE_MIN": "64K", "LINKWISE_SHM_CMA": "0"},
    "ring": {"LINKWISE_ALGO": "ring", "LINKWISE_CHUNK_SIZE": "8192"},
    "tree": {"LINKWISE_ALGO": "tree"},
}


def _inputs(rank, n, dtype, nan_rank):
    x = ((np.arange(n) * 7 + rank * 3) % 11 - 5).astype(np_dtype(dtype))
    if rank == nan_rank:
        x[::3] = np.nan  # every third element NaN on one rank
    return x


def _body(comm, dtype):
    out = []
    for n in COUNTS:
        for nan_rank in range(comm.size):
            every = [_inputs(r, n, dtype, nan_rank) for r in range(comm.size)]
            for op, ref in (("min", np.minimum), ("max", np.maximum)):
                want = every[0].copy()
                for a in every[1:]:
                    want = ref(want, a)
                x = _inputs(comm.rank, n, dtype, nan_rank)
                comm.all_reduce(x, op=op)
                np.testing.assert_array_equal(x, want, err_msg=f"all_reduce {op} n={n} NaN on {nan_rank}")
                r = comm.reduce(_inputs(comm.rank, n, dtype, nan_rank), op=op, root=nan_rank)
                if comm.rank == nan_rank:
                    np.testing.assert_array_equal(r, want, err_msg=f"reduce {op} n={n}")
                out.append(x.view(np.uint8).tobytes()[:64])
    return out


@pytest.mark.parametrize("path", sorted(ENVS))
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_nan_propagates_in_min_max(path, dtype):
    got = run_ranks(3, _body, dtype, env=ENVS[path], timeout=240)
    assert all(g == got[0] for g in got)  # the same bits on every rank

"""NaN in GPU min / max all_reduce: like np.minimum / np.maximum (a NaN anywhere gives NaN),
whichever rank holds it, on the one-shot and two-shot kernels, as on the CPU
(tests/test_coll_nan.py)."""
from __future__ import annotations

import numpy as np
import pytest

from multirank import run_ranks
from test_gpu_collectives import SMALL_SLOT, _nranks, _setup

pytestmark = pytest.mark.gpu


def _body(comm, dtype):
    g, torch = _setup(comm)
    errors = []
    for algo in ("oneshot", "twoshot"):
        for count in (7, 65537):
            for nan_rank in range(comm.size):
                every = [(np.arange(count) * 7 + r * 3) % 11 - 5.0 for r in range(comm.size)]
                for r in range(comm.size):
                    if r == nan_rank:
                        every[r][::3] = np.nan
                for op, ref in (("min", np.minimum), ("max", np.maximum)):
                    want = every[0]
                    for a in every[1:]:
                        want = ref(want, a)
                    x = torch.tensor(every[comm.rank], dtype=getattr(torch, dtype), device="cuda")
                    g.all_reduce(x, op=op, algo=algo)
                    got = x.float().cpu().numpy()
                    if not np.array_equal(got, want.astype(np.float32), equal_nan=True):
                        errors.append(f"rank {comm.rank} {algo} {count} {dtype} {op} NaN on {nan_rank}")
    g.close()
    return errors


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_nan_propagates_in_min_max(dtype):
    errors = [e for r in run_ranks(_nranks(), _body, dtype, env=SMALL_SLOT, timeout=300) for e in r]
    assert not errors, "\n".join(errors[:20])

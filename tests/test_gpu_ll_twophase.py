"""Two-phase LL kernels (csrc/cuda/ll_kernels.cu: all_reduce as reduce-scatter + all-gather,
broadcast as scatter + all-gather, over LL lines) and the LL kernel variants, against NumPy
references.

The tests force the two-phase kernels down to small sizes (LINKWISE_GPU_LL_TWOPHASE_MIN /
_LL_BCAST2_MIN, read under LINKWISE_GPU_TUNE=1) and raise LINKWISE_GPU_LL_MAX to the 256 KiB
cap, so one run crosses every boundary: one pass below the threshold, two phases above it,
chunks left empty (fewer packs than ranks), partial last packs, the flag kernels above the LL
cap. Every dtype and op, misaligned buffers, in place and out=, every broadcast root, 3 and 4
ranks, CUDA graph capture with eager calls between replays. Results must equal the
rank-order reference bitwise and be identical on every rank.
"""
from __future__ import annotations

import pytest

from multirank import run_ranks
from test_gpu_collectives import DTYPES, OPS, SAFE_ENV, _allreduce_body, _check, _nranks, _setup
from test_gpu_ll import _mixed_body

pytestmark = pytest.mark.gpu

LL_CAP = 256 * 1024


def _env(variant: int, two_min: int) -> dict:
    return {**SAFE_ENV, "LINKWISE_GPU_TUNE": "1", "LINKWISE_GPU_LL_MAX": str(LL_CAP),
            "LINKWISE_GPU_LL_TWOPHASE_MIN": str(two_min), "LINKWISE_GPU_LL_BCAST2_MIN": str(two_min),
            "LINKWISE_GPU_LL_VARIANT": str(variant)}


# float32 counts: 1 (one pack, the other ranks' chunks empty), 7, 1000, 4097 (partial pack),
# 65536 (256 KiB: the LL cap), 65537 (the flag kernels).
COUNTS = [1, 7, 1000, 4097, 65536, 65537]


def _bcast_body(comm, sizes):
    """Byte broadcasts from every root, aligned and misaligned."""
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    for i, nbytes in enumerate(sizes):
        for root in range(n):
            off = (i + root) % 3
            buf = torch.empty(nbytes + off, dtype=torch.uint8, device="cuda")
            x = buf[off:]
            src = ((torch.arange(nbytes) * 31 + i * 7 + root) % 253).to(torch.uint8)
            x.copy_(src if r == root else torch.full((nbytes,), 255, dtype=torch.uint8))
            g.broadcast(x, root=root)
            if not torch.equal(x.cpu(), src):
                bad = (x.cpu() != src).nonzero()
                errors.append(f"rank {r} broadcast {nbytes} root {root} +{off}: {len(bad)} bytes "
                              f"differ (first at {bad[0].tolist()})")
    g.close()
    return errors


BCAST_SIZES = [1, 2, 15, 16, 17, 48, 1000, 4099, 65536 * 3 + 5, LL_CAP, LL_CAP + 1]


@pytest.mark.parametrize("variant", [0, 15, 47])
def test_twophase_all_reduce_dtypes_ops_sizes(variant):
    n = _nranks()
    cases = [(c, d, o, "auto", 0) for d in DTYPES for o in OPS for c in (1, 7, 3001)]
    cases += [(c, "float32", "sum", "auto", off) for c in COUNTS for off in (0, 1)]
    cases += [(c, "bfloat16", "avg", "oneshot", 1) for c in (2049, 131072)]
    _check(run_ranks(n, _allreduce_body, cases, env=_env(variant, 1), timeout=300))
    if n >= 3:
        _check(run_ranks(3, _allreduce_body, cases[-16:], env=_env(variant, 1), timeout=300))


@pytest.mark.parametrize("variant", [0, 15, 47])
def test_twophase_broadcast_every_root(variant):
    n = _nranks()
    _check(run_ranks(n, _bcast_body, BCAST_SIZES, env=_env(variant, 1), timeout=300))
    if n >= 3:
        _check(run_ranks(3, _bcast_body, BCAST_SIZES[5:], env=_env(variant, 1), timeout=300))


@pytest.mark.parametrize("variant", [0, 15, 47])
def test_twophase_mixed_and_graph_replays(variant):
    """One-pass (below 2 KiB) and two-phase LL, flag kernels and two-shot in a random mix,
    then a captured two-phase all_reduce (999 float32) and broadcast (4001 bytes) replayed
    with eager one-pass calls in between (test_gpu_ll's body)."""
    _check(run_ranks(_nranks(), _mixed_body, 120, env=_env(variant, 2048), timeout=300))

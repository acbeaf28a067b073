"""LL128 kernels (csrc/cuda/ll128_kernels.cu: 128-byte lines of 7 data packs + a flag, one pass
and two phases, all_reduce and broadcast) against NumPy / torch-CPU references.

The tests force LL128 down to 1 byte (LINKWISE_GPU_LL128_MIN / _LL128_BCAST_MIN under
LINKWISE_GPU_TUNE=1), with one pass only or two phases from 1 byte, so one run crosses every
boundary: lines with one pack, partial last lines and packs, chunks without lines, the LL cap
(256 KiB) and the flag kernels above it. Every dtype and op, misaligned buffers, in place and
out=, every broadcast root (in place and out of place), 3 and 4 ranks, graph replays with eager
calls between, and a stress run of many back-to-back epochs at 256 KiB whose every byte is
checked: LL128 relies on a warp's 128-byte line store arriving whole (ll128.cuh), and a torn
line would show up here as wrong bytes.
"""
from __future__ import annotations

import pytest

from multirank import run_ranks
from test_gpu_collectives import DTYPES, OPS, SAFE_ENV, _allreduce_body, _check, _nranks, _setup
from test_gpu_ll import _mixed_body
from test_gpu_ll_twophase import BCAST_SIZES, COUNTS, LL_CAP, _bcast_body

pytestmark = pytest.mark.gpu

OFF = str(1 << 30)


def _env(two: bool) -> dict:
    return {**SAFE_ENV, "LINKWISE_GPU_TUNE": "1", "LINKWISE_GPU_LL_MAX": str(LL_CAP),
            "LINKWISE_GPU_LL128_MIN": "1", "LINKWISE_GPU_LL128_BCAST_MIN": "1",
            "LINKWISE_GPU_LL_TWOPHASE_MIN": "1" if two else OFF,
            "LINKWISE_GPU_LL_BCAST2_MIN": "1" if two else OFF}


@pytest.mark.parametrize("two", [False, True], ids=["onepass", "twophase"])
def test_ll128_all_reduce_dtypes_ops_sizes(two):
    n = _nranks()
    cases = [(c, d, o, "auto", 0) for d in DTYPES for o in OPS for c in (1, 7, 3001)]
    cases += [(c, "float32", "sum", "auto", off) for c in COUNTS + [4095, 16383] for off in (0, 1)]
    cases += [(c, "bfloat16", "avg", "oneshot", 1) for c in (2049, 131072)]
    _check(run_ranks(n, _allreduce_body, cases, env=_env(two), timeout=300))
    if n >= 3:
        _check(run_ranks(3, _allreduce_body, cases[-12:], env=_env(two), timeout=300))


def _bcast_out_body(comm, sizes):
    """Out-of-place byte broadcasts (the root's kernel copies x into out) from every root."""
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    for i, nbytes in enumerate(sizes):
        for root in range(n):
            src = ((torch.arange(nbytes) * 17 + i + root) % 251).to(torch.uint8)
            x = (src if r == root else torch.zeros(nbytes, dtype=torch.uint8)).cuda()
            out = torch.full((nbytes + 1,), 9, dtype=torch.uint8, device="cuda")[1:]
            g.broadcast(x, root=root, out=out)
            if not torch.equal(out.cpu(), src):
                errors.append(f"rank {r} broadcast out= {nbytes} root {root}: wrong")
            if r == root and not torch.equal(x.cpu(), src):
                errors.append(f"rank {r} broadcast out= {nbytes} root {root}: x changed")
    g.close()
    return errors


@pytest.mark.parametrize("two", [False, True], ids=["onepass", "twophase"])
def test_ll128_broadcast_every_root(two):
    n = _nranks()
    sizes = BCAST_SIZES + [111, 112, 113, 7 * 16 * 3 + 1]
    _check(run_ranks(n, _bcast_body, sizes, env=_env(two), timeout=300))
    _check(run_ranks(n, _bcast_out_body, [1, 113, 4099, LL_CAP - 3], env=_env(two), timeout=300))
    if n >= 3:
        _check(run_ranks(3, _bcast_body, sizes[5:], env=_env(two), timeout=300))


@pytest.mark.parametrize("two", [False, True], ids=["onepass", "twophase"])
def test_ll128_mixed_and_graph_replays(two):
    """LL128 with flag kernels and two-shot in a random mix, then captured LL128 calls replayed
    with eager calls between (test_gpu_ll's body)."""
    _check(run_ranks(_nranks(), _mixed_body, 120, env=_env(two), timeout=300))


def _stress_body(comm, reps):
    """`reps` back-to-back 256 KiB all_reduces and broadcasts with no host sync between,
    each on fresh data, all results kept and checked at the end."""
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    count = LL_CAP // 4
    base = torch.arange(count, dtype=torch.int32, device="cuda")
    ars, bcs = [], []
    for it in range(reps):
        a = (base * (r + 1) + it) % 100003
        g.all_reduce(a)
        b = ((base + it) * 7 % 65521) if r == it % n else torch.zeros_like(base)
        g.broadcast(b, root=it % n)
        ars.append(a)
        bcs.append(b)
    torch.cuda.synchronize()
    errors = []
    for it in range(reps):
        want = sum((base * (q + 1) + it) % 100003 for q in range(n))
        if not torch.equal(ars[it], want):
            errors.append(f"rank {r} rep {it}: all_reduce wrong in {int((ars[it] != want).sum())} elements")
        if not torch.equal(bcs[it], (base + it) * 7 % 65521):
            errors.append(f"rank {r} rep {it}: broadcast wrong")
    g.close()
    return errors[:10]


@pytest.mark.parametrize("two", [False, True], ids=["onepass", "twophase"])
def test_ll128_stress_back_to_back(two):
    _check(run_ranks(_nranks(), _stress_body, 200, env=_env(two), timeout=300))

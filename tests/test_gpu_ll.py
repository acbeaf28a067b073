"""Small all_reduce / broadcast on the LL kernels (csrc/cuda/ll_kernels.cu: data and flag in one
8-byte store, lines zeroed by the reader), against NumPy references.

Messages of 1 .. 256 KiB (LINKWISE_GPU_LL_MAX) take them (two phases from 192 KiB with 3+
ranks: test_gpu_ll_twophase.py); the tests use every dtype and op, misaligned buffers, in place
and out=, every root, interleave LL epochs with the flag kernels (two-shot, larger messages,
scatter-allgather broadcast) on the same slots' parities, and replay captured LL operations
many times (a stale line would be accepted as fresh there).
Results must equal the rank-order reference bitwise and be identical on every rank.
"""
from __future__ import annotations

import pytest

from multirank import run_ranks
from test_gpu_collectives import DTYPES, OPS, SAFE_ENV, _allreduce_body, _check, _nranks, _setup

pytestmark = pytest.mark.gpu

# 8192 / 8193 float32: around the old 32 KiB LL limit (both LL now; the 256 KiB limit and the
# flag kernels above it: test_gpu_ll_twophase.py COUNTS).
LL_SIZES = [1, 3, 7, 64, 1000, 4097, 8192, 8193]


def test_ll_all_reduce_dtypes_ops_sizes():
    n = _nranks()
    cases = [(c, d, o, "oneshot", 0) for d in DTYPES for o in OPS for c in (1, 7, 1000)]
    cases += [(c, "float32", "sum", "auto", off) for c in LL_SIZES for off in (0, 1)]
    cases += [(c, "float16", "max", "auto", 1) for c in (3, 16383, 16384, 16385)]
    _check(run_ranks(n, _allreduce_body, cases, env=SAFE_ENV, timeout=300))
    if n >= 3:
        _check(run_ranks(3, _allreduce_body, cases[-12:], env=SAFE_ENV, timeout=300))


def _mixed_body(comm, iters):
    """Random mix of LL and flag-kernel all_reduce / broadcast, eager, then captured."""
    import numpy as np
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(5)  # same sequence on every rank
    errors = []
    for it in range(iters):
        kind = rng.integers(0, 4)
        count = int(rng.choice([1, 2, 5, 1023, 8192, 8193, 70000]))
        off = int(rng.integers(0, 2))
        if kind < 2:  # all_reduce (auto: LL, one-shot or two-shot) or explicit two-shot
            buf = torch.empty(count + off, dtype=torch.int32, device="cuda")
            x = buf[off:]
            x.copy_((torch.arange(count, dtype=torch.int32) * (r + 1) + it) % 1000)
            g.all_reduce(x, algo="auto" if kind == 0 else "twoshot")
            want = sum((torch.arange(count, dtype=torch.int32) * (q + 1) + it) % 1000 for q in range(n))
        else:  # broadcast of bytes, every root in turn
            root = it % n
            nbytes = count * (1 + kind % 2)
            buf = torch.empty(nbytes + off, dtype=torch.uint8, device="cuda")
            x = buf[off:]
            src = (torch.arange(nbytes) * 7 + it + root) % 251
            x.copy_(src if r == root else torch.zeros(nbytes, dtype=torch.int64))
            g.broadcast(x, root=root)
            want = src.to(torch.uint8)
        if not torch.equal(x.cpu(), want.to(x.dtype)):
            errors.append(f"rank {r} iteration {it} kind {kind} count {count}: wrong")
    # Captured: one LL all_reduce and one LL broadcast per replay, eager calls in between.
    a = torch.zeros(999, device="cuda")
    b = torch.zeros(4001, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.all_reduce(a)
        g.broadcast(b, root=n - 1)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.all_reduce(a)
        g.broadcast(b, root=n - 1)
    for rep in range(60):
        a.fill_(float(r + rep))
        b.fill_(rep % 256 if r == n - 1 else 0)
        graph.replay()
        if rep % 3 == 0:
            e = torch.full((5,), float(r), device="cuda")
            g.all_reduce(e)  # eager LL epoch between replays
            if not torch.equal(e.cpu(), torch.full((5,), float(sum(range(n))))):
                errors.append(f"rank {r} replay {rep}: eager all_reduce wrong")
        if not torch.equal(a.cpu(), torch.full((999,), float(sum(q + rep for q in range(n))))):
            errors.append(f"rank {r} replay {rep}: captured all_reduce wrong")
        if not torch.equal(b.cpu(), torch.full((4001,), rep % 256, dtype=torch.uint8)):
            errors.append(f"rank {r} replay {rep}: captured broadcast wrong")
    g.close()
    return errors[:10]


def test_ll_mixed_with_flag_kernels_and_graph_replays():
    _check(run_ranks(_nranks(), _mixed_body, 120, env=SAFE_ENV, timeout=300))


def test_ll_max_settings():
    """LINKWISE_GPU_LL_MAX=0 (the flag kernels only: the A/B baseline of the benchmarks) and
    131072 (the largest LL message: 128 KiB, across that boundary)."""
    cases = [(c, "bfloat16", "sum", "auto", 1) for c in (1, 7, 8192)]
    _check(run_ranks(_nranks(), _allreduce_body, cases,
                     env={**SAFE_ENV, "LINKWISE_GPU_LL_MAX": "0"}, timeout=300))
    cases = [(c, "float32", o, "auto", off) for c in (5, 32768, 32769) for o, off in (("sum", 0), ("min", 1))]
    cases += [(c, "float64", "prod", "oneshot", 0) for c in (3, 16384)]
    _check(run_ranks(_nranks(), _allreduce_body, cases,
                     env={**SAFE_ENV, "LINKWISE_GPU_LL_MAX": "131072"}, timeout=300))

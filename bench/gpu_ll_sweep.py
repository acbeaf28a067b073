"""LL kernel variant sweep for small all_reduce / broadcast, every rank under ``linkwise launch``
with LINKWISE_GPU_TUNE=1 (the knobs are re-read at every call):

    LINKWISE_GPU_TUNE=1 python3 -m linkwise.cli launch -n 4 bench/gpu_ll_sweep.py [--rows fifth|third] [--json F]

For each configuration (environment knobs: LINKWISE_GPU_LL_VARIANT bits, _LL_MAX, _LL_THREADS,
_LL_BLOCKS, _LL_TWOPHASE_MIN, _LL_BCAST2_MIN, _LL128_MIN, _LL128_BCAST_MIN, _LL128_THREADS,
_LL128_BLOCKS; ll.cuh / ll128.cuh / ll_kernels.cu say what they do; --rows picks the third
session's rows, the fifth session's LL128 / announce rows (the default) or the sixth session's
2-rank LL128 geometry rows, sixth2) and
size: the GPU µs per op of the engine's all_reduce (float32 sum, in place) and broadcast (root
0), 100 ops captured in one CUDA graph, 10 replays (linkwise.bench.gpu.time_ops, slowest
rank), and a correctness check (all_reduce of exact small integers, broadcast from the last
rank, both at the size and at an odd misaligned neighbour). NCCL called directly
(cupy.cuda.nccl, the bench's nccl-cupy) is timed the same way at the start and at the end.
Every row sets its knobs explicitly: under LINKWISE_GPU_TUNE an unset LINKWISE_GPU_LL_MAX falls
back to the value the process saw at its first call, not to the built-in default.
"""
from __future__ import annotations

import argparse
import os
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

SMALL = [8, 512, 4 << 10, 32 << 10]
LARGE = [64 << 10, 128 << 10, 256 << 10]
MID = [32 << 10, 64 << 10, 128 << 10, 256 << 10]
OFF = str(1 << 30)
BIG = {"LINKWISE_GPU_LL_MAX": str(256 << 10), "LINKWISE_GPU_LL_TWOPHASE_MIN": OFF,
       "LINKWISE_GPU_LL_BCAST2_MIN": OFF}  # one pass up to 256 KiB
TWO = {**BIG, "LINKWISE_GPU_LL_TWOPHASE_MIN": "1", "LINKWISE_GPU_LL_BCAST2_MIN": "1"}
OLD = {"LINKWISE_GPU_LL_MAX": str(32 << 10), "LINKWISE_GPU_LL_TWOPHASE_MIN": OFF,
       "LINKWISE_GPU_LL_BCAST2_MIN": OFF}  # the previous defaults: flag kernels above 32 KiB


def configs_fifth() -> list:
    """The fifth session's rows: LL against LL128 (one pass / two phases) at 16-256 KiB and the
    start-announce variants at small sizes (bit 16: warp 1 announces; bit 32: a spare block 0
    announces, the default since), the defaults of that session's start (v15, LL128 off,
    two-phase from 192 KiB) and of its end (v47, LL128 from 32 / 128 KiB, one pass for
    broadcast) first and last, to show the drift."""
    LL = {"LINKWISE_GPU_LL_MAX": str(256 << 10), "LINKWISE_GPU_LL128_MIN": OFF,
          "LINKWISE_GPU_LL128_BCAST_MIN": OFF, "LINKWISE_GPU_LL_TWOPHASE_MIN": str(192 << 10),
          "LINKWISE_GPU_LL_BCAST2_MIN": str(192 << 10)}
    # "new default" as first measured (LL128 all_reduce from 32 KiB, two phases from 192 KiB);
    # the final defaults (LL128 from 16 KiB, one pass up to 256 KiB on 4 ranks) are the
    # "ll128 one-pass v47" rows from 16 KiB.
    NEW = {"LINKWISE_GPU_LL_MAX": str(256 << 10), "LINKWISE_GPU_LL128_MIN": str(32 << 10),
           "LINKWISE_GPU_LL128_BCAST_MIN": str(128 << 10),
           "LINKWISE_GPU_LL_TWOPHASE_MIN": str(192 << 10), "LINKWISE_GPU_LL_BCAST2_MIN": OFF}
    L1 = {**LL, "LINKWISE_GPU_LL128_MIN": "1", "LINKWISE_GPU_LL128_BCAST_MIN": "1",
          "LINKWISE_GPU_LL_TWOPHASE_MIN": OFF, "LINKWISE_GPU_LL_BCAST2_MIN": OFF}
    L2 = {**L1, "LINKWISE_GPU_LL_TWOPHASE_MIN": "1", "LINKWISE_GPU_LL_BCAST2_MIN": "1"}
    v = lambda b, env: {**env, "LINKWISE_GPU_LL_VARIANT": str(b)}  # noqa: E731
    small, mid = [8, 64, 512, 4 << 10], [16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10]
    rows = [("old default v15", v(15, LL), small + mid), ("new default v47", v(47, NEW), small + mid)]
    rows += [("ll v31", v(31, LL), small), ("ll v47", v(47, LL), small + mid)]
    for b in (15, 47):
        rows += [(f"ll128 one-pass v{b}", v(b, L1), mid), (f"ll128 two-phase v{b}", v(b, L2), mid)]
    rows += [("ll128 one-pass v47 t128", {**v(47, L1), "LINKWISE_GPU_LL128_THREADS": "128"}, LARGE),
             ("ll128 one-pass v47 b128", {**v(47, L1), "LINKWISE_GPU_LL128_BLOCKS": "128"}, LARGE)]
    rows += [("old default v15 again", v(15, LL), small + mid), ("new default v47 again", v(47, NEW), small + mid)]
    return rows


def configs_sixth2() -> list:
    """The sixth session's 2-rank rows: LL128 all_reduce geometry at 64-256 KiB (threads per
    block, block cap) against the defaults of that session (LL128 from 32 KiB on 2 ranks) and
    LL one pass, the defaults first and last to show the drift."""
    base = {"LINKWISE_GPU_LL_MAX": str(256 << 10), "LINKWISE_GPU_LL128_MIN": str(32 << 10),
            "LINKWISE_GPU_LL128_BCAST_MIN": OFF}
    rows = [("default", base, LARGE)]
    for t in ("128", "256"):
        rows.append((f"ll128 t{t}", {**base, "LINKWISE_GPU_LL128_THREADS": t}, LARGE))
    for b in ("512", "256"):
        rows.append((f"ll128 b{b}", {**base, "LINKWISE_GPU_LL128_BLOCKS": b}, LARGE))
    rows += [("ll one pass", {**base, "LINKWISE_GPU_LL128_MIN": OFF}, LARGE), ("default again", base, LARGE)]
    return rows


def configs_third() -> list:
    """(name, env, sizes); PDL (variant bit 8) last: a capture failure there spoils no other row."""
    v = lambda bits, **kw: {"LINKWISE_GPU_LL_VARIANT": str(bits), **kw}  # noqa: E731
    rows = [(f"v{b}", v(b, **OLD), SMALL) for b in (0, 1, 2, 4, 3, 7)]
    rows += [("flag kernels", v(0, **OLD), LARGE)]
    for b in (0, 7):
        rows += [(f"v{b} one-pass", {**v(b), **BIG}, [32 << 10] + LARGE),
                 (f"v{b} two-phase", {**v(b), **TWO}, [32 << 10] + LARGE)]
    for blocks in (256, 512):
        rows += [(f"v7 one-pass b{blocks}", {**v(7), **BIG, "LINKWISE_GPU_LL_BLOCKS": str(blocks)}, LARGE),
                 (f"v7 two-phase b{blocks}", {**v(7), **TWO, "LINKWISE_GPU_LL_BLOCKS": str(blocks)}, LARGE)]
    rows += [("v7 two-phase t128", {**v(7), **TWO, "LINKWISE_GPU_LL_THREADS": "128"}, LARGE)]
    rows += [(f"v{b}", v(b, **OLD), SMALL) for b in (8, 9, 15)]
    rows += [("v15 two-phase", {**v(15), **TWO}, [32 << 10] + LARGE),
             ("v15 one-pass", {**v(15), **BIG}, LARGE)]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--rows", default="fifth", choices=["fifth", "third", "sixth2"])
    a = ap.parse_args()
    import torch
    from gpu_rank import GpuRank
    from linkwise.bench.gpu_nccl import NcclDirectBackend
    R = GpuRank(torch)
    comm, helper, g, stream, rank, n, say = R.comm, R.helper, R.g, R.stream, R.rank, R.n, R.say
    s, e = stream.cuda_stream, g._engine

    def t_us(fn, graph=True, iters=100):
        """Graphs: the median of 3 timings (each 100 ops captured, replayed) against noise."""
        reps = sorted(R.time_us(fn, iters, 5, graph) for _ in range(3 if graph else 1))
        return round(reps[len(reps) // 2], 3)

    sizes = sorted(set(SMALL + LARGE + [64, 16 << 10]))
    bufs = {b: torch.ones(b // 4, device="cuda") for b in sizes}
    direct = NcclDirectBackend(helper, g.device)

    def nccl_rows(tag):
        for b in sizes:
            y = bufs[b]
            p, k = y.data_ptr(), y.numel()
            say({"what": "nccl-cupy", "when": tag, "bytes": b,
                 "all_reduce": t_us(lambda: direct.c.allReduce(p, p, k, 7, 0, s)),
                 "broadcast": t_us(lambda: direct.c.broadcast(p, p, k, 7, 0, s))})

    def check(count, off) -> bool:
        buf = torch.empty(count + off, device="cuda")
        y = buf[off:]
        y.copy_(torch.arange(count, device="cuda") % 7 + rank)
        e.all_reduce(y.data_ptr(), y.data_ptr(), count, 0, 0, s, 0)
        b = torch.empty(4 * count + off, dtype=torch.uint8, device="cuda")[off:]
        src = (torch.arange(4 * count, device="cuda") * 13 % 251).to(torch.uint8)
        b.copy_(src if rank == n - 1 else torch.zeros_like(src))
        e.broadcast(b.data_ptr(), 4 * count, n - 1, s)
        torch.cuda.synchronize()
        want = n * (torch.arange(count, device="cuda") % 7) + n * (n - 1) // 2
        return bool(torch.equal(y, want.float())) and bool(torch.equal(b, src))

    nccl_rows("start")
    say({"what": "floor", "torch add_ graph us": t_us(lambda: bufs[8].add_(1))})
    configs = {"fifth": configs_fifth, "third": configs_third, "sixth2": configs_sixth2}[a.rows]
    for name, env, szs in configs():
        os.environ.update(env)
        try:
            for b in szs:
                y = bufs[b]
                p, k = y.data_ptr(), y.numel()
                row = {"what": "ll", "config": name, "bytes": b,
                       "all_reduce": t_us(lambda: e.all_reduce(p, p, k, 0, 0, s, 0)),
                       "broadcast": t_us(lambda: e.broadcast(p, b, 0, s))}
                if b == 8:
                    row["all_reduce eager"] = t_us(lambda: e.all_reduce(p, p, k, 0, 0, s, 0), graph=False, iters=300)
                ok = check(k, 0) and check(k + 5, 1)
                row["ok"] = bool(helper.max_over_ranks(0.0 if ok else 1.0) == 0.0)
                row["error_code"] = int(e.error_code())
                say(row)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next config
            say({"what": "ll", "config": name, "failed": repr(exc)[:300]})
            torch.cuda.synchronize()
        for k in env:
            os.environ.pop(k, None)
    nccl_rows("end")
    direct.close()
    R.dump(a.json)
    g.close()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

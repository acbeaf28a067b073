"""Where do the rare ~0.3 ms-per-call stalls of small GPU all_reduces in CUDA graphs come from
(docs/benchmarks.md, sixth session, 2xH200 call 4)? Every rank under `linkwise launch -n N`:

    LINKWISE_GPU_TUNE=1 python3 -m linkwise.cli launch -n 2 bench/gpu_stall_probe.py [--rounds 12]

Each round, for 64 / 128 / 256 KiB (float32 sum, in place, the engine's all_reduce), captures
100 calls in a CUDA graph, replays it once, host+GPU barrier, then replays it 10 times with a
CUDA event after every replay and the host clock read after every replay() call returns. A
replay slower than 20x the round's median is a stall; rank 0 prints one JSON line per stall
with every rank's view: the GPU time of that replay on each rank and the host's time to issue
it there (a slow host issue on one rank with slow GPU replays on the others points at the
host; slow GPU replays with quick issues everywhere point at the kernels). Between sizes the
knob rows of gpu_ll_sweep.py's sixth2 alternate (LL128 64 / 128 threads, LL one pass), as in
the sweep where two stalls were seen, and a misaligned all_reduce runs as its check did
(with --bcast also a misaligned uint8 broadcast from the last rank and 10 replays of a graph of
100 broadcasts before each all_reduce timing, the sweep's order).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

SIZES = [64 << 10, 128 << 10, 256 << 10]
OFF = str(1 << 30)
ROWS = [{"LINKWISE_GPU_LL128_MIN": str(32 << 10), "LINKWISE_GPU_LL128_THREADS": "64"},
        {"LINKWISE_GPU_LL128_MIN": str(32 << 10), "LINKWISE_GPU_LL128_THREADS": "128"},
        {"LINKWISE_GPU_LL128_MIN": OFF, "LINKWISE_GPU_LL128_THREADS": "64"}]
REPLAYS, ITERS = 10, 100


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--bcast", action="store_true", help="broadcast graphs and checks between sizes")
    a = ap.parse_args()
    import torch
    from gpu_rank import GpuRank
    R = GpuRank(torch)
    s, e, rank = R.stream, R.g._engine, R.rank
    os.environ["LINKWISE_GPU_LL_MAX"] = str(256 << 10)
    bufs = {b: torch.ones(b // 4, device="cuda") for b in SIZES}
    odd = torch.ones((64 << 10) // 4 + 6, device="cuda")[1:]
    oddb = torch.zeros((64 << 10) + 7, dtype=torch.uint8, device="cuda")[1:]
    stalls = 0
    for rnd in range(a.rounds):
        os.environ.update(ROWS[rnd % len(ROWS)])
        for b in SIZES:
            p, k = bufs[b].data_ptr(), bufs[b].numel()
            with torch.cuda.stream(s):
                e.all_reduce(odd.data_ptr(), odd.data_ptr(), odd.numel(), 0, 0, s.cuda_stream, 0)
                if a.bcast:  # the sweep's order: the previous size's broadcast graph and check
                    e.broadcast(oddb.data_ptr(), oddb.numel(), R.n - 1, s.cuda_stream)
                    gb = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(gb, stream=s):
                        for _ in range(ITERS):
                            e.broadcast(p, b, 0, s.cuda_stream)
                    for _ in range(REPLAYS):
                        gb.replay()
                    s.synchronize()
                    R.helper.barrier()
                    del gb
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    for _ in range(ITERS):
                        e.all_reduce(p, p, k, 0, 0, s.cuda_stream, 0)
                g.replay()
            R.barrier()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(REPLAYS + 1)]
            issue = []
            ev[0].record(s)
            for i in range(REPLAYS):
                t0 = time.perf_counter()
                g.replay()
                issue.append(1e6 * (time.perf_counter() - t0))
                ev[i + 1].record(s)
            ev[-1].synchronize()
            gpu = [1e3 * ev[i].elapsed_time(ev[i + 1]) / ITERS for i in range(REPLAYS)]  # us/call
            med = sorted(gpu)[REPLAYS // 2]
            mine = [i for i in range(REPLAYS) if gpu[i] > 20 * med]
            flag = R.helper.max_over_ranks(float(len(mine)))
            if flag > 0:  # everyone reports its view of this timing
                stalls += 1
                views = R.comm.all_gather(torch.tensor(gpu + issue, dtype=torch.float64).numpy())
                R.say({"round": rnd, "row": ROWS[rnd % len(ROWS)], "bytes": b, "median_us": round(med, 2),
                       "per_rank": [{"gpu_us_per_call": [round(v, 1) for v in views[r * 2 * REPLAYS:(r * 2 + 1) * REPLAYS]],
                                     "issue_us": [round(v, 1) for v in views[(r * 2 + 1) * REPLAYS:(r + 1) * 2 * REPLAYS]]}
                                    for r in range(R.n)]})
            del g
    R.say({"rounds": a.rounds, "timings": a.rounds * len(SIZES), "with_stall": stalls,
           "error_code": int(e.error_code())})
    R.g.close()
    R.comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Best-of-blocks latency of the 8-byte all_reduce (2 floats), in place and out of place.

    linkwise launch -n 2 bench/latency_blocks.py [--blocks 30] [--calls 2000]

Runs `blocks` blocks of `calls` back-to-back calls of each form (a barrier before each) and
prints, on rank 0, the best block's mean time per call in microseconds: "in-place out-of-place".
The best block shows what the code costs when the VM leaves both ranks alone; the bench's mean
over all calls (linkwise bench) shows what a user sees, stalls included.
"""
import argparse
import time

import numpy as np

import linkwise

parser = argparse.ArgumentParser()
parser.add_argument("--blocks", type=int, default=30)
parser.add_argument("--calls", type=int, default=2000)
args = parser.parse_args()
comm = linkwise.init()
x = np.ones(2, np.float32)
y = np.empty_like(x)
best = {"in": float("inf"), "out": float("inf")}
for _ in range(args.blocks):
    for form in ("in", "out"):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            comm.all_reduce(x) if form == "in" else comm.all_reduce(x, out=y)
        best[form] = min(best[form], (time.perf_counter() - t0) / args.calls)
if comm.rank == 0:
    print(f"{best['in'] * 1e6:.3f} {best['out'] * 1e6:.3f}")
comm.close()

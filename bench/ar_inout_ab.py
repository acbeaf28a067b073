"""Median time of a 2-rank (or n-rank) all_reduce, out of place and in place, float32.

    AB_BYTES=16777216 AB_TAG=base linkwise launch -n 2 bench/ar_inout_ab.py

Seven blocks of 20 calls per form after a barrier; rank 0 prints the median block's mean per
call. Meant for A/B runs of two builds alternated launch by launch (PYTHONPATH picks the
build), since this VM's speed drifts between launches.
"""
import os, time, numpy as np, linkwise
comm = linkwise.init()
n = int(os.environ.get("AB_BYTES", 16 << 20)) // 4
x = np.random.default_rng(comm.rank).random(n, dtype=np.float32); y = np.empty_like(x)
ref = x.copy()
res = {}
for form in ("out", "in"):
    ts = []
    for blk in range(7):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            if form == "out": comm.all_reduce(x, out=y)
            else: comm.all_reduce(x)
        ts.append((time.perf_counter() - t0) / 20 * 1e6)
    res[form] = sorted(ts)[3]
if comm.rank == 0:
    print("AB", os.environ.get("AB_TAG", ""), " ".join(f"{k} {v:.0f}us" for k, v in res.items()), flush=True)

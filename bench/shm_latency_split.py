"""How much of a small shared-memory all_reduce is Python? Run under `linkwise launch -n 2`:

    python3 -m linkwise.cli launch -n 2 bench/shm_latency_split.py [--blocks 30] [--calls 2000]

Times 8-byte float32 sums through `comm.all_reduce` (the Python latency path in
collectives.py) and through the native executor it calls (`comm._fast_shm.all_reduce`, the
same native call without the Python checks), in place and out of place, blocks of each
alternating behind a barrier; rank 0 prints the median and 10th percentile µs per call.
"""
import argparse
import time

import numpy as np

import linkwise
from linkwise._coll_args import _FAST_CODES_BY_OP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    comm = linkwise.init()
    x, y = np.zeros(2, np.float32), np.empty(2, np.float32)
    comm.all_reduce(x)  # attaches the executor
    fast, to = comm._fast_shm, comm.timeout
    code = _FAST_CODES_BY_OP["sum"][x.dtype]
    loops = {"comm.all_reduce in place": lambda: comm.all_reduce(x),
             "native call in place": lambda: fast.all_reduce(x, x, code, to),
             "comm.all_reduce out of place": lambda: comm.all_reduce(x, out=y),
             "native call out of place": lambda: fast.all_reduce(x, y, code, to)}
    times: dict = {k: [] for k in loops}
    for _ in range(a.blocks):
        for name, fn in loops.items():
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            times[name].append((time.perf_counter() - t0) / a.calls * 1e6)
    if comm.rank == 0:
        for name, v in times.items():
            v.sort()
            print(f"{name:30s} median {v[len(v) // 2]:.3f} us, p10 {v[len(v) // 10]:.3f} us")
    comm.close()


if __name__ == "__main__":
    main()

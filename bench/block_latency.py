"""8-byte block collectives as users call them, with and without out=. Run under
`linkwise launch -n 2 bench/block_latency.py [--blocks 20] [--calls 2000]` (from a tree's root
with PYTHONPATH=src to time that tree). Every form runs in blocks of `--calls` calls behind a
barrier, the forms alternating; rank 0 prints each form's median and 10th percentile µs per
call over the blocks (a gather's and scatter's times are the root's, rank 0)."""
import argparse
import time

import numpy as np

import linkwise


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    comm = linkwise.init()
    n, r = comm.size, comm.rank
    x = np.zeros(2, np.float32)         # 8 bytes a rank
    xs = np.zeros(2 * n, np.float32)    # 8 bytes a block
    out_g, out_b = np.empty(2 * n, np.float32), np.empty(2, np.float32)
    comm.all_reduce(x)  # attaches the executor
    forms = {
        "all_gather(x)": lambda: comm.all_gather(x),
        "all_gather(x, out=)": lambda: comm.all_gather(x, out=out_g),
        "reduce_scatter(x)": lambda: comm.reduce_scatter(xs),
        "reduce_scatter(x, out=)": lambda: comm.reduce_scatter(xs, out=out_b),
        "all_to_all(x) in place": lambda: comm.all_to_all(xs),
        "gather(x, 0)": lambda: comm.gather(x, 0),
        "gather(x, 0, out=)": lambda: comm.gather(x, 0, out=out_g if r == 0 else None),
        "scatter(x, 0)": lambda: comm.scatter(xs if r == 0 else None, 0, out=None if r == 0 else out_b),
        "scatter(x, 0, out=)": lambda: comm.scatter(xs if r == 0 else None, 0, out=out_b),
        "all_reduce(x)": lambda: comm.all_reduce(x),
    }
    times: dict = {k: [] for k in forms}
    for _ in range(a.blocks):
        for name, fn in forms.items():
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                fn()
            times[name].append((time.perf_counter() - t0) / a.calls * 1e6)
    if r == 0:
        for name, v in times.items():
            v.sort()
            print(f"{name:26s} median {v[len(v) // 2]:6.3f} us  p10 {v[len(v) // 10]:6.3f} us")
    comm.close()


if __name__ == "__main__":
    main()

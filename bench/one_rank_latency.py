"""One-rank CPU collectives as users call them (linkwise.init() with no launcher: one rank).
Run as `PYTHONPATH=src python bench/one_rank_latency.py` from a tree's root to time that
tree. Each form runs 200 warm-up calls, then 7 blocks of --calls calls (8 B; a tenth of them
at 1 MiB); prints each form's median µs per call over the blocks, at 8 B and 1 MiB float32,
in place ("in"), into out= ("out"), with the result allocated ("alloc"), async_op=True
(waited for) and awaited (aall_reduce)."""
import argparse
import asyncio
import statistics
import time

import numpy as np

import linkwise


def median_us(fn, calls: int, blocks: int = 7) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(blocks):
        t = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter_ns() - t) / calls / 1000)
    return statistics.median(times)


async def awaited_us(comm, x, calls: int, blocks: int = 5) -> float:
    for _ in range(100):
        await comm.aall_reduce(x)
    times = []
    for _ in range(blocks):
        t = time.perf_counter_ns()
        for _ in range(calls):
            await comm.aall_reduce(x)
        times.append((time.perf_counter_ns() - t) / calls / 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000, help="calls per block at 8 B (default 3000)")
    args = ap.parse_args()
    comm = linkwise.init()
    if comm.size != 1:
        raise SystemExit("run it without a launcher: it times a one-rank communicator")
    for nbytes in (8, 1 << 20):
        x = np.ones(nbytes // 4, np.float32)
        o = np.empty_like(x)
        calls = args.calls if nbytes == 8 else max(1, args.calls // 10)
        forms = {
            "all_reduce in": lambda: comm.all_reduce(x),
            "all_reduce out": lambda: comm.all_reduce(x, out=o),
            "broadcast in": lambda: comm.broadcast(x),
            "broadcast out": lambda: comm.broadcast(x, out=o),
            "reduce in": lambda: comm.reduce(x),
            "reduce out": lambda: comm.reduce(x, out=o),
            "all_gather out": lambda: comm.all_gather(x, out=o),
            "all_gather alloc": lambda: comm.all_gather(x),
            "reduce_scatter out": lambda: comm.reduce_scatter(x, out=o),
            "all_to_all in": lambda: comm.all_to_all(x),
            "all_to_all out": lambda: comm.all_to_all(x, out=o),
            "gather out": lambda: comm.gather(x, out=o),
            "scatter out": lambda: comm.scatter(x, out=o),
            "all_reduce async": lambda: comm.all_reduce(x, async_op=True).wait(),
        }
        if nbytes == 8:
            forms["barrier"] = lambda: comm.barrier()
            forms["barrier async"] = lambda: comm.barrier(async_op=True).wait()
        for name, fn in forms.items():
            print(f"{nbytes:>8} B  {name:<20} {median_us(fn, calls):8.2f} us", flush=True)
        print(f"{nbytes:>8} B  {'aall_reduce':<20} {asyncio.run(awaited_us(comm, x, calls)):8.2f} us", flush=True)
    comm.close()


if __name__ == "__main__":
    main()

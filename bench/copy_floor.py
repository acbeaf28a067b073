"""Memory-copy floor of a host: P processes, each copying its own S-byte buffer into another
(np.copyto, both buffers touched first), all at once after a barrier. Prints per process and
aggregate bandwidth, counting read + write bytes (a copy of S moves 2S through memory, not
counting the write-allocate read), so that a collective's minimum traffic can be divided by
it: e.g. an all_reduce of S over n ranks must at least read every input and write every
output once, n * 2S bytes.

    python3 bench/copy_floor.py [-p 16 64] [-s 16M] [-k 20]
"""
import argparse
import multiprocessing as mp
import time

import numpy as np


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _worker(size: int, iters: int, barrier, out) -> None:
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    np.copyto(dst, src)  # warm: pages faulted in
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(iters):
        np.copyto(dst, src)
    out.put(time.perf_counter() - t0)


def run(procs: int, size: int, iters: int) -> tuple:
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(size, iters, barrier, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    times = [out.get() for _ in ps]
    for p in ps:
        p.join()
    slowest = max(times)
    per_proc = 2 * size * iters / slowest / 1e9
    return per_proc, per_proc * procs, slowest / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", type=int, nargs="+", default=[16, 64], help="process counts")
    ap.add_argument("-s", type=_size, default=16 << 20, help="bytes per buffer")
    ap.add_argument("-k", type=int, default=20, help="copies per process")
    a = ap.parse_args()
    for procs in a.p:
        per, total, t = run(procs, a.s, a.k)
        print(f"copy floor: {procs} processes x {a.s >> 20} MiB: {t * 1e6:.0f} us per copy (slowest), "
              f"{per:.1f} GB/s each, {total:.1f} GB/s together (read + write bytes)")


if __name__ == "__main__":
    main()

"""Time 2-rank transfers whose buffers sit at chosen offsets within a page (csrc/core/copy.h:
a copy whose destination is 1-31 bytes past its source modulo 4 KiB runs several times slower
through the string copy). Rank 1's buffer is placed `d` bytes further into its page than rank
0's; prints microseconds per call for send/recv and out-of-place broadcast, per size and d.

    linkwise launch -n 2 bench/alias_placement.py [-n ITERS]
"""
import argparse
import time

import numpy as np

import linkwise


def placed(nbytes: int, offset: int) -> np.ndarray:
    raw = np.ones(nbytes + 8192, np.uint8)
    start = (offset - raw.ctypes.data) % 4096
    return raw[start:start + nbytes]


def timed(comm, fn, iters: int) -> float:
    for _ in range(3):
        fn()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    comm.barrier()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=20)
    args = ap.parse_args()
    comm = linkwise.init()
    me = comm.rank
    for nbytes in (256 << 10, 8 << 20):
        row = []
        for d in (0, 16, 48, 64):
            buf = placed(nbytes, d if me == 1 else 0)
            src = placed(nbytes, 0)  # the root's x, out of place (rank 1 reads it into buf)

            def sendrecv():
                if me == 0:
                    comm.send(buf, 1)
                else:
                    comm.recv(buf, 0)
            t_p2p = timed(comm, sendrecv, args.n)
            t_bc = timed(comm, lambda: comm.broadcast(src if me == 0 else buf, 0, out=buf), args.n)
            row.append(f"d={d}: p2p {t_p2p:7.0f} bcast-out {t_bc:7.0f}")
        if me == 0:
            print(f"{nbytes:>9} B  " + " | ".join(row), flush=True)
    comm.close()


if __name__ == "__main__":
    main()

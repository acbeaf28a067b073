"""Two-rank exchange (an irecv, a send and a wait on every rank, as the sendrecv bench did
before comm.sendrecv), page-aligned buffers: the mean time of one exchange over 200 calls,
three times per size, on rank 0. For A/B runs of the engine between two builds.
    linkwise launch -n 2 bench/p2p_exchange.py SIZES..."""
import sys
import time

import numpy as np

import linkwise


def page_aligned(a):  # here, not from linkwise.bench: earlier trees run this script too
    buf = np.empty(a.nbytes + 4096, np.uint8)
    start = (-buf.ctypes.data) % 4096
    out = buf[start:start + a.nbytes].view(a.dtype)
    out[...] = a
    return out

comm = linkwise.init()
nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
for size in [int(s) for s in sys.argv[1:]]:
    x, y = page_aligned(np.ones(size, np.uint8)), page_aligned(np.zeros(size, np.uint8))

    def exchange():
        r = comm.irecv(y, prv)
        comm.send(x, nxt)
        r.wait()
    means = []
    for _ in range(3):
        for _ in range(20):
            exchange()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            exchange()
        means.append((time.perf_counter() - t0) / 200 * 1e6)
    if comm.rank == 0:
        print(f"exchange {size:>9} B: " + " ".join(f"{m:8.1f}" for m in means) + " us", flush=True)

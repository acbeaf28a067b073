"""Two or more ranks pass a NumPy array around a ring, then time an 8-byte ping-pong.

    linkwise launch -n 2 examples/pingpong.py
"""
import time

import numpy as np

import linkwise

comm = linkwise.init()
nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
x = np.full(1 << 20, comm.rank, dtype=np.float32)
y = np.empty_like(x)
req = comm.irecv(y, prv)
comm.send(x, nxt)
req.wait()
assert (y == prv).all()
print(f"rank {comm.rank}: got 4 MiB from rank {prv} over {comm.link(prv) if comm.size > 1 else 'loopback'}")

if comm.size >= 2 and comm.rank < 2:
    peer = 1 - comm.rank
    msg = np.zeros(1, np.float64)
    for rounds, timed in ((1000, False), (20000, True)):
        t0 = time.perf_counter()
        for _ in range(rounds):
            if comm.rank == 0:
                comm.send(msg, peer)
                comm.recv(msg, peer)
            else:
                comm.recv(msg, peer)
                comm.send(msg, peer)
        if timed and comm.rank == 0:
            print(f"8-byte one-way latency: {(time.perf_counter() - t0) / rounds / 2 * 1e6:.2f} us")

"""linkwise.wait_all against a loop of wait()s, alternated in one process pair (no target):
each of 10 rounds times 300 windows of 64 8-byte isends (rank 0) / irecvs (rank 1) with each
way of waiting, the order swapped every round; prints the µs a message of every round and the
medians.
    linkwise launch -n 2 bench/wait_all_ab.py
"""
import time

import numpy as np

import linkwise

comm = linkwise.init()
r = comm.rank
W, R = 64, 300
bufs = [np.zeros(2, np.float32) for _ in range(W)]
ack = np.zeros(1, np.uint8)


def loop(reqs):
    for q in reqs:
        q.wait()


def window(wait):
    if r == 0:
        wait([comm.isend(b, 1) for b in bufs])
        wait([comm.irecv(ack, 1)])
    else:
        wait([comm.irecv(b, 0) for b in bufs])
        wait([comm.isend(ack, 0)])


for _ in range(30):
    window(loop)
ways = (("loop", loop), ("wait_all", linkwise.wait_all))
results = {name: [] for name, _ in ways}
for i in range(10):
    for name, wait in (ways if i % 2 == 0 else ways[::-1]):
        comm.barrier()
        t = time.perf_counter()
        for _ in range(R):
            window(wait)
        results[name].append((time.perf_counter() - t) / (R * W) * 1e6)
if r == 0:
    for name, v in results.items():
        print(name, " ".join(f"{x:.2f}" for x in v), "median", f"{np.median(v):.2f}")

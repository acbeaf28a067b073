"""8-byte message rate, linkwise against Open MPI (no target): rank 0 posts a window of `W`
isends to rank 1, which posts as many irecvs; both wait for all, then rank 1 acknowledges with
one message. Prints the µs per message of five timed runs of `R` windows. Run under both
launchers, one after the other:
    linkwise launch -n 2 bench/message_rate.py lw
    linkwise launch -n 2 bench/message_rate.py raw    # the native posts, without comm.isend's checks
    linkwise launch -n 2 bench/message_rate.py loop   # comm.isend / irecv, a wait() each (no wait_all)
    mpirun -n 2 --allow-run-as-root python bench/message_rate.py mpi
"""
import sys
import time

import numpy as np

mode = sys.argv[1]
W, R = 64, 300
if mode in ("lw", "raw", "loop"):
    import linkwise
    comm = linkwise.init()
    r = comm.rank
    nat = comm._native

    def isend(b, d):
        return nat.isend(b, d, 0, False, comm.timeout) if mode == "raw" else comm.isend(b, d, 0)

    def irecv(b, s):
        return nat.irecv(b, s, 0, False, comm.timeout) if mode == "raw" else comm.irecv(b, s, 0)

    def waitall(reqs):
        if mode == "loop":
            for q in reqs:
                q.wait()
        else:
            linkwise.wait_all(reqs)  # as MPI.Request.Waitall below
    bar = comm.barrier
else:
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    r = c.Get_rank()

    def isend(b, d):
        return c.Isend(b, d, 0)

    def irecv(b, s):
        return c.Irecv(b, s, 0)
    waitall = MPI.Request.Waitall
    bar = c.Barrier
bufs = [np.zeros(2, np.float32) for _ in range(W)]
ack = np.zeros(1, np.uint8)


def window():
    if r == 0:
        waitall([isend(b, 1) for b in bufs])
        waitall([irecv(ack, 1)])
    else:
        waitall([irecv(b, 0) for b in bufs])
        waitall([isend(ack, 0)])


for _ in range(30):
    window()
runs = []
for _ in range(5):
    bar()
    t = time.perf_counter()
    for _ in range(R):
        window()
    runs.append((time.perf_counter() - t) / (R * W) * 1e6)
if r == 0:
    print(mode, "us per message:", " ".join(f"{x:.2f}" for x in runs))

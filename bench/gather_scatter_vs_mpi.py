"""gather and scatter against Open MPI (mpi4py), and linkwise's executor against its
point-to-point path; neither collective has a target. Run the same script under both
launchers, one after the other:
    linkwise launch -n 2 bench/gather_scatter_vs_mpi.py lw [sizes...]
    mpirun -n 2 --allow-run-as-root python bench/gather_scatter_vs_mpi.py mpi [sizes...]
    linkwise launch -n 2 bench/gather_scatter_vs_mpi.py ab [sizes...]
lw / mpi print, per collective and size (x's bytes per rank; default 8 B-256 KiB), the mean
time of one call (µs) on the root (rank 0) and the slowest rank's mean, root 0, out= given,
float32. (A scatter's root and a gather's non-roots may return before the data has landed
elsewhere: the slowest rank's time is the one to compare.) ab alternates the executor and the
point-to-point path (LINKWISE_ALGO=ring, read per call) five times in one process and prints
the medians of the slowest rank's means, and every value."""
import os
import sys
import time

import numpy as np

mode = sys.argv[1]
sizes = [int(s) for s in sys.argv[2:]] or [8, 512, 4096, 32768, 262144]
if mode in ("lw", "ab"):
    import linkwise
    comm = linkwise.init()
    rank, n = comm.rank, comm.size
    def gather(x, out): comm.gather(x, root=0, out=out if rank == 0 else None)
    def scatter(x, out): comm.scatter(x if rank == 0 else None, root=0, out=out)
    bar = comm.barrier
    def slowest(t): return float(comm.all_reduce(np.array([t]), op="max")[0])
else:
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    rank, n = c.Get_rank(), c.Get_size()
    def gather(x, out): c.Gather(x, out if rank == 0 else None, root=0)
    def scatter(x, out): c.Scatter(x if rank == 0 else None, out, root=0)
    bar = c.Barrier
    def slowest(t): return c.allreduce(t, op=MPI.MAX)


def timed(f, s):
    """(root's, slowest rank's) mean µs a call of f at s bytes a rank."""
    cnt = s // 4
    if f is gather:
        x, out = np.ones(cnt, np.float32), np.zeros(cnt * n, np.float32)
    else:
        x, out = np.ones(cnt * n, np.float32), np.zeros(cnt, np.float32)
    iters = 2000 if s <= 32768 else max(10, min(200, (64 << 20) // (s * n)))
    for _ in range(max(3, iters // 40)):
        f(x, out)
    bar()
    t = time.perf_counter()
    for _ in range(iters):
        f(x, out)
    dt = (time.perf_counter() - t) / iters * 1e6
    worst = slowest(dt)
    bar()
    return dt, worst


def point_to_point(f, s):
    os.environ["LINKWISE_ALGO"] = "ring"
    try:
        return timed(f, s)
    finally:
        del os.environ["LINKWISE_ALGO"]


for name, f in [("gather", gather), ("scatter", scatter)]:
    for s in sizes:
        if mode != "ab":
            dt, worst = timed(f, s)
            if rank == 0:
                print(f"{mode} {name} {s} {dt:.2f} {worst:.2f}", flush=True)
            continue
        ex, p2p = [], []
        for _ in range(5):
            ex.append(timed(f, s)[1])
            p2p.append(point_to_point(f, s)[1])
        if rank == 0:
            a, b = np.median(ex), np.median(p2p)
            print(f"{name} {s:>9} n={n} executor {a:9.1f} p2p {b:9.1f} p2p/executor {b / a:.2f}   "
                  f"executor {' '.join(f'{v:.0f}' for v in ex)} | p2p {' '.join(f'{v:.0f}' for v in p2p)}", flush=True)

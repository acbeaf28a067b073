"""Small gather and scatter against Open MPI (mpi4py), 2-core VM; neither has a target. Run
the same script under both launchers, one after the other:
    linkwise launch -n 2 bench/gather_scatter_vs_mpi.py lw
    mpirun -n 2 --allow-run-as-root python bench/gather_scatter_vs_mpi.py mpi
Prints the mean time of one call (µs) on rank 0 per collective and size (x's bytes per rank),
root 0, out= given on the root, float32."""
import sys, time, numpy as np
mode = sys.argv[1]
sizes = [8, 512, 4096, 32768, 262144]
if mode == "lw":
    import linkwise
    comm = linkwise.init(); rank, n = comm.rank, comm.size
    def gather(x, out): comm.gather(x, root=0, out=out if rank == 0 else None)
    def scatter(x, out): comm.scatter(x if rank == 0 else None, root=0, out=out)
    bar = comm.barrier
else:
    from mpi4py import MPI
    c = MPI.COMM_WORLD; rank, n = c.Get_rank(), c.Get_size()
    def gather(x, out): c.Gather(x, out if rank == 0 else None, root=0)
    def scatter(x, out): c.Scatter(x if rank == 0 else None, out, root=0)
    bar = c.Barrier
for name, f in [("gather", gather), ("scatter", scatter)]:
    for s in sizes:
        cnt = s // 4
        if name == "gather":
            x = np.ones(cnt, np.float32); out = np.zeros(cnt * n, np.float32)
        else:
            x = np.ones(cnt * n, np.float32); out = np.zeros(cnt, np.float32)
        iters = 2000 if s <= 32768 else 200
        for _ in range(50): f(x, out)
        bar(); t = time.perf_counter()
        for _ in range(iters): f(x, out)
        dt = (time.perf_counter() - t) / iters * 1e6
        bar()
        if rank == 0: print(f"{mode} {name} {s} {dt:.2f}")

"""Host-side cost of a registered receive (8 MiB) whose sender's description has already
arrived, from the irecv call until the copy is enqueued: a3678cb's path (enqueued by recv on
the caller's thread) against the deferred receives (docs/benchmarks.md, thirty-fifth session).
"idle": the caller polls in a tight Python loop; "busy": it runs pure Python for 20 ms (GIL
held). Run: linkwise launch -n 2 python bench/gpu_recv_handoff.py LABEL (one GPU will do);
rank 1 prints medians in microseconds."""
import statistics, sys, time
import torch, linkwise
from linkwise.cuda import gpu_comm
comm = linkwise.init(); g = gpu_comm(comm); torch.cuda.set_device(g.device)
n = (8 << 20) // 4
x = torch.full((n,), 1.0, device="cuda"); y = torch.zeros(n, device="cuda")
s = torch.cuda.Stream(); torch.cuda.synchronize()
res = {"idle": [], "busy": []}
for mode in ("idle", "busy"):
    for i in range(40):
        if comm.rank == 0:
            comm.send(x, 1); comm.barrier(); torch.cuda.synchronize(); comm.barrier()
            continue
        comm.barrier()  # the description is here now
        time.sleep(0.002)
        t0 = time.perf_counter()
        rq = comm.irecv(y, 0, stream=s)
        d = getattr(g, "_deferred", None)
        if mode == "idle":
            while d is not None and d.busy(0):
                pass
            t = time.perf_counter() - t0
        else:  # pure Python for 20 ms, noting when the helper was done
            t = None
            while time.perf_counter() - t0 < 0.02:
                if t is None and (d is None or not d.busy(0)):
                    t = time.perf_counter() - t0
                sum(range(200))
        res[mode].append(t * 1e6)
        rq.wait(); torch.cuda.synchronize(); comm.barrier()
if comm.rank == 1:
    tree = sys.argv[1] if len(sys.argv) > 1 else "?"
    for mode, v in res.items():
        v = v[5:]
        print(f"{tree} {mode}: median {statistics.median(v):.0f} us, p90 {sorted(v)[int(0.9*len(v))]:.0f} us, max {max(v):.0f} us", flush=True)
comm.close()

"""How late a deferred GPU receive's copy starts while its caller runs pure Python
(docs/benchmarks.md, thirty-sixth session): rank 0 posts irecv (8 MiB, so the receive is
deferred: the sender has not sent) and then runs Python for 80 ms holding the GIL; rank 1
sends 10 ms later. Both ranks stamp the GPU's %globaltimer on their streams, rank 1 just before
its send and rank 0 just after its receive, so the gap is sender-ready to data-in on the device.
The ranks must share one GPU (one clock): run `linkwise launch -n 2 python bench/gpu_deferred_gil.py
LABEL [SWITCH_S]` on a one-GPU machine. SWITCH_S sets sys.setswitchinterval (default 0.005).
Rank 0 prints the median / p90 / max gap in microseconds."""
import statistics
import sys
import time

import cupy as cp
import numpy as np

import linkwise
from linkwise.cuda import gpu_comm

STAMP = cp.RawKernel(r"""
extern "C" __global__ void stamp(unsigned long long* out, int i) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  out[i] = t;
}""", "stamp")

comm = linkwise.init()
g = gpu_comm(comm)
cp.cuda.Device(g.device).use()
label = sys.argv[1] if len(sys.argv) > 1 else "?"
sys.setswitchinterval(float(sys.argv[2]) if len(sys.argv) > 2 else 0.005)
n, iters, warm = (8 << 20) // 4, 30, 5
x = cp.ones(n, cp.float32)
stamps = cp.zeros(iters, cp.uint64)
s = cp.cuda.Stream(non_blocking=True)
STAMP((1,), (1,), (stamps, np.int32(0)), stream=s)  # loaded now: a first load behind the
cp.cuda.Device().synchronize()                      # receive's device wait would hang (README)
for i in range(iters):
    comm.barrier()
    if comm.rank == 0:
        rq = comm.irecv(x, 1, stream=s.ptr)
        STAMP((1,), (1,), (stamps, np.int32(i)), stream=s)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.08:  # pure Python, GIL held but for switch intervals
            sum(range(100))
        rq.wait()
    else:
        time.sleep(0.01)
        STAMP((1,), (1,), (stamps, np.int32(i)), stream=s)
        comm.send(x, 0, stream=s.ptr)
    s.synchronize()
mine = cp.asnumpy(stamps).astype(np.int64)
if comm.rank == 1:
    comm.send(mine, 0)
else:
    theirs = np.empty_like(mine)
    comm.recv(theirs, 1)
    gaps = ((mine - theirs)[warm:] / 1e3).tolist()
    gaps.sort()
    print(f"{label} switch {sys.getswitchinterval()} s: sender stamp to data in: median {statistics.median(gaps):.0f} us, "
          f"p90 {gaps[int(0.9 * len(gaps))]:.0f} us, max {gaps[-1]:.0f} us, min {gaps[0]:.0f} us", flush=True)
comm.close()

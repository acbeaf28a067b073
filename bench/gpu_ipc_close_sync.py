"""Does closing (or opening) a CUDA IPC mapping wait for work still running on the device?

Why it matters: linkwise's deferred receives leave a kernel spinning on the caller's stream
until a helper thread enqueues the copy, and the collectives' kernels spin until peers arrive.
If cudaIpcCloseMemHandle synchronises the device, a close made while such a kernel waits for
this process's own later work never returns (docs/benchmarks.md, thirty-seventh session).

Two processes: the exporter allocates buffers on its GPU and sends their IPC handles; the
importer (on the other GPU when there are two, else the same one) maps one, starts a kernel
that spins for SPIN seconds on a non-blocking stream, then times, while it spins:
  open   - cudaIpcOpenMemHandle of a second buffer,
  close  - cudaIpcCloseMemHandle of the first,
  launch - from another thread, while close runs: a small kernel launch on a third stream
           (and whether that kernel ran before the spinning one ended, or was held back),
  open2  - from that thread, after the launch: cudaIpcOpenMemHandle of a third buffer,
  copy   - then a cudaMemcpyAsync from the second mapping (cudaMemcpyDefault) on that stream,
  export - then cudaIpcGetMemHandle of a buffer of the importer's own,
  record - then cudaEventRecord on that stream,
  malloc - then cudaMalloc of 64 MiB.
A call that takes about SPIN seconds waited for the spinning kernel.

Run: python3 bench/gpu_ipc_close_sync.py   (needs cupy and one or two GPUs)
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time

SPIN = 1.5
NBYTES = 64 << 20

SPIN_SRC = r"""
extern "C" __global__ void spin(unsigned long long ns, unsigned long long* end) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  if (end) *end = t;  // when it ended (or, with ns 0, when it ran)
}
"""


def exporter(conn, device: int) -> None:
    import cupy as cp
    cp.cuda.Device(device).use()
    bufs = [cp.cuda.alloc(NBYTES) for _ in range(3)]
    conn.send([cp.cuda.runtime.ipcGetMemHandle(b.ptr) for b in bufs])
    conn.recv()  # the importer is done with them


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def importer(conn, device: int, out) -> None:
    import cupy as cp
    rt = cp.cuda.runtime
    cp.cuda.Device(device).use()
    spin = cp.RawKernel(SPIN_SRC, "spin")
    busy, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    stamps = cp.zeros(2, cp.uint64)  # [when the long spin ended, when the kernel launched meanwhile ran]
    null = cp.uint64(0)
    spin((1,), (1,), (cp.uint64(0), null), stream=other)  # loaded and warm before anything spins
    other.synchronize()
    handles = conn.recv()
    first = rt.ipcOpenMemHandle(handles[0], rt.cudaIpcMemLazyEnablePeerAccess)
    idle_close_open = {}
    second = None

    def spinning() -> None:
        spin((1,), (1,), (cp.uint64(int(SPIN * 1e9)), stamps.data.ptr), stream=busy)
        time.sleep(0.05)  # it runs

    spinning()
    idle_close_open["open"] = timed(lambda: idle_close_open.setdefault(
        "ptr", rt.ipcOpenMemHandle(handles[1], rt.cudaIpcMemLazyEnablePeerAccess)))
    second = idle_close_open.pop("ptr")
    busy.synchronize()

    spinning()
    launched = []

    def launch_meanwhile() -> None:
        time.sleep(0.1)  # close has started
        launched.append(timed(lambda: spin((1,), (1,), (cp.uint64(0), stamps.data.ptr + 8), stream=other)))
        got = []
        launched.append(timed(lambda: got.append(rt.ipcOpenMemHandle(handles[2], rt.cudaIpcMemLazyEnablePeerAccess))))
        launched.append(got[0])
        local = cp.cuda.alloc(1 << 20)
        launched.append(timed(lambda: rt.memcpyAsync(local.ptr, second, 1 << 20, rt.memcpyDefault, other.ptr)))
        launched.append(timed(lambda: rt.ipcGetMemHandle(local.ptr)))
        ev = cp.cuda.Event()
        launched.append(timed(lambda: ev.record(other)))
        mem = []
        launched.append(timed(lambda: mem.append(rt.malloc(64 << 20))))
        rt.free(mem[0])
    t = threading.Thread(target=launch_meanwhile)
    t.start()
    idle_close_open["close"] = timed(lambda: rt.ipcCloseMemHandle(first))
    t.join()
    (idle_close_open["launch"], idle_close_open["open2"], third, idle_close_open["copy"],
     idle_close_open["export"], idle_close_open["record"], idle_close_open["malloc"]) = launched
    busy.synchronize()
    other.synchronize()
    ended, ran = (int(v) for v in stamps.get())
    idle_close_open["held_back"] = ran > ended  # the kernel launched during the close ran only after it
    rt.ipcCloseMemHandle(third)
    busy.synchronize()
    idle_close_open["close_idle"] = timed(lambda: rt.ipcCloseMemHandle(second))
    conn.send("done")
    out.put(idle_close_open)


def main() -> None:
    import cupy as cp
    ndev = cp.cuda.runtime.getDeviceCount()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    q = ctx.Queue()
    pe = ctx.Process(target=exporter, args=(a, 0))
    pi = ctx.Process(target=importer, args=(b, 1 if ndev > 1 else 0, q))
    pe.start(), pi.start()
    res = q.get(timeout=60)
    pe.join(30), pi.join(30)
    where = "peer GPU (exporter GPU 0, importer GPU 1)" if ndev > 1 else "same GPU (both on GPU 0)"
    print(f"INFO {where}; a kernel spins {SPIN} s on the importer's device")
    for k in ("open", "close", "launch", "open2", "copy", "export", "record", "malloc", "close_idle"):
        waited = res[k] > 0.5 * SPIN
        print(f"INFO {k:10s} {res[k] * 1e3:9.2f} ms {'(waited for the spinning kernel)' if waited else ''}")
    print(f"INFO a kernel launched from another thread during the close ran "
          f"{'only after the spinning kernel ended (held back)' if res['held_back'] else 'while the close waited'}")
    print("PASS measured")


if __name__ == "__main__":
    main()

"""Host-staged GPU send/recv (LINKWISE_P2P_DISABLE=1) vs a plain pinned device->host copy.

    python bench/staged_bw.py [--bytes 268435456] [--chunks 1M,4M,16M]

Two processes (GPU 0 sends to GPU 1 through pinned host buffers and the CPU engine); the time
is wall-clock per message on the receiver (the staged calls block the host until done), best
of 5 after one warm-up. The reference is torch's copy of the same bytes from GPU 0 into a
pinned host tensor, timed with CUDA events. Target (issue 4): staged >= 70% of that.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, nbytes, chunk, q):
    os.environ.update(LINKWISE_RANK=str(rank), LINKWISE_SIZE="2", LINKWISE_LOCAL_RANK=str(rank),
                      LINKWISE_LOCAL_SIZE="2", LINKWISE_MASTER_ADDR="127.0.0.1",
                      LINKWISE_MASTER_PORT=str(port), LINKWISE_P2P_DISABLE="1",
                      LINKWISE_CHUNK_SIZE=str(chunk))
    import torch
    import linkwise
    torch.cuda.set_device(rank)
    comm = linkwise.init()
    g = comm.cuda()
    x = torch.ones(nbytes // 4, device="cuda") * (rank + 1)
    best = 1e9
    for it in range(6):
        torch.cuda.synchronize()
        comm.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            g.send(x, 1)
        else:
            g.recv(x, 0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if it:
            best = min(best, dt)
    ok = bool((x == 1).all().item())
    if rank == 1:
        q.put((best, ok))
    comm.barrier()
    g.close()
    comm.close()


def d2h_rate(nbytes: int) -> float:
    import torch
    x = torch.ones(nbytes // 4, device="cuda:0")
    h = torch.empty(nbytes // 4, pin_memory=True)
    best = 1e9
    for it in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        h.copy_(x, non_blocking=True)
        b.record()
        b.synchronize()
        if it:
            best = min(best, a.elapsed_time(b) * 1e-3)
    return nbytes / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument("--chunks", default="1M,4M,16M")
    a = ap.parse_args(argv)
    import torch.multiprocessing as mp
    ref = d2h_rate(a.bytes)
    print(f"pinned device->host copy: {ref:.1f} GB/s ({a.bytes >> 20} MiB)")
    ctx = mp.get_context("spawn")
    for c in a.chunks.split(","):
        chunk = int(c[:-1]) << (20 if c.endswith("M") else 10) if c[-1] in "MK" else int(c)
        q = ctx.Queue()
        port = _port()
        ps = [ctx.Process(target=_worker, args=(r, port, a.bytes, chunk, q)) for r in range(2)]
        for p in ps:
            p.start()
        best, ok = q.get(timeout=240)
        for p in ps:
            p.join()
        bw = a.bytes / best / 1e9
        print(f"staged send/recv chunk {c}: {bw:.1f} GB/s = {100 * bw / ref:.0f}% of the D2H copy; "
              f"data {'correct' if ok else 'WRONG'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

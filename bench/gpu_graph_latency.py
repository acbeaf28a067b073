"""Small all_reduce / broadcast captured in CUDA graphs: linkwise vs NCCL, same run.

    python bench/gpu_graph_latency.py [--ranks 4] [--sizes 8,1K,32K,256K] [--ops 50]

One process per GPU (spawn). For each system, op and size: `--ops` back-to-back calls are
captured into one torch.cuda.graph (after eager warm-up), the graph is replayed 3 times to
warm up and then `--reps` times between two CUDA events; time per op = elapsed / (reps * ops).
A row is the slowest rank's time. NCCL goes through torch.distributed (capture of NCCL
collectives in a torch graph). ratio = linkwise / NCCL (< 1: linkwise faster).
"""
from __future__ import annotations

import argparse
import os
import socket
import struct
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _size(s: str) -> int:
    m = {"K": 1 << 10, "M": 1 << 20}
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)


def _replayed_us(torch, fn, ops: int, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * ops)


def _worker(rank, n, ports, sizes, ops, reps, q):
    os.environ.update(LINKWISE_RANK=str(rank), LINKWISE_SIZE=str(n), LINKWISE_LOCAL_RANK=str(rank),
                      LINKWISE_LOCAL_SIZE=str(n), LINKWISE_MASTER_ADDR="127.0.0.1",
                      LINKWISE_MASTER_PORT=str(ports[0]))
    import torch
    import torch.distributed as dist
    import linkwise
    from linkwise.cuda import gpu_comm
    torch.cuda.set_device(rank)
    comm = linkwise.init()
    g = gpu_comm(comm)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank,
                            world_size=n, device_id=torch.device("cuda", rank))
    tick = [0]

    def slowest(us):
        tick[0] += 1
        vals = comm._store.all_gather(f"gbench/{tick[0]}", rank, n, struct.pack("d", us))
        return max(struct.unpack("d", v)[0] for v in vals)

    for op in ("all_reduce", "broadcast"):
        for size in sizes:
            x = torch.randn(max(1, size // 4), device="cuda")
            if op == "all_reduce":
                lw = _replayed_us(torch, lambda: g.all_reduce(x), ops, reps)
                nc = _replayed_us(torch, lambda: dist.all_reduce(x), ops, reps)
            else:
                lw = _replayed_us(torch, lambda: g.broadcast(x, root=0), ops, reps)
                nc = _replayed_us(torch, lambda: dist.broadcast(x, src=0), ops, reps)
            lw, nc = slowest(lw), slowest(nc)
            if rank == 0:
                q.put(f"{op:<11} {size:>9} B  linkwise {lw:7.2f} us  NCCL {nc:7.2f} us  "
                      f"ratio {lw / nc:5.2f}")
    dist.barrier()
    dist.destroy_process_group()
    g.close()
    comm.close()
    if rank == 0:
        q.put(None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sizes", default="8,1K,32K,256K")
    ap.add_argument("--ops", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = (_port(), _port())
    sizes = [_size(s) for s in a.sizes.split(",")]
    print(f"CUDA graphs: {a.ops} ops captured per graph, {a.reps} timed replays, {a.ranks} ranks")
    ps = [ctx.Process(target=_worker, args=(r, a.ranks, ports, sizes, a.ops, a.reps, q))
          for r in range(a.ranks)]
    for p in ps:
        p.start()
    while True:
        line = q.get(timeout=200)
        if line is None:
            break
        print(line, flush=True)
    for p in ps:
        p.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())

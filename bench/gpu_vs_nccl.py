"""linkwise GPU collectives vs NCCL (torch.distributed), same sweep, same run, same timing.

    python bench/gpu_vs_nccl.py [--ranks 4] [--ops all_reduce,broadcast,...] [--json out.json]

One process per GPU (torch.multiprocessing, spawn). Timing: on every rank, CUDA events
recorded on the current stream around `iters` back-to-back operations after warm-up; no CUDA
graphs. A row's time is the slowest rank's mean time per operation. busbw follows nccl-tests:
all_reduce 2(n-1)/n * S/t, all_gather and reduce_scatter (n-1)/n * S/t (S = the full buffer),
broadcast and send/recv S/t. ratio = linkwise time / NCCL time (< 1: linkwise faster).
send/recv runs rank 0 -> rank 1 only; "peer copy" is torch's cross-device copy (the copy
engine, cudaMemcpyPeerAsync) between GPU 0 and 1, timed the same way.
Keep NCCL_NVLS_ENABLE=0 (set below if absent): NVLink multicast must stay off here.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

SIZES = [8, 64, 1 << 10, 8 << 10, 32 << 10, 256 << 10, 1 << 20, 2 << 20, 16 << 20, 64 << 20,
         128 << 20, 512 << 20]
OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "sendrecv", "all_reduce_1shot",
       "all_reduce_2shot"]
BUSBW = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "sendrecv": lambda n: 1.0}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _iters(nbytes: int) -> tuple[int, int]:
    it = max(10, min(200, int(4e8 / max(nbytes, 1))))
    return it, max(3, it // 10)


def _time(torch, fn, nbytes: int) -> float:
    iters, warm = _iters(nbytes)
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / iters  # microseconds


def _worker(rank: int, n: int, ports: tuple, ops: list, sizes: list, jsonpath: str) -> None:
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
    rows = []

    def slowest(us: float) -> float:
        vals = comm._store.all_gather(f"bench/{_tick()}", rank, n, struct.pack("d", us))
        return max(struct.unpack("d", v)[0] for v in vals)

    for op in ops:
        for size in sizes:
            count = max(n, size // 4) // n * n
            nbytes = count * 4
            x = torch.randn(count, device="cuda")
            lw = nc = None
            if op.startswith("all_reduce"):
                algo = {"all_reduce": "auto", "all_reduce_1shot": "oneshot", "all_reduce_2shot": "twoshot"}[op]
                if algo == "oneshot" and nbytes > g.slot_bytes:
                    continue
                lw = _time(torch, lambda: g.all_reduce(x, algo=algo), nbytes)
                if op == "all_reduce":
                    nc = _time(torch, lambda: dist.all_reduce(x), nbytes)
            elif op == "broadcast":
                lw = _time(torch, lambda: g.broadcast(x, root=0), nbytes)
                nc = _time(torch, lambda: dist.broadcast(x, src=0), nbytes)
            elif op == "all_gather":
                part = x[: count // n]
                lw = _time(torch, lambda: g.all_gather(part, x), nbytes)
                nc = _time(torch, lambda: dist.all_gather_into_tensor(x, part), nbytes)
            elif op == "reduce_scatter":
                out = torch.empty(count // n, device="cuda")
                lw = _time(torch, lambda: g.reduce_scatter(x, out), nbytes)
                nc = _time(torch, lambda: dist.reduce_scatter_tensor(out, x), nbytes)
            elif op == "sendrecv":
                if rank == 0:
                    lw = _time(torch, lambda: g.send(x, 1), nbytes)
                    nc = _time(torch, lambda: dist.send(x, 1), nbytes)
                elif rank == 1:
                    lw = _time(torch, lambda: g.recv(x, 0), nbytes)
                    nc = _time(torch, lambda: dist.recv(x, 0), nbytes)
                else:
                    lw = nc = 0.0
                if size >= (1 << 20):
                    y = torch.empty(count, device="cuda:1") if rank == 0 else None
                    pc = _time(torch, lambda: y.copy_(x, non_blocking=True), nbytes) if rank == 0 else 0.0
                    pc = slowest(pc)
                    if rank == 0:
                        rows.append({"op": "peer copy", "bytes": nbytes, "linkwise_us": None,
                                     "nccl_us": None, "copy_us": pc, "copy_GBps": nbytes / pc / 1e3})
            lw = slowest(lw)
            nc = slowest(nc) if nc is not None else None
            f = BUSBW.get(op.replace("_1shot", "").replace("_2shot", ""), lambda n: 1.0)(n)
            row = {"op": op, "bytes": nbytes, "linkwise_us": lw, "nccl_us": nc,
                   "linkwise_busbw": f * nbytes / lw / 1e3, "nccl_busbw": f * nbytes / nc / 1e3 if nc else None,
                   "ratio": lw / nc if nc else None}
            rows.append(row)
            if rank == 0:
                print(_fmt(row), flush=True)
    if rank == 0 and jsonpath:
        with open(jsonpath, "w") as fh:
            json.dump({"ranks": n, "cuda_graphs": False, "rows": rows}, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    g.close()
    comm.close()


_ticks = [0]


def _tick() -> int:
    _ticks[0] += 1
    return _ticks[0]


def _human(b: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << k:
            return f"{b / (1 << k):g} {unit}"
    return f"{b} B"


def _fmt(r: dict) -> str:
    if r["op"] == "peer copy":
        return f"| peer copy (cudaMemcpyPeer) | {_human(r['bytes'])} | {r['copy_us']:.1f} | | {r['copy_GBps']:.1f} | | |"
    nc = f"{r['nccl_us']:.1f}" if r["nccl_us"] else "-"
    nb = f"{r['nccl_busbw']:.1f}" if r["nccl_busbw"] else "-"
    ra = f"{r['ratio']:.2f}" if r["ratio"] else "-"
    return (f"| {r['op']} | {_human(r['bytes'])} | {r['linkwise_us']:.1f} | {nc} | "
            f"{r['linkwise_busbw']:.1f} | {nb} | {ra} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=0, help="default: every visible GPU")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--max-bytes", type=int, default=SIZES[-1])
    ap.add_argument("--min-bytes", type=int, default=0)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp
    n = a.ranks or torch.cuda.device_count()
    sizes = [s for s in SIZES if a.min_bytes <= s <= a.max_bytes]
    print(f"# {n} ranks, float32, CUDA events around back-to-back ops, no CUDA graphs")
    print("| op | size | linkwise us | NCCL us | linkwise busbw GB/s | NCCL busbw GB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    sys.stdout.flush()
    mp.spawn(_worker, args=(n, (_port(), _port()), a.ops.split(","), sizes, a.json), nprocs=n)
    return 0


if __name__ == "__main__":
    sys.exit(main())

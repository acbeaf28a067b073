"""Host-staged GPU all_reduce (LINKWISE_P2P_DISABLE=1) against the pinned device->host copy.

    python bench/staged_allreduce.py NRANKS MiB [MiB ...]

Forks NRANKS ranks (one GPU each). Per size, every rank at once: `reps` float32 all_reduces
through the host-staged path (timed on the host: the path blocks until done), then `reps`
device->host copies of the same bytes into pinned memory (torch, non_blocking, then one
synchronize). Prints algbw = bytes / time of the all_reduce and the copy bandwidth, rank 0's
numbers. Compare paths in one run with LINKWISE_STAGED_SHM=1 (shared pinned memory,
stage_reduce.h) and LINKWISE_STAGED_SHM=0 (through the CPU engine).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from multirank import run_ranks  # noqa: E402


def _body(comm, sizes, reps):
    import torch
    g = comm.cuda()
    torch.cuda.set_device(g.device)
    rows = []
    for mib in sizes:
        n = (mib << 20) // 4
        x = torch.ones(n, device="cuda")
        g.all_reduce(x)  # warm-up: channels, pinned buffers
        torch.cuda.synchronize()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            g.all_reduce(x)
        torch.cuda.synchronize()
        t_ar = (time.perf_counter() - t0) / reps
        h = torch.empty(n, pin_memory=True)
        h.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            h.copy_(x, non_blocking=True)
        torch.cuda.synchronize()
        t_d2h = (time.perf_counter() - t0) / reps
        rows.append((mib, t_ar, t_d2h))
    return rows


def main() -> None:
    nranks, sizes = int(sys.argv[1]), [int(a) for a in sys.argv[2:]]
    env = {"LINKWISE_P2P_DISABLE": "1"}
    rows = run_ranks(nranks, _body, sizes, 5, env=env, timeout=600)[0]
    mode = "shared pinned memory" if os.environ.get("LINKWISE_STAGED_SHM", "1") != "0" else "CPU engine"
    print(f"host-staged all_reduce, {nranks} ranks, float32, {mode}:")
    print(f"{'MiB':>6} {'all_reduce ms':>14} {'algbw GB/s':>11} {'D2H GB/s':>9} {'ratio':>6}")
    for mib, t_ar, t_d2h in rows:
        nb = mib << 20
        ar, d2h = nb / t_ar / 1e9, nb / t_d2h / 1e9
        print(f"{mib:>6} {t_ar * 1e3:>14.2f} {ar:>11.1f} {d2h:>9.1f} {ar / d2h:>6.2f}")


if __name__ == "__main__":
    main()

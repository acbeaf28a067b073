"""Host cost of eager small all_reduce / broadcast, layer by layer (issue 4, eager target).

    python3 -m linkwise.cli launch -n 4 bench/gpu_eager_host.py [--bytes 8,32768] [--json F]

For each layer: host µs per call (time.perf_counter around 1000 back-to-back calls, best of 3,
slowest rank) and the eager GPU µs per op (linkwise.bench.gpu.time_ops: CUDA events around 300
back-to-back calls on the bench stream, slowest rank). Layers:
  comm.<op> (fast)       the Communicator call, through cuda/fast.py's FastPath
  comm.<op> (general)    the same call with the fast path switched off (comm._gpu_fast = None):
                         _gpu_coll.dispatch -> GpuComm -> arrays.view -> the engine, i.e. the
                         path every call took before the fast path
  GpuComm.<op>           GpuComm's method (view, checks, stream lookup, engine call)
  engine.<op>_fast       the one native call alone, arguments precomputed (check + launch)
  torch x.add_(1)        a torch op for scale (Python dispatch + one kernel launch)
broadcast also out of place (out=): the root's kernel copies; "general" then is the previous
way, a torch copy on the root then the in-place broadcast.
"""
from __future__ import annotations

import argparse
import os
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)


def host_us(fn, torch, helper, calls: int = 1000) -> float:
    """Host µs per call of fn: perf_counter around `calls` back-to-back calls (after 50 warm-up
    calls and a barrier), best of 3, the slowest rank's. The GPU catches up between the rounds."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    helper.barrier()
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return helper.max_over_ranks(best)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", default="8,32768")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    from gpu_rank import GpuRank
    R = GpuRank(torch)
    comm, helper, g, stream, rank = R.comm, R.helper, R.g, R.stream, R.rank
    fast = comm._gpu_fast

    def gpu_us(fn) -> float:
        return R.time_us(fn, 300, 20, False)

    def measure(name, nbytes, fn, general=False):
        comm._gpu_fast = None if general else fast
        row = {"layer": name, "bytes": nbytes, "host_us": round(host_us(fn, torch, helper), 3),
               "eager_gpu_us": round(gpu_us(fn), 3)}
        comm._gpu_fast = fast
        R.say(row)

    e, s = g._engine, stream.cuda_stream
    for nbytes in (int(v) for v in a.bytes.split(",")):
        k = max(1, nbytes // 4)
        x = torch.ones(k, device="cuda")
        y = torch.ones(k, device="cuda")
        p, q = x.data_ptr(), y.data_ptr()
        measure("comm.all_reduce (fast)", nbytes, lambda: comm.all_reduce(x))
        measure("comm.all_reduce (general)", nbytes, lambda: comm.all_reduce(x), general=True)
        measure("GpuComm.all_reduce", nbytes, lambda: g.all_reduce(x))
        measure("engine.all_reduce_fast", nbytes, lambda: e.all_reduce_fast(p, p, k, 0, 0, s))
        measure("comm.all_reduce out= (fast)", nbytes, lambda: comm.all_reduce(x, out=y))
        measure("comm.broadcast (fast)", nbytes, lambda: comm.broadcast(x, 0))
        measure("comm.broadcast (general)", nbytes, lambda: comm.broadcast(x, 0), general=True)
        measure("engine.broadcast_fast", nbytes, lambda: e.broadcast_fast(p, p, 4 * k, 0, s))
        measure("comm.broadcast out= (fast, root kernel copies)", nbytes,
                lambda: comm.broadcast(x, 0, out=y))

        def old_oop():  # the previous out-of-place broadcast: copy on the root, then in place
            if rank == 0:
                y.copy_(x, non_blocking=True)
            g.broadcast(y, root=0)
        measure("broadcast out= (previous: root copy + in place)", nbytes, old_oop)
        measure("torch x.add_(1)", nbytes, lambda: x.add_(1))
        del q
    R.dump(a.json)
    torch.cuda.synchronize()
    comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

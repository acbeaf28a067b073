"""GPU tuning sweeps and the small-op cost breakdown, every rank under ``linkwise launch``:

    python3 -m linkwise.cli launch -n 4 bench/gpu_tune.py [--small] [--reduce] [--bcast] [--json F]

--small   host µs per call of each layer of a small all_reduce / broadcast (comm.<op>,
          GpuComm.<op>, the native engine call, the stream lookup, the array view), and GPU µs
          per op when 100 calls are captured in a CUDA graph (the engine alone, and a tiny
          torch kernel for the launch floor); run it with and without LINKWISE_GPU_LL_MAX=0
          to compare the LL kernels with the flag kernels.
--reduce  large all_reduce / reduce_scatter on the registered path over
          LINKWISE_GPU_REG_REDUCE_UNROLL (kernel variant) x blocks, and NCCL (torch.distributed)
          on the same tensors.
--bcast   large broadcast: scratch kernel, chain, pull scatter-allgather over
          LINKWISE_GPU_BCAST_ROUNDS, and NCCL.
--bcast-forms  registered broadcast forms against NCCL called directly (cupy), same tensors:
          chain, two-stream pull, one-kernel push over LINKWISE_GPU_BCAST_ROUNDS / _BLOCKS /
          _UNROLL, and the scratch kernel below 128 MiB; every root checked bitwise on every rank.
--pchain  registered broadcast: the push chain (bcast_chain.cu) over LINKWISE_GPU_PCHAIN_BLOCKS /
          _SLICE / LINKWISE_GPU_BCAST_UNROLL, against the copy-engine chain and NCCL called
          directly (cupy); every root checked bitwise on every rank.
--pchain-trace  per-block timestamps of the push chain's last call of 8 (gpu_tune_forms.py).
--ar-forms  large all_reduce: the one-kernel form, LINKWISE_GPU_AR_ALGO=rsag, and
          reduce_scatter + all_gather called in a row, against NCCL called directly; each
          checked bitwise against the one-kernel form's result.
--final   the >= 64 MiB comparison with default settings: linkwise (comm.<op>), NCCL through
          torch.distributed and NCCL called directly (cupy.cuda.nccl), same tensors, float32;
          busbw with nccl-tests' factors. (On-GPU inputs: the CLI sweep's NumPy inputs and
          references cost minutes per size at these sizes.)
Timing: linkwise.bench.gpu.time_ops (CUDA events on the bench stream, slowest rank).
"""
from __future__ import annotations

import argparse
import os
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--reduce", action="store_true")
    ap.add_argument("--bcast", action="store_true")
    ap.add_argument("--bcast-forms", action="store_true")
    ap.add_argument("--pchain", action="store_true")
    ap.add_argument("--ar-forms", action="store_true")
    ap.add_argument("--pchain-trace", action="store_true")
    ap.add_argument("--final", action="store_true",
                    help="large all_reduce, reduce_scatter, all_gather, broadcast with the default "
                         "settings, against nccl (torch.distributed) and nccl-cupy, float32")
    ap.add_argument("--sizes", default="64M,128M,512M")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.bcast:  # every size of the sweep may take the registered path (set per variant below)
        os.environ.setdefault("LINKWISE_GPU_BCAST_REG_MIN", str(1 << 20))
    import torch
    from gpu_rank import GpuRank
    from linkwise.bench import common
    R = GpuRank(torch, {"ll_max": os.environ.get("LINKWISE_GPU_LL_MAX", "default")})
    comm, helper, g, stream, rank, n = R.comm, R.helper, R.g, R.stream, R.rank, R.n
    say = R.say

    def t_us(fn, iters, warm=3, graph=False):
        return R.time_us(fn, iters, warm, graph)

    dist = None
    if a.reduce or a.bcast or a.final or a.bcast_forms or a.ar_forms:
        import torch.distributed as dist
        from linkwise.bench.runner import _share_port
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_share_port(helper)}",
                                rank=rank, world_size=n, device_id=torch.device("cuda", g.device))

    if a.small:
        from linkwise.cuda.arrays import torch_current_stream, view
        x = torch.ones(2, device="cuda")
        s = stream.cuda_stream
        e = g._engine
        layers = {
            "comm.all_reduce": lambda: comm.all_reduce(x),
            "GpuComm.all_reduce": lambda: g.all_reduce(x),
            "engine.all_reduce": lambda: e.all_reduce(x.data_ptr(), x.data_ptr(), 2, 0, 0, s, 0),
            "comm.broadcast": lambda: comm.broadcast(x, 0),
            "engine.broadcast": lambda: e.broadcast(x.data_ptr(), 8, 0, s),
            "torch.cuda.current_stream": lambda: torch.cuda.current_stream(g.device).cuda_stream,
            "torch_current_stream (raw)": lambda: torch_current_stream(g.device),
            "arrays.view": lambda: view(x, "x"),
            "torch x.add_(1) launch": lambda: x.add_(1),
        }
        from gpu_eager_host import host_us
        for name, fn in layers.items():
            say({"what": "host us/call", "layer": name, "us": round(host_us(fn, torch, helper, 300), 3)})
        for size in (8, 1024, 32 << 10, 256 << 10):
            y = torch.ones(max(1, size // 4), device="cuda")
            yp, k = y.data_ptr(), y.numel()
            gpu = {"engine.all_reduce": lambda: e.all_reduce(yp, yp, k, 0, 0, s, 0),
                   "engine.broadcast": lambda: e.broadcast(yp, size, 0, s),
                   "torch y.add_(1)": lambda: y.add_(1)}
            for name, fn in gpu.items():
                row = {"what": "gpu us/op", "layer": name, "bytes": size,
                       "graph": round(t_us(fn, 100, graph=True), 3),
                       "eager": round(t_us(fn, 300), 3)}
                say(row)

    if a.small and os.environ.get("LINKWISE_GPU_TUNE"):
        e, s = g._engine, stream.cuda_stream
        knobs = [("LINKWISE_GPU_LL_THREADS", v, size) for v in (64, 128, 256)
                 for size in (4 << 10, 32 << 10)]
        knobs += [("LINKWISE_GPU_LL_MAX", v, size) for v in (1, 131072)  # 1: the flag kernels
                  for size in (16 << 10, 64 << 10, 128 << 10)]
        for name, v, size in knobs:
            os.environ[name] = str(v)
            y = torch.ones(size // 4, device="cuda")
            yp, k = y.data_ptr(), y.numel()
            row = {"what": "knob", "knob": name, "value": v, "bytes": size,
                   "all_reduce_graph": round(t_us(lambda: e.all_reduce(yp, yp, k, 0, 0, s, 0), 100, graph=True), 3)}
            if "LL" in name:  # broadcast: LL or (LL_MAX=1) the flag kernel too
                row["broadcast_graph"] = round(t_us(lambda: e.broadcast(yp, size, 0, s), 100, graph=True), 3)
            y.fill_(rank + 1)
            e.all_reduce(yp, yp, k, 0, 0, s, 0)
            torch.cuda.synchronize()
            row["ok"] = bool((y == n * (n + 1) / 2).all())
            say(row)
            os.environ.pop(name)

    if a.reduce:
        for size in [common.parse_size(v) for v in a.sizes.split(",")]:
            x = torch.randn(size // 4, device="cuda")
            o = torch.empty(size // 4 // n, device="cuda")
            it = max(5, min(20, int(4e9 / size)))
            ref = {"all_reduce": t_us(lambda: dist.all_reduce(x), it),
                   "reduce_scatter": t_us(lambda: dist.reduce_scatter_tensor(o, x), it)}
            for var in ("2", "1", "4"):
                os.environ["LINKWISE_GPU_REG_REDUCE_UNROLL"] = var
                for blocks in (0, 33, 66, 264):
                    g._engine.reg_blocks = blocks
                    for op, fn in (("all_reduce", lambda: g.all_reduce(x)),
                                   ("reduce_scatter", lambda: g.reduce_scatter(x, o))):
                        x.fill_(rank + 1)
                        fn()
                        torch.cuda.synchronize()
                        ok = bool(((o if op == "reduce_scatter" else x) == n * (n + 1) / 2).all())
                        us = t_us(fn, it)
                        f = common.busbw_factor(op, n)
                        say({"what": "reg_reduce", "op": op, "bytes": size, "unroll": var,
                             "blocks": blocks, "us": round(us, 1), "ok": ok,
                             "busbw": round(f * size / us / 1e3, 1), "nccl_us": round(ref[op], 1),
                             "nccl_busbw": round(f * size / ref[op] / 1e3, 1)})
            os.environ["LINKWISE_GPU_REG_REDUCE_UNROLL"] = "2"
            g._engine.reg_blocks = 0

    if a.bcast:
        reg_min = g._bcast_reg_min
        for size in [common.parse_size(v) for v in a.sizes.split(",")]:
            x = torch.randn(size // 4, device="cuda")
            it = max(5, min(20, int(4e9 / size)))
            nc = t_us(lambda: dist.broadcast(x, src=0), it)
            variants = [("scratch", {}), ("chain", {"LINKWISE_GPU_BCAST_ALGO": "chain"})]
            variants += [(f"pull-sag r{r}", {"LINKWISE_GPU_BCAST_ROUNDS": str(r)}) for r in (2, 4, 8, 16)]
            for name, env in variants:
                os.environ.pop("LINKWISE_GPU_BCAST_ALGO", None)
                os.environ.update(env)
                g._bcast_reg_min = 1 << 62 if name == "scratch" else 0
                x.fill_(rank + 1)
                g.broadcast(x, root=0)
                torch.cuda.synchronize()
                ok = bool((x == 1).all())
                us = t_us(lambda: g.broadcast(x, root=0), it)
                say({"what": "bcast", "algo": name, "bytes": size, "us": round(us, 1), "ok": ok,
                     "busbw": round(size / us / 1e3, 1), "nccl_us": round(nc, 1),
                     "nccl_busbw": round(size / nc / 1e3, 1)})
            os.environ.pop("LINKWISE_GPU_BCAST_ALGO", None)
            os.environ.pop("LINKWISE_GPU_BCAST_ROUNDS", None)
            g._bcast_reg_min = reg_min

    if a.bcast_forms:
        bcast_forms(a, comm, g, torch, t_us, say)
    if a.pchain:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_tune_forms import pchain_forms
        pchain_forms(a, comm, g, torch, t_us, say)
    if a.pchain_trace:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_tune_forms import pchain_trace
        pchain_trace(a, comm, g, torch, t_us, say)
    if a.ar_forms:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from gpu_tune_forms import ar_forms
        ar_forms(a, comm, g, torch, t_us, say)

    if a.final:
        from linkwise.bench.gpu_nccl import NcclDirectBackend
        direct = NcclDirectBackend(helper, g.device)
        if a.bcast:  # back to the default threshold after the --bcast sweep
            from linkwise import config
            os.environ.pop("LINKWISE_GPU_BCAST_REG_MIN", None)
            g._bcast_reg_min = max(g._reg_min, config.get("LINKWISE_GPU_BCAST_REG_MIN"))
        c, st = direct.c, stream.cuda_stream
        for size in [common.parse_size(v) for v in a.sizes.split(",")]:
            cnt = size // 4
            x = torch.randn(cnt, device="cuda")
            o = torch.empty(cnt // n, device="cuda")
            xs = x[rank * (cnt // n):(rank + 1) * (cnt // n)]  # in place, as nccl-tests
            it = max(5, min(20, int(4e9 / size)))
            ops = {
                "all_reduce": (lambda: comm.all_reduce(x), lambda: dist.all_reduce(x),
                               lambda: c.allReduce(x.data_ptr(), x.data_ptr(), cnt, 7, 0, st)),
                "reduce_scatter": (lambda: comm.reduce_scatter(x, out=o),
                                   lambda: dist.reduce_scatter_tensor(o, x),
                                   lambda: c.reduceScatter(x.data_ptr(), o.data_ptr(), cnt // n, 7, 0, st)),
                "all_gather": (lambda: comm.all_gather(xs, out=x),
                               lambda: dist.all_gather_into_tensor(x, xs),
                               lambda: c.allGather(xs.data_ptr(), x.data_ptr(), cnt // n, 7, st)),
                "broadcast": (lambda: comm.broadcast(x, 0), lambda: dist.broadcast(x, src=0),
                              lambda: c.broadcast(x.data_ptr(), x.data_ptr(), cnt, 7, 0, st)),
            }
            if n > 1:  # the copy engine between GPU 0 and 1 (torch cross-device copy), rank 0 only
                y = torch.empty(cnt, device=f"cuda:{(g.device + 1) % torch.cuda.device_count()}") if rank == 0 else None
                us = t_us((lambda: y.copy_(x, non_blocking=True)) if rank == 0 else (lambda: None), it)
                say({"what": "final", "op": "peer copy", "bytes": size, "us": round(us, 1),
                     "GBps": round(size / us / 1e3, 1)})
                del y
            for op, (lw, nt, nc) in ops.items():
                f = common.busbw_factor(op, n)
                row = {"what": "final", "op": op, "bytes": size}
                for name, fn in (("linkwise", lw), ("nccl", nt), ("nccl-cupy", nc)):
                    us = t_us(fn, it)
                    row[name + "_us"] = round(us, 1)
                    row[name + "_busbw"] = round(f * size / us / 1e3, 1)
                say(row)
        direct.close()

    if dist is not None:
        dist.destroy_process_group()
    R.dump(a.json)
    g.close()
    comm.close()
    return 0


BCAST_KNOBS = ("LINKWISE_GPU_BCAST_ALGO", "LINKWISE_GPU_BCAST_ROUNDS", "LINKWISE_GPU_BCAST_BLOCKS",
               "LINKWISE_GPU_BCAST_UNROLL", "LINKWISE_GPU_CHAIN_PIECE")


def bcast_forms(a, comm, g, torch, t_us, say) -> None:
    """--bcast-forms: the chain, the two-stream pull and the one-kernel push broadcasts."""
    from gpu_tune_forms import sweep_bcast_forms

    def forms_of(size):
        bc = [("chain", {"LINKWISE_GPU_BCAST_ALGO": "chain"})]
        bc += [(f"pull r{r}", {"LINKWISE_GPU_BCAST_ALGO": "pull", "LINKWISE_GPU_BCAST_ROUNDS": str(r)})
               for r in (4,)]
        bc += [(f"push r{r} b{b} u{u}", {"LINKWISE_GPU_BCAST_ALGO": "push", "LINKWISE_GPU_BCAST_ROUNDS": str(r),
                                          "LINKWISE_GPU_BCAST_BLOCKS": str(b), "LINKWISE_GPU_BCAST_UNROLL": str(u)})
               for r, b, u in ((8, 128, 4), (21, 128, 4), (21, 256, 4), (21, 512, 4), (21, 128, 8),
                               (8, 256, 8), (21, 256, 8))]
        if size < 128 << 20:
            bc.append(("scratch", {}))
        return bc
    sweep_bcast_forms(a, comm, g, torch, t_us, say, "bcast-forms", BCAST_KNOBS, forms_of)


if __name__ == "__main__":
    sys.exit(main())

"""``linkwise bench <collective> --device cuda [--compare nccl]``: the GPU backends.

Buffers are torch CUDA tensors made from the sweep's NumPy inputs in :meth:`bind` (outside the
timed region) and copied back for the check. Timing (:meth:`GpuBackend.timer`): CUDA events
recorded on the current stream around ``iters`` back-to-back operations after warm-up, no
host synchronisation in between and **no CUDA graphs**; the time is the mean per operation,
the max over ranks. ``linkwise`` goes through the Communicator (``comm.all_reduce(tensor)``
etc., the GPU data plane); ``nccl`` is ``torch.distributed`` with the NCCL backend in the same
processes, right after linkwise, on the same tensors. sendrecv is a ring (rank r sends to r+1
and receives from r-1), the send on a side stream so that every pair runs at once.
NCCL_NVLS_ENABLE=0 (NVLink multicast off) is set in the ranks' environment by spawn.py.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

import numpy as np

from .backends import Backend, LinkwiseBackend, Unsupported

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
HOW_TIMING = "CUDA events around back-to-back ops on the current stream, no CUDA graphs"


def missing_nccl() -> Optional[str]:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not torch.distributed.is_nccl_available():
        return "this torch was built without NCCL"
    return None


class GpuBackend(Backend):
    """Shared by the GPU backends: tensors from NumPy, CUDA-event timing, host-side results."""

    def __init__(self, rank: int, size: int, helper: LinkwiseBackend):
        import torch
        self.torch = torch
        self.rank, self.size = rank, size
        self._helper = helper  # harness barriers / reductions over linkwise host messages
        self._tensors: dict = {}

    def barrier(self) -> None:
        self.torch.cuda.synchronize()
        self._helper.barrier()

    def max_over_ranks(self, value: float) -> float:
        return self._helper.max_over_ranks(value)

    def sum_over_ranks(self, value: int) -> int:
        return self._helper.sum_over_ranks(value)

    def _dev(self, a: np.ndarray):
        return self.torch.from_numpy(a).cuda()

    def _pair(self, coll, send, recv, inplace):
        s, r = self._dev(send), self._dev(recv)
        self._tensors = {"send": s, "recv": r}
        if inplace:  # nccl-tests' in-place layout (inplace_views, on tensors)
            if coll in ("all_reduce", "broadcast", "reduce"):
                return r, r, s, r
            if coll == "all_gather":
                k = r.numel() // self.size
                return r[self.rank * k:(self.rank + 1) * k], r, s, r
            if coll == "reduce_scatter":
                k = s.numel() // self.size
                return s, s[self.rank * k:(self.rank + 1) * k], s, r
            raise Unsupported(f"{coll} has no in-place form here")
        return s, r, s, r

    def timer(self, fn: Callable[[], Any], iters: int, warmup: int) -> float:
        torch = self.torch
        for _ in range(warmup):
            fn()
        self.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return self.max_over_ranks(a.elapsed_time(b) * 1e-3 / max(1, iters))

    def result_view(self, coll, send, recv, inplace):
        self.torch.cuda.synchronize()
        host_send = self._tensors["send"].cpu().numpy()
        host_recv = self._tensors["recv"].cpu().numpy()
        return super().result_view(coll, host_send, host_recv, inplace)


class LinkwiseGpuBackend(GpuBackend):
    name = "linkwise"

    def __init__(self, helper: LinkwiseBackend):
        super().__init__(helper.rank, helper.size, helper)
        self.comm = helper.comm
        g = self.comm.cuda()  # collective: every rank builds the GPU data plane here
        self.torch.cuda.set_device(g.device)

    def available(self, coll: str) -> bool:
        return coll in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
                        "sendrecv")

    def bind(self, coll, send, recv, inplace, op, root):
        if not self.available(coll):
            raise Unsupported(f"{coll} on CUDA arrays is not in linkwise's GPU data plane")
        c, torch = self.comm, self.torch
        x, out, s, r = self._pair(coll, send, recv, inplace)
        if coll == "sendrecv":
            if inplace:
                raise Unsupported("sendrecv in place")
            nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
            side = torch.cuda.Stream()

            def sendrecv():
                cur = torch.cuda.current_stream()
                side.wait_stream(cur)
                c.send(s, nxt, stream=side)
                c.recv(r, prv, stream=cur)
                cur.wait_stream(side)
            return sendrecv
        if coll == "all_to_all" and inplace:
            raise Unsupported("all_to_all in place")
        kw: dict = {}
        if coll in ("all_reduce", "reduce_scatter"):
            kw["op"] = op
        if coll == "broadcast":
            kw["root"] = root
        if not (inplace and coll in ("all_reduce", "broadcast")):
            kw["out"] = out
        fn = getattr(c, coll)
        return lambda: fn(x, **kw)


class NcclBackend(GpuBackend):
    name = "nccl"

    def __init__(self, helper: LinkwiseBackend, port: int, device: int):
        super().__init__(helper.rank, helper.size, helper)
        import torch.distributed as dist
        self.dist = dist
        self.torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank,
                                world_size=self.size, device_id=self.torch.device("cuda", device))
        self._ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
                     "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}

    def bind(self, coll, send, recv, inplace, op, root):
        d = self.dist
        if coll in ("all_reduce", "reduce", "reduce_scatter") and op not in self._ops:
            raise Unsupported(f"nccl has no {op}")
        rop = self._ops.get(op)
        x, out, s, r = self._pair(coll, send, recv, inplace)
        if coll in ("all_reduce", "broadcast", "reduce"):
            if not inplace:  # torch.distributed has only the in-place form of these
                raise Unsupported(f"torch.distributed {coll} is in place only")
            if coll == "all_reduce":
                return lambda: d.all_reduce(r, op=rop)
            if coll == "broadcast":
                return lambda: d.broadcast(r, src=root)
            return lambda: d.reduce(r, dst=root, op=rop)
        if coll == "sendrecv":
            if inplace:
                raise Unsupported("sendrecv in place")
            nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size

            def sendrecv():
                for w in d.batch_isend_irecv([d.P2POp(d.irecv, r, prv), d.P2POp(d.isend, s, nxt)]):
                    w.wait()
            return sendrecv
        if coll == "all_to_all":
            if inplace:
                raise Unsupported("all_to_all in place")
            return lambda: d.all_to_all_single(r, s)
        if coll == "all_gather":
            return lambda: d.all_gather_into_tensor(out, x)
        if coll == "reduce_scatter":
            return lambda: d.reduce_scatter_tensor(out, x, op=rop)
        raise Unsupported(coll)

    def close(self):
        try:
            self.dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort
            pass

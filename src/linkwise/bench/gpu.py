"""``linkwise bench <collective> --device cuda [--compare nccl,nccl-cupy] [--graph]``: GPU backends.

Buffers are torch CUDA tensors made from the sweep's NumPy inputs in :meth:`bind` (outside the
timed region) and copied back for the check. Every backend of a rank runs on one dedicated
torch stream, made the process's current stream (:func:`bench_stream`), so that linkwise (which
enqueues on the current stream), ``torch.distributed`` and NCCL called directly all queue on the
same stream, eager or captured.

Timing (:meth:`GpuBackend.timer`), the time reported is the mean per operation, the max over
ranks:

* eager (default): CUDA events recorded on the stream around ``iters`` back-to-back
  operations after warm-up, no host synchronisation in between, no CUDA graphs; the host's
  cost per call counts wherever it exceeds the GPU's;
* ``--graph``: ``iters`` back-to-back operations captured into one ``torch.cuda.CUDAGraph``
  (after eager warm-up), the graph replayed once, then ``GRAPH_REPLAYS`` times between two CUDA
  events: the GPU's time per operation without host launch costs. An operation that cannot be
  captured (linkwise's registered-buffer paths) is reported n/a.

Systems: ``linkwise`` goes through the Communicator (``comm.all_reduce(tensor)``, the GPU data
plane); ``nccl`` is ``torch.distributed`` with the NCCL backend in the same processes, right
after linkwise, on the same tensors; ``nccl-cupy`` calls NCCL directly through
``cupy.cuda.nccl`` (:mod:`.gpu_nccl`; nccl-tests-like overhead: one Cython call per
operation on a fixed stream, no Work objects or stream syncs). sendrecv is a ring (rank r
sends to r+1 and receives from r-1). NCCL_NVLS_ENABLE=0 (NVLink multicast off) is set in the
ranks' environment by spawn.py.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

import numpy as np

from ..cuda.arrays import OPS as GPU_OPS
from .backends import Backend, LinkwiseBackend, Unsupported
from .compare import (bind_torch_dist, destroy_process_group, init_torch_group, torch_numpy,
                      torch_reduce_ops, torch_tensor)

GRAPH_REPLAYS = 10


def how_timing(graph: bool) -> str:
    if graph:
        return (f"CUDA graphs: -n ops captured in one graph, {GRAPH_REPLAYS} replays between CUDA "
                "events on the bench stream")
    return "CUDA events around back-to-back ops on the bench stream, no CUDA graphs"


def missing_nccl() -> Optional[str]:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    import torch
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if not torch.distributed.is_nccl_available():
        return "this torch was built without NCCL"
    return None


_streams: dict = {}


def bench_stream(torch, device: int):
    """This process's bench stream on `device`, made the current stream (once per device)."""
    s = _streams.get(device)
    if s is None:
        torch.cuda.set_device(device)
        s = _streams[device] = torch.cuda.Stream(device)
        torch.cuda.set_stream(s)
    return s


class GpuBackend(Backend):
    """Shared by the GPU backends: tensors from NumPy, CUDA-event timing, host-side results."""

    def __init__(self, rank: int, size: int, helper: LinkwiseBackend, device: int,
                 graph: bool = False):
        import torch
        self.torch = torch
        self.rank, self.size = rank, size
        self._helper = helper  # harness barriers / reductions over linkwise host messages
        self._tensors: dict = {}
        self.graph = graph
        self.stream = bench_stream(torch, device)

    def barrier(self) -> None:
        self.torch.cuda.synchronize()
        self._helper.barrier()

    def max_over_ranks(self, value: float) -> float:
        return self._helper.max_over_ranks(value)

    def sum_over_ranks(self, value: int) -> int:
        return self._helper.sum_over_ranks(value)

    def _dev(self, a: np.ndarray):
        return torch_tensor(self.torch, a).cuda()

    def _pair(self, coll, send, recv, inplace):
        s, r = self._dev(send), self._dev(recv)
        self._tensors = {"send": s, "recv": r}
        if inplace:  # nccl-tests' in-place layout (inplace_views, on tensors)
            if coll in ("all_reduce", "broadcast", "reduce", "all_to_all"):
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
        return time_ops(self.torch, self.stream, fn, iters, warmup, self.graph,
                        self.barrier, self.max_over_ranks)

    def result_view(self, coll, send, recv, inplace):
        self.torch.cuda.synchronize()
        host_send = torch_numpy(self.torch, self._tensors["send"].cpu())
        host_recv = torch_numpy(self.torch, self._tensors["recv"].cpu())
        return super().result_view(coll, host_send, host_recv, inplace)


def time_ops(torch, stream, fn: Callable[[], Any], iters: int, warmup: int, graph: bool,
             barrier: Callable[[], None], reduce_max: Callable[[float], float]) -> float:
    """Seconds per call of fn on `stream` (see the module docstring), the max over ranks.
    Raises Unsupported (on every rank alike) when fn cannot be captured in graph mode."""
    iters = max(1, iters)
    for _ in range(warmup):
        fn()
    g = None
    if graph:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        failed = None
        try:
            with torch.cuda.graph(g, stream=stream):
                for _ in range(iters):
                    fn()
        except RuntimeError as exc:  # e.g. a registered-buffer path refusing capture
            failed = str(exc).splitlines()[0][:160]
        if reduce_max(1.0 if failed else 0.0) > 0:
            torch.cuda.synchronize()
            raise Unsupported(f"cannot be captured in a CUDA graph: {failed or 'on another rank'}")
        g.replay()  # warm-up replay
    barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    if g is not None:
        for _ in range(GRAPH_REPLAYS):
            g.replay()
        calls = GRAPH_REPLAYS * iters
    else:
        for _ in range(iters):
            fn()
        calls = iters
    b.record(stream)
    b.synchronize()
    return reduce_max(a.elapsed_time(b) * 1e-3 / calls)


class LinkwiseGpuBackend(GpuBackend):
    name = "linkwise"

    def __init__(self, helper: LinkwiseBackend, graph: bool = False):
        self.comm = helper.comm
        g = self.comm.cuda()  # collective: every rank builds the GPU data plane here
        super().__init__(helper.rank, helper.size, helper, g.device, graph)

    def available(self, coll: str) -> bool:
        return coll in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
                        "sendrecv")

    def bind(self, coll, send, recv, inplace, op, root):
        if not self.available(coll):
            raise Unsupported(f"{coll} on CUDA arrays is not in linkwise's GPU data plane")
        c, torch = self.comm, self.torch
        if coll in ("all_reduce", "reduce_scatter") and op not in GPU_OPS:  # no bitwise ops
            raise Unsupported(f"linkwise's GPU data plane has no {op}")  # it would raise ValueError
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
        kw: dict = {}
        if coll in ("all_reduce", "reduce_scatter"):
            kw["op"] = op
        if coll == "broadcast":
            kw["root"] = root
        if not (inplace and coll in ("all_reduce", "broadcast", "all_to_all")):
            kw["out"] = out
        fn = getattr(c, coll)
        return lambda: fn(x, **kw)


class NcclBackend(GpuBackend):
    """NCCL through torch.distributed (its usual caller: Work objects, stream syncs)."""

    name = "nccl"

    def __init__(self, helper: LinkwiseBackend, addr: str, port: int, device: int, graph: bool = False):
        super().__init__(helper.rank, helper.size, helper, device, graph)
        import torch.distributed as dist
        self.dist = dist
        init_torch_group(dist, "nccl", self.rank, self.size, port, addr,  # not tcp://: under torchrun
                         device_id=self.torch.device("cuda", device))  # it hangs (compare.py)
        self._ops = torch_reduce_ops(dist, avg=True)

    def bind(self, coll, send, recv, inplace, op, root):
        d = self.dist
        x, out, s, r = self._pair(coll, send, recv, inplace)
        fn = bind_torch_dist(d, "nccl", self._ops, coll, inplace, op, root, self.rank, self.size, s, r)
        if fn is not None:
            return fn
        if coll == "all_gather":
            return lambda: d.all_gather_into_tensor(out, x)
        if coll == "reduce_scatter":
            rs = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor  # renamed in newer torch
            return lambda: rs(out, x, op=self._ops.get(op))
        raise Unsupported(coll)

    def close(self):
        destroy_process_group(self.dist)

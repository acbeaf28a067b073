"""GpuComm: one Communicator's GPU data plane (the C++ engine in csrc/cuda/).

Setup (collective over the communicator, in the constructor): pick the device
(``LINKWISE_DEVICE``, else local_rank % device_count), allocate the scratch area, exchange CUDA
IPC handles through the rendezvous store (``comm._store``), map every peer's area, barrier.

Semantics as NCCL's: every method enqueues on ``stream`` (an int cudaStream_t or a stream
object), else on the current stream of the array's library (torch / cupy), and returns
without waiting for the GPU. All ranks issue the same collectives in the same order, on one
stream (or streams the caller orders). send/recv between a pair match in issue order; the
tag is accepted for API symmetry and not matched. Results are bitwise identical on every rank.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..errors import TimeoutError as LwTimeoutError
from .arrays import DTYPES, OPS, DevArray, stream_handle, view

_DEFAULT_SLOT = 16 << 20
_counter: dict = {}


def _native():
    from .. import _native as n
    return n


def available() -> bool:
    """True when the extension was built with CUDA and a device is visible."""
    n = _native()
    return hasattr(n, "_GpuEngine") and n.cuda_device_count() > 0


def select_device(comm) -> int:
    env = os.environ.get("LINKWISE_DEVICE")
    if env not in (None, ""):
        return int(env)
    count = _native().cuda_device_count()
    if count <= 0:
        raise RuntimeError(f"rank {comm.rank}: no CUDA device is visible")
    return int(getattr(comm, "local_rank", comm.rank)) % count


def gpu_comm(comm) -> "GpuComm":
    """The communicator's GpuComm, built on first use (collective: every rank must call it)."""
    g = getattr(comm, "_gpu_comm", None)
    if g is None:
        g = GpuComm(comm)
        comm._gpu_comm = g
    return g


class GpuComm:
    def __init__(self, comm, device: Optional[int] = None, slot_bytes: Optional[int] = None):
        n = _native()
        if not hasattr(n, "_GpuEngine"):
            raise RuntimeError("linkwise was built without CUDA (set LINKWISE_CUDA=ON and rebuild)")
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.device = select_device(comm) if device is None else int(device)
        slot = int(slot_bytes or os.environ.get("LINKWISE_GPU_SLOT_BYTES", _DEFAULT_SLOT))
        self._engine = n._GpuEngine(self.rank, self.size, self.device, slot, float(comm.timeout))
        if "LINKWISE_GPU_ONESHOT_MAX" in os.environ:
            self._engine.oneshot_max = int(os.environ["LINKWISE_GPU_ONESHOT_MAX"])
        if "LINKWISE_GPU_MAX_BLOCKS" in os.environ:
            self._engine.max_blocks = int(os.environ["LINKWISE_GPU_MAX_BLOCKS"])
        if self.size > 1:
            store = comm._store
            cid = getattr(comm, "comm_id", "world")
            k = _counter[cid] = _counter.get(cid, 0) + 1
            key = f"{cid}/gpu/{k}"
            handles = store.all_gather(f"{key}/ipc", self.rank, self.size, self._engine.ipc_handle())
            self._engine.open_peers(handles)
            store.barrier(f"{key}/open", self.size)
            self._key = key
        self._closed = False

    @property
    def slot_bytes(self) -> int:
        return self._engine.slot_bytes

    # -- helpers ---------------------------------------------------------------------------
    def _view(self, x: Any, op: str) -> DevArray:
        v = view(x, op)
        if v.device is not None and v.device != self.device:
            raise ValueError(f"rank {self.rank}: {op}: the array is on cuda:{v.device} but this "
                             f"communicator uses cuda:{self.device} (set LINKWISE_DEVICE)")
        return v

    def _reduce_args(self, v: DevArray, op: str, what: str) -> tuple[int, int]:
        if v.dtype not in DTYPES:
            raise TypeError(f"{what}: dtype {v.dtype} is not supported on GPU "
                            f"(supported: {', '.join(DTYPES)})")
        if op not in OPS:
            raise ValueError(f"{what}: op must be one of {', '.join(OPS)}, not {op!r}")
        return DTYPES[v.dtype], OPS[op]

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum", out: Any = None, stream: Any = None,
                   algo: str = "auto") -> Any:
        v = self._view(x, "all_reduce")
        o = v if out is None else self._view(out, "all_reduce")
        if o.count != v.count or o.dtype != v.dtype:
            raise ValueError("all_reduce: out must have the same size and dtype as x")
        dt, opc = self._reduce_args(v, op, "all_reduce")
        a = {"auto": 0, "oneshot": 1, "twoshot": 2}[algo]
        self._engine.all_reduce(v.ptr, o.ptr, v.count, dt, opc, stream_handle(stream, v), a)
        return x if out is None else out

    def reduce_scatter(self, x: Any, out: Any, op: str = "sum", stream: Any = None) -> Any:
        v, o = self._view(x, "reduce_scatter"), self._view(out, "reduce_scatter")
        if v.count != o.count * self.size or o.dtype != v.dtype:
            raise ValueError(f"reduce_scatter: x must have size * len(out) elements "
                             f"({self.size} * {o.count}) of out's dtype, got {v.count} {v.dtype}")
        dt, opc = self._reduce_args(v, op, "reduce_scatter")
        self._engine.reduce_scatter(v.ptr, o.ptr, o.count, dt, opc, stream_handle(stream, v))
        return out

    def broadcast(self, x: Any, root: int = 0, stream: Any = None) -> Any:
        v = self._view(x, "broadcast")
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} is out of range 0..{self.size - 1}")
        self._engine.broadcast(v.ptr, v.nbytes, root, stream_handle(stream, v))
        return x

    def all_gather(self, x: Any, out: Any, stream: Any = None) -> Any:
        v, o = self._view(x, "all_gather"), self._view(out, "all_gather")
        if o.nbytes != v.nbytes * self.size:
            raise ValueError(f"all_gather: out must hold size * x.nbytes = {self.size * v.nbytes} "
                             f"bytes, has {o.nbytes}")
        self._engine.all_gather(v.ptr, o.ptr, v.nbytes, stream_handle(stream, v))
        return out

    def all_to_all(self, x: Any, out: Any, stream: Any = None) -> Any:
        v, o = self._view(x, "all_to_all"), self._view(out, "all_to_all")
        if o.nbytes != v.nbytes or v.nbytes % self.size:
            raise ValueError("all_to_all: x and out must have the same size, divisible by the "
                             "number of ranks")
        self._engine.all_to_all(v.ptr, o.ptr, v.nbytes // self.size, stream_handle(stream, v))
        return out

    def send(self, x: Any, dst: int, tag: int = 0, stream: Any = None) -> None:
        v = self._view(x, "send")
        self._engine.send(v.ptr, v.nbytes, dst, stream_handle(stream, v))

    def recv(self, x: Any, src: int, tag: int = 0, stream: Any = None) -> int:
        v = self._view(x, "recv")
        self._engine.recv(v.ptr, v.nbytes, src, stream_handle(stream, v))
        return v.nbytes

    def barrier(self, stream: Any = None) -> None:
        """Device-side barrier enqueued on `stream` (default: legacy stream), then waits for it."""
        h = stream if isinstance(stream, int) else 0
        self._engine.barrier(h)
        self.synchronize(h)

    def synchronize(self, stream: int = 0) -> None:
        self._engine.synchronize(stream)
        if self._engine.error_code():
            raise LwTimeoutError(f"rank {self.rank}: a GPU operation timed out waiting for a peer "
                                 f"(after {self.comm.timeout:g} s); results are invalid")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.synchronize(0)
        if self.size > 1 and getattr(self.comm, "_store", None) is not None:
            self.comm._store.barrier(f"{self._key}/close", self.size)
        self._engine.close()

    def __repr__(self) -> str:
        return f"<linkwise.cuda.GpuComm rank {self.rank} of {self.size} on cuda:{self.device}>"

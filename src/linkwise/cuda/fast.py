"""The eager fast path of all_reduce / broadcast on CUDA arrays (issue 4: small messages).

Called back to back from Python, a small collective is bound by the host: the general path
(collectives.py -> _gpu_coll.dispatch -> GpuComm -> arrays.view -> the engine) costs several
µs per call in Python alone. :class:`FastPath` handles the common case with the fewest
calls: a torch CUDA tensor (exact type ``torch.Tensor``) or a ``cupy.ndarray``, on this
communicator's device, C-contiguous, ``out`` absent, ``x`` itself or another array of the same
kind, ``stream`` absent (the library's current stream) or an int cudaStream_t, not async, below
the registered-buffer thresholds. It reads the data pointer, size and dtype with the cheapest
calls each library has, gets the current stream without building a stream object, and makes
ONE native call (``_GpuEngine.all_reduce_fast`` / ``broadcast_fast``: the failure check, the
size-based kernel choice and the launch, in C++).

Contract: every method returns the result when it enqueued the operation, else ``None``
without having done anything (no GPU work, no state change), and the caller takes the general
path, which raises the clear errors (CPU array, other device, unsupported dtype or op, bad root,
size mismatch). So whatever the fast path declines behaves exactly as before.

Ownership: one FastPath per GpuComm, made by ``gpu_comm()`` and stored as the communicator's
``_gpu_fast``; ``GpuComm.close()`` clears that attribute before the engine is released, so a
closed communicator never reaches the engine through here. Threading: as the general path (the
caller serialises operations of one communicator; the native call releases the GIL).
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from .arrays import OPS
from .registered import forced_algo

# torch dtype name / numpy dtype char -> (engine dtype code (launch.h DType), element bytes)
_REDUCE_T = {"float32": (0, 4), "float16": (1, 2), "bfloat16": (2, 2), "int32": (3, 4),
             "float64": (4, 8), "int64": (5, 8)}
_REDUCE_C = {"f": (0, 4), "e": (1, 2), "i": (3, 4), "d": (4, 8), "l": (5, 8), "q": (5, 8)}


class FastPath:
    __slots__ = ("dev", "size", "_ar", "_bc", "_ar_max", "_bc_max", "_T", "_tdt", "_tes",
                 "_tstream", "_C", "_cstream")

    def __init__(self, g: Any) -> None:
        self.dev = g.device
        self.size = g.size
        self._ar = g._engine.all_reduce_fast
        self._bc = g._engine.broadcast_fast
        # From these sizes the registered-buffer paths (host all_gather per call) take over.
        self._ar_max = g._red_reg_min
        if forced_algo(g):  # LINKWISE_GPU_AR_ALGO=prs / rsag (read once, here): the general path
            self._ar_max = 0
        self._bc_max = g._bcast_reg_min
        self._T = self._C = None
        self._tdt: dict = {}   # torch.dtype -> (code, itemsize), reducible dtypes only
        self._tes: dict = {}   # torch.dtype -> itemsize, any dtype (broadcast)
        self._tstream = self._cstream = None
        self._learn()

    def _learn(self) -> bool:
        """Resolves the array types and stream getters of the libraries imported so far (a
        library imported after the communicator's GPU setup is found on its first miss).
        True when something new was found."""
        new = False
        torch = sys.modules.get("torch")
        if self._T is None and torch is not None and hasattr(torch, "Tensor"):
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            self._tstream = raw or (lambda d: torch.cuda.current_stream(d).cuda_stream)
            for name, v in _REDUCE_T.items():
                dt = getattr(torch, name, None)
                if dt is not None:
                    self._tdt[dt] = v
            self._T = torch.Tensor
            new = True
        cupy = sys.modules.get("cupy")
        if self._C is None and cupy is not None and hasattr(cupy, "ndarray"):
            get_ptr = getattr(getattr(cupy.cuda, "stream", None), "get_current_stream_ptr", None)
            self._cstream = get_ptr or (lambda: cupy.cuda.get_current_stream().ptr)
            self._C = cupy.ndarray
            new = True
        return new

    def _miss(self, t: type) -> bool:
        """x's type is neither known array type: True when learning found it (retry)."""
        mod = getattr(t, "__module__", "") or ""
        return (mod.startswith("torch") or mod.startswith("cupy")) and self._learn()

    # -- torch ---------------------------------------------------------------------------
    def _t_out(self, x: Any, out: Any, n: int) -> Optional[int]:
        """out's data pointer when it is a tensor like x (device, dtype, n elements), else None."""
        if (type(out) is self._T and out.get_device() == self.dev and out.dtype is x.dtype
                and out.is_contiguous() and out.numel() == n):
            return out.data_ptr()
        return None

    def _t_stream(self, stream: Any) -> Optional[int]:
        if stream is None:
            return self._tstream(self.dev)
        return stream if type(stream) is int else None

    # -- entry points (see the module docstring for the contract) ---------------------------
    def all_reduce(self, x: Any, op: str, out: Any, stream: Any) -> Any:
        t = type(x)
        if t is self._T:
            if x.get_device() != self.dev or not x.is_contiguous():
                return None
            d = self._tdt.get(x.dtype)
            c = OPS.get(op)
            if d is None or c is None:
                return None
            n = x.numel()
            if n * d[1] >= self._ar_max:
                return None
            s = self._t_stream(stream)
            if s is None:
                return None
            p = x.data_ptr()
            if out is None or out is x:
                self._ar(p, p, n, d[0], c, s)
                return x
            q = self._t_out(x, out, n)
            if q is None:
                return None
            self._ar(p, q, n, d[0], c, s)
            return out
        if t is self._C:
            return self._c_all_reduce(x, op, out, stream)
        if self._miss(t):
            return self.all_reduce(x, op, out, stream)
        return None

    def broadcast(self, x: Any, root: Any, out: Any, stream: Any) -> Any:
        if type(root) is not int or not 0 <= root < self.size:
            return None
        t = type(x)
        if t is self._T:
            if x.get_device() != self.dev or not x.is_contiguous():
                return None
            es = self._tes.get(x.dtype)
            if es is None:
                es = self._tes[x.dtype] = x.element_size()
            nb = x.numel() * es
            if nb >= self._bc_max:
                return None
            s = self._t_stream(stream)
            if s is None:
                return None
            p = x.data_ptr()
            if out is None or out is x:
                self._bc(p, p, nb, root, s)
                return x
            q = self._t_out(x, out, x.numel())
            if q is None:
                return None
            self._bc(p, q, nb, root, s)
            return out
        if t is self._C:
            return self._c_broadcast(x, root, out, stream)
        if self._miss(t):
            return self.broadcast(x, root, out, stream)
        return None

    # -- cupy ----------------------------------------------------------------------------
    def _c_view(self, x: Any) -> Optional[tuple]:
        """(pointer, elements, dtype char, itemsize) of a cupy array on our device, C-contiguous."""
        try:
            m = x.data
            if m.device_id != self.dev or not x.flags.c_contiguous:
                return None
            dt = x.dtype
            return m.ptr, x.size, dt.char, dt.itemsize
        except AttributeError:  # another cupy version's layout: the general path
            return None

    def _c_out(self, v: tuple, out: Any) -> Optional[int]:
        if type(out) is not self._C:
            return None
        o = self._c_view(out)
        if o is None or o[1:] != v[1:]:
            return None
        return o[0]

    def _c_stream(self, stream: Any) -> Optional[int]:
        if stream is None:
            return self._cstream()
        return stream if type(stream) is int else None

    def _c_all_reduce(self, x: Any, op: str, out: Any, stream: Any) -> Any:
        v = self._c_view(x)
        if v is None:
            return None
        d = _REDUCE_C.get(v[2])
        c = OPS.get(op)
        if d is None or c is None or d[1] != v[3] or v[1] * v[3] >= self._ar_max:
            return None
        s = self._c_stream(stream)
        if s is None:
            return None
        if out is None or out is x:
            self._ar(v[0], v[0], v[1], d[0], c, s)
            return x
        q = self._c_out(v, out)
        if q is None:
            return None
        self._ar(v[0], q, v[1], d[0], c, s)
        return out

    def _c_broadcast(self, x: Any, root: int, out: Any, stream: Any) -> Any:
        v = self._c_view(x)
        if v is None or v[1] * v[3] >= self._bc_max:
            return None
        s = self._c_stream(stream)
        if s is None:
            return None
        if out is None or out is x:
            self._bc(v[0], v[0], v[1] * v[3], root, s)
            return x
        q = self._c_out(v, out)
        if q is None:
            return None
        self._bc(v[0], q, v[1] * v[3], root, s)
        return out

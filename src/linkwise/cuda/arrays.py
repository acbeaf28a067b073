"""CUDA arrays as (device pointer, element count, dtype, device), and stream resolution.

Accepted: PyTorch CUDA tensors, anything with ``__cuda_array_interface__`` (CuPy, Numba), and
anything whose ``__dlpack__`` lives on a CUDA device (converted through ``torch.from_dlpack``,
zero-copy). Arrays must be C-contiguous.
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional

# dtype name -> engine code (csrc/cuda/launch.h DType)
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "int32": 3, "float64": 4, "int64": 5}
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}
_TYPESTR: dict = {}  # __cuda_array_interface__ typestr -> dtype name (_cai_dtype)
_KDLCUDA, _KDLCUDAMANAGED = 2, 13


class DevArray(NamedTuple):
    ptr: int
    count: int
    itemsize: int
    dtype: Optional[str]   # a DTYPES key, or another name (bytes-only operations accept it)
    device: Optional[int]  # CUDA ordinal where known
    lib: str               # "torch", "cupy" or "other": where the current stream comes from
    stream: Optional[int] = None  # "other": the CAI v3 "stream" entry, as a cudaStream_t

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


_TT: Any = None  # torch.Tensor, once torch is imported
_TORCH_DT: dict = {}  # torch.dtype -> (DTYPES name, itemsize): str(dtype) is slow per call
_raw_stream: Any = None  # torch._C._cuda_getCurrentRawStream, where this torch has it


def _torch_tensor(x: Any):
    global _TT
    if _TT is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        _TT = torch.Tensor
    if isinstance(x, _TT):
        return sys.modules["torch"]
    return None


def is_cuda_array(x: Any) -> bool:
    """True for arrays that live in CUDA device memory (what GpuComm takes)."""
    if _torch_tensor(x) is not None:
        return bool(x.is_cuda)
    if hasattr(x, "__cuda_array_interface__"):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            return dev()[0] in (_KDLCUDA, _KDLCUDAMANAGED)
        except Exception:  # noqa: BLE001 - not a DLPack exporter after all
            return False
    return False


def view(x: Any, op: str) -> DevArray:
    """Unpacks a CUDA array; TypeError for CPU arrays, ValueError for non-contiguous ones."""
    torch = _torch_tensor(x)
    if torch is not None:
        dev = x.get_device()  # -1 on the host
        if dev < 0:
            raise TypeError(f"{op}: expected a CUDA tensor, got a tensor on {x.device}; "
                            "use the CPU communicator methods for host arrays")
        if not x.is_contiguous():
            raise ValueError(f"{op}: the tensor must be contiguous (call .contiguous())")
        dt = _TORCH_DT.get(x.dtype)
        if dt is None:
            dt = _TORCH_DT[x.dtype] = (str(x.dtype).replace("torch.", ""), x.element_size())
        return DevArray(x.data_ptr(), x.numel(), dt[1], dt[0], dev, "torch")
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(cai["shape"])
        ts = cai["typestr"]
        itemsize = int(ts[2:])
        strides = cai.get("strides")
        if strides is not None:
            want, expect = list(strides), []
            acc = itemsize
            for dim in reversed(shape):
                expect.insert(0, acc)
                acc *= dim
            if any(d > 1 and a != b for d, a, b in zip(shape, want, expect)):
                raise ValueError(f"{op}: the array must be C-contiguous")
        count = 1
        for dim in shape:
            count *= dim
        dev = getattr(getattr(x, "device", None), "id", None)
        lib = "cupy" if type(x).__module__.startswith("cupy") else "other"
        return DevArray(int(cai["data"][0]), count, itemsize, _cai_dtype(ts), dev, lib,
                        _cai_stream(cai, op) if lib == "other" else None)
    if hasattr(x, "__dlpack__") and is_cuda_array(x):
        import torch
        return view(torch.from_dlpack(x), op)
    raise TypeError(f"{op}: expected a CUDA array (torch CUDA tensor, __cuda_array_interface__ or a "
                    f"CUDA __dlpack__), got {type(x).__name__}")


def _cai_dtype(ts: str) -> str:
    """The dtype name of a CAI typestr as torch and NumPy name it ("<f4" float32, "|u1"
    uint8, "|b1" bool), so that arrays of two libraries compare equal; else the typestr."""
    name = _TYPESTR.get(ts)
    if name is None:
        import numpy as np
        try:
            dt = np.dtype(ts)
            name = dt.name if dt.kind in "biufc" and dt.isnative else ts
        except TypeError:
            name = ts
        _TYPESTR[ts] = name
    return name


def _cai_stream(cai: dict, op: str) -> Optional[int]:
    """The CAI v3 "stream" entry as the stream to enqueue on: absent or None (no
    synchronisation needed) -> None (then the legacy default stream, as before), 1 (legacy
    default) -> 0, 2 (per-thread default) -> 2 (cudaStreamPerThread), else the cudaStream_t
    itself."""
    st = cai.get("stream")
    if st is None:
        return None
    if isinstance(st, bool) or not isinstance(st, int) or st < 0:
        raise ValueError(f"{op}: __cuda_array_interface__ 'stream' must be None or a "
                         f"cudaStream_t integer, got {st!r}")
    return 0 if st == 1 else st  # 0, which v3 disallows, read as the legacy stream too


def check_out(v: DevArray, o: DevArray, times: int, op: str) -> None:
    """ValueError unless out (o) has x's (v) dtype and `times` times its elements."""
    if o.dtype != v.dtype or o.count != v.count * times:
        raise ValueError(f"{op}: out must be a {v.dtype} array of {v.count * times} elements, "
                         f"got {o.dtype} with {o.count}")


def stream_handle(stream: Any, arr: Optional[DevArray]) -> int:
    """The cudaStream_t to enqueue on: `stream` (an int, torch.cuda.Stream, cupy Stream), else the
    current stream of the array's library, else the stream a __cuda_array_interface__ (v3)
    names, else the legacy default stream (0)."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr", "handle"):
            h = getattr(stream, attr, None)
            if isinstance(h, int):
                return h
        raise TypeError(f"stream: expected an int cudaStream_t or a stream object, got {type(stream).__name__}")
    if arr is None:
        return 0
    if arr.lib == "torch":
        return torch_current_stream(arr.device)
    if arr.lib == "cupy":
        import cupy
        return cupy.cuda.get_current_stream().ptr
    return arr.stream or 0


def torch_stream(handle: int, device: int):
    """torch's Stream object for the cudaStream_t `handle` on `device`. Handle 0 is torch's
    default stream; torch.cuda.ExternalStream(0) is not: torch reads a zero pointer as "none
    given" and hands out a stream of its pool, which orders nothing with the caller's work."""
    import torch
    if handle == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)


def copy_on_stream(x: Any, arr: DevArray, stream: int, device: int, op: str) -> Any:
    """A copy of CUDA array x (viewed as arr), made on cudaStream_t `stream` and allocated
    there, so the library's allocator reuses its memory only after work later enqueued on that
    stream. torch tensors, DLPack arrays (through torch) and cupy arrays; TypeError for others,
    which have no library to allocate with."""
    if arr.lib == "torch":  # a torch tensor, or a DLPack array read through torch
        import torch
        t = x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)
        with torch.cuda.device(device), torch.cuda.stream(torch_stream(stream, device)):
            return t.clone()
    if arr.lib == "cupy":
        import cupy
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream):
            return x.copy()
    raise TypeError(f"{op}: this CUDA array (neither torch, cupy nor DLPack) cannot be copied "
                    "here; pass a copy of it (or out=)")


def torch_current_stream(device: int) -> int:
    """torch's current cudaStream_t on `device` as an int. torch.cuda.current_stream() builds a
    Stream object per call (several µs); the raw getter torch's compiler uses does not."""
    global _raw_stream
    if _raw_stream is None:
        import torch
        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream(device)

"""bfloat16 on the host. NumPy has no bfloat16 of its own; the collectives read as bfloat16 an
``ml_dtypes.bfloat16`` array, an unstructured 2-byte void array (``"V2"``, no fields) and a
uint16 array passed with ``dtype="bfloat16"``.

A CPU ``torch.bfloat16`` tensor, which ``np.from_dlpack`` refuses, becomes a NumPy view of its
memory (no copy) typed :func:`dtype`: :func:`torch_view` (also any other DLPack producer of
CPU bfloat16, through ``torch.from_dlpack``, while torch is loaded). Used by ``comm._as_buffer`` only
after ``np.from_dlpack`` failed, so plain NumPy arrays and other tensors never come here.

Contract: nothing here imports torch. An object can only be a torch tensor if torch is in
``sys.modules`` already (the caller made it), so that is checked first.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

VOID2 = np.dtype("V2")  # unstructured: a structured 2-byte dtype never compares equal to it
_dtype: Optional[np.dtype] = None


def dtype() -> np.dtype:
    """The NumPy dtype of a host bfloat16 view: ml_dtypes.bfloat16 when ml_dtypes imports,
    else the unstructured 2-byte void dtype (which the collectives also reduce as bfloat16)."""
    global _dtype
    if _dtype is None:
        try:
            import ml_dtypes
            _dtype = np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            _dtype = VOID2
    return _dtype


def torch_view(x: Any) -> Optional[np.ndarray]:
    """x's memory as a NumPy array of :func:`dtype` (no copy) when x is a CPU torch.bfloat16
    tensor, or another DLPack producer of CPU bfloat16 (a wrapper, JAX) while torch is loaded
    (torch.from_dlpack reads it; NumPy cannot), else None. A tensor that requires grad gives
    None, so that the caller raises the error np.from_dlpack gives (as for a float32 one): use
    x.detach()."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.from_dlpack(x)  # shares x's memory
        except (TypeError, BufferError, RuntimeError, AttributeError):
            return None
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.requires_grad:
        return None
    # The bits through DLPack as 2-byte integers (same size: a view, no copy). torch.uint16
    # exists from torch 2.3; where it does not or cannot be exported, int16 (same bits).
    as16 = getattr(torch, "uint16", None)
    try:
        bits = np.from_dlpack(x.view(as16 if as16 is not None else torch.int16))
    except (TypeError, BufferError, RuntimeError):
        bits = np.from_dlpack(x.view(torch.int16))
    return bits.view(dtype())

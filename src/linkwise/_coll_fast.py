"""The latency path of a bfloat16 all_reduce. Every other latency path makes its tests
natively: the shared-memory executor's *_fast entries (bind_shm_fast.cc for all_reduce,
reduce and broadcast; bind_shm_fast_blocks.cc for all_gather, reduce_scatter, all_to_all,
gather and scatter), which return NotImplemented where they do not serve a call."""
from __future__ import annotations

import numpy as np

from ._coll_args import _ENV, _FAST_CODES_BY_OP, _dtype_name, fast_path_bf16

_ndarray, _uint16 = np.ndarray, np.uint16


def all_reduce_bf16_fast(comm, fast, x, op, out):
    """The latency path of a bfloat16 all_reduce (a V2 array, or ml_dtypes' bfloat16 once one
    was seen), which the executor's all_reduce_fast declines (NumPy exports V2 as pad bytes,
    '2x', and no buffer of ml_dtypes' bfloat16): its call on uint16 views; NotImplemented
    where it declines too, and while LINKWISE_ALGO or LINKWISE_CHECK is set (as the native
    entries do)."""
    if b"LINKWISE_ALGO" in _ENV or b"LINKWISE_CHECK" in _ENV:
        return NotImplemented
    try:
        code = _FAST_CODES_BY_OP[op][x.dtype]
    except (KeyError, TypeError):
        if _dtype_name(x, None) == "bfloat16":
            fast_path_bf16(x.dtype)  # ml_dtypes' bfloat16: served from the next call
        return NotImplemented
    if code >= 0:
        return NotImplemented  # served natively when it is served at all
    if out is not None and (type(out) is not _ndarray or out.dtype != x.dtype):
        return NotImplemented
    try:
        if out is None:
            bits = x.view(_uint16)
            declined = fast.all_reduce(bits, bits, -code, comm.timeout)
        else:
            declined = fast.all_reduce(x.view(_uint16), out.view(_uint16), -code, comm.timeout)
    except (ValueError, TypeError):  # the buffer checks of the native call
        comm._skip_call()
        raise
    if declined is NotImplemented:  # a one-rank communicator's (SoloColl): the general path checks
        return NotImplemented
    return x if out is None else out

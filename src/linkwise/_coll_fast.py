"""The latency paths of small all_gather, reduce_scatter and all_to_all: straight to the
shared-memory executor's one-shot exchange (ShmColl::exchange) for plain NumPy arrays of at
most 32 KiB, blocking, with no LINKWISE_ALGO or LINKWISE_CHECK set; of small gather and
scatter (all blocks within 32 KiB; ShmColl::gather / scatter) likewise. (all_reduce, reduce
and broadcast make their tests natively: the executor's *_fast entries, bind_shm_fast.cc.)
The general path (CollectivesMixin, then _run) costs ~6 us of Python a call on the 2-core VM
against ~1-2 us for the exchange itself; here a handful of tests decide.

Each returns DECLINED where it declines (the caller then takes the general path, which
reaches the same executor call after its checks, or the point-to-point algorithms). The decision
depends only on what every rank shares for a correct program (x's size and dtype, the
environment), so all ranks take the same route. Buffer checks not made here (contiguity,
writability) happen natively; a refusal there numbers the call as skipped, as the general
path's refusals do (collectives._skips_on_argument_error)."""
from __future__ import annotations

import numpy as np

from ._coll_args import _ENV, _FAST_CODES_BY_OP, KINDS, _dtype_name, block_shape, fast_path_bf16, gathered_shape
from ._shm_exec import ONE_SHOT_CAP

_ndarray = np.ndarray
_uint16 = np.uint16
ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = KINDS["all_gather"], KINDS["reduce_scatter"], KINDS["all_to_all"]
_MOVED = "biufc"  # dtype kinds moved as they are (bfloat16 and records take the general path)


DECLINED = object()  # "take the general path" (None is a gather's result on a non-root)


def _moved(a) -> bool:
    return type(a) is _ndarray and a.dtype.kind in _MOVED


def exchange_fast(comm, fast, kind: int, x, out, op: str = ""):
    """Run kind on x through `fast`, or return DECLINED."""
    if type(x) is not _ndarray or x.nbytes > ONE_SHOT_CAP or b"LINKWISE_ALGO" in _ENV or b"LINKWISE_CHECK" in _ENV:
        return DECLINED
    dt = x.dtype
    if dt.kind not in _MOVED:
        return DECLINED
    n = comm.size
    code = 0
    if kind == ALL_GATHER:
        if out is None:
            out = np.empty(gathered_shape(x.shape, n), dtype=dt)
        elif type(out) is not _ndarray or out.dtype != dt or out.size != n * x.size:
            return DECLINED
    else:
        if x.size % n:
            return DECLINED
        if kind == REDUCE_SCATTER:
            code = _FAST_CODES_BY_OP.get(op, {}).get(x.dtype, -1)
            if code < 0:
                return DECLINED
            if out is None:
                out = np.empty(block_shape(x.shape, n), dtype=x.dtype)
            elif type(out) is not _ndarray or out.dtype != x.dtype or out.size * n != x.size:
                return DECLINED
        elif out is None:
            out = x
        elif type(out) is not _ndarray or out.dtype != x.dtype or out.size != x.size:
            return DECLINED
    try:
        fast.exchange(kind, x, out, code, comm.timeout)
    except (ValueError, TypeError):
        comm._skip_call()
        raise
    return out


def gather_fast(comm, fast, x, root, out):
    """gather through `fast` (all blocks within the one-shot area): out on root, None
    elsewhere; or DECLINED."""
    n = comm.size
    if (not _moved(x) or type(root) is not int or not 0 <= root < n or x.nbytes * n > ONE_SHOT_CAP
            or b"LINKWISE_ALGO" in _ENV or b"LINKWISE_CHECK" in _ENV):
        return DECLINED
    if comm.rank != root:
        if out is not None:
            return DECLINED  # checked on the general path, as on the root
    elif out is None:
        out = np.empty(gathered_shape(x.shape, n), dtype=x.dtype)
    elif type(out) is not _ndarray or out.dtype != x.dtype or out.size != n * x.size or not out.flags.writeable:
        return DECLINED
    try:
        fast.gather(x, out, root, comm.timeout)
    except (ValueError, TypeError):  # the buffer checks of the native call
        comm._skip_call()
        raise
    return out


def scatter_fast(comm, fast, x, root, out):
    """scatter through `fast` (all blocks within the one-shot area), or DECLINED."""
    n = comm.size
    if (type(root) is not int or not 0 <= root < n or b"LINKWISE_ALGO" in _ENV or b"LINKWISE_CHECK" in _ENV):
        return DECLINED
    if comm.rank == root:
        if not _moved(x) or x.nbytes > ONE_SHOT_CAP or x.size % n:
            return DECLINED
        if out is None:
            out = np.empty(block_shape(x.shape, n), dtype=x.dtype)
        elif not _moved(out) or out.dtype != x.dtype or out.size * n != x.size or not out.flags.writeable:
            return DECLINED
    elif x is not None or not _moved(out) or out.nbytes * n > ONE_SHOT_CAP or not out.flags.writeable:
        return DECLINED  # a non-root's x (its shape may size out) takes the general path
    try:
        fast.scatter(x if comm.rank == root else None, out, root, comm.timeout)
    except (ValueError, TypeError):
        comm._skip_call()
        raise
    return out


def all_reduce_bf16_fast(comm, fast, x, op, out):
    """The latency path of a bfloat16 all_reduce (a V2 array, or ml_dtypes' bfloat16 once one
    was seen), which the executor's all_reduce_fast declines (NumPy exports V2 as pad bytes,
    '2x', and no buffer of ml_dtypes' bfloat16): its call on uint16 views; NotImplemented
    where it declines too."""
    try:
        code = _FAST_CODES_BY_OP[op][x.dtype]
    except (KeyError, TypeError):
        if _dtype_name(x, None) == "bfloat16":
            fast_path_bf16(x.dtype)  # ml_dtypes' bfloat16: served from the next call
        return NotImplemented
    if code >= 0:
        return NotImplemented  # served natively when it is served at all
    if out is None:
        bits = x.view(_uint16)
        fast.all_reduce(bits, bits, -code, comm.timeout)
        return x
    if type(out) is _ndarray and out.dtype == x.dtype:
        fast.all_reduce(x.view(_uint16), out.view(_uint16), -code, comm.timeout)
        return out
    return NotImplemented

"""Argument plumbing of the collectives: codes shared with the native layer, array and dtype
checks, and the request object of async collectives. Used by collectives.py only.

Contract: the integer codes here (KINDS, OPS, DTYPES, ALGO_CODES) must match the enums of
csrc/algo/coll.h and csrc/core/reduce.h, which bind_coll.cc casts them to.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Optional

import numpy as np

from . import _gpu_coll, config
from ._request import CollectiveRequest  # noqa: F401 - used by collectives.py

KINDS = {"all_reduce": 0, "broadcast": 1, "reduce": 2, "all_gather": 3, "reduce_scatter": 4,
         "all_to_all": 5, "gather": 6, "scatter": 7, "barrier": 8}
OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4, "band": 5, "bor": 6, "bxor": 7}
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "int64": 3, "float16": 4, "bfloat16": 5,
          "float32": 6, "float64": 7}
ALGO_CODES = {"ring": 1, "tree": 2, "chain": 3, "direct": 4}
_REDUCING = ("all_reduce", "reduce", "reduce_scatter")
_U8 = DTYPES["uint8"]
# (NumPy dtype, op) -> (dtype code, op code) for the all_reduce fast path (valid pairs only).
_FAST_CODES = {(np.dtype(d), o): c * 8 + oc for d, c in DTYPES.items() if d != "bfloat16"
               for o, oc in OPS.items() if o in ("sum", "prod", "min", "max", "avg") or d.startswith(("int", "uint"))}
# The same as op -> {NumPy dtype: code}: looked up without building and hashing a tuple
# (~90 ns less per call on the 2-core VM; the 8-byte all_reduce is timed against Open MPI).
_FAST_CODES_BY_OP: dict = {}
for (_dt, _op), _code in _FAST_CODES.items():
    _FAST_CODES_BY_OP.setdefault(_op, {})[_dt] = _code


def fast_path_bf16(dt: np.dtype) -> None:
    """Serve dt (a bfloat16 form: V2, or ml_dtypes' once an array of it was seen) on the fast
    path. Neither exports a buffer, so its code is negative: the call goes through uint16 views."""
    for op in ("sum", "prod", "min", "max", "avg"):
        _FAST_CODES_BY_OP[op][dt] = -(DTYPES["bfloat16"] * 8 + OPS[op])


fast_path_bf16(np.dtype("V2"))
_NAMES = {np.dtype(d): d for d in DTYPES if d != "bfloat16"}
# An unstructured 2-byte void array is bfloat16 (the issue's "NumPy void" form; ml_dtypes'
# bfloat16 is named so by NumPy). Structured dtypes never compare equal to it: not reducible.
_NAMES[np.dtype("V2")] = "bfloat16"
try:
    _ENV = os.environ._data  # bytes -> bytes on POSIX; a dict lookup instead of ~0.5 us per get
    _ENC = os.fsencode
except AttributeError:  # pragma: no cover - not CPython/POSIX
    _ENV, _ENC = None, str


def _env_set(name: bytes) -> bool:
    """True when the environment variable is set and non-empty (cheap; read per call)."""
    if _ENV is not None:
        return bool(_ENV.get(name))
    return bool(os.environ.get(name.decode()))


def check_on() -> bool:
    """LINKWISE_CHECK's value (read per call): set to 0/false/off it is off, as when unset."""
    return _env_set(b"LINKWISE_CHECK") and bool(config.get("LINKWISE_CHECK"))


_REFUSED = -1  # the kind in a refusal's check row


def check_refused(comm) -> None:
    """LINKWISE_CHECK, a collective this rank refused (ValueError, TypeError) before its check:
    take part in the check exchange anyway, with a row no call has, so the ranks that did
    enter the call raise at once instead of waiting for this rank until the timeout. Errors
    of the exchange itself are left to the caller's next call (it raises the refusal)."""
    try:
        _check_rows(comm, [_REFUSED, 0, 0, -1, 0, 0])
    except Exception:  # noqa: BLE001 - the refusal is what the caller reports
        pass


def _check_rows(comm, row: list) -> np.ndarray:
    """The check exchange: every rank's row (a host all_gather under the next collective
    number), as a (ranks x len(row)) array."""
    mine = np.array(row, dtype=np.int64)
    everyone = np.empty(comm.size * mine.size, dtype=np.int64)
    _native_module().coll(comm._native, KINDS["all_gather"], mine, everyone, _U8, 0, 0,
                          comm._next_seq(), 1, 1 << 20, [], -1, [], comm.timeout)
    return everyone.reshape(comm.size, mine.size)


def check_agree(comm, kind: str, count: int, dtype: str, op: str, root: int, device: str) -> None:
    """LINKWISE_CHECK: every rank sends its call's descriptor (kind, count, dtype, op, root,
    host or CUDA) to every other through a host all_gather, and every rank raises the same
    ValueError if they differ. A collective step: all ranks must reach it in the same order,
    which holds whenever LINKWISE_CHECK is set on every rank (host and GPU calls both check)."""
    if dtype == "void16":  # an unstructured 2-byte void array is bfloat16, as ml_dtypes' is
        dtype = "bfloat16"
    try:
        dcode = DTYPES[dtype] if dtype in DTYPES else 100 + np.dtype(dtype).num
    except TypeError:  # a name NumPy does not know (e.g. a torch float8): compare by bytes only
        dcode = 99
    dev = 1 if device == "cuda" else 0
    rows = _check_rows(comm, [KINDS[kind], count, dcode, OPS.get(op, -1), root, dev])
    if (rows == rows[0]).all():
        return
    names = {v: k for k, v in KINDS.items()}
    opn = {v: k for k, v in OPS.items()}

    def dtype_text(d: int) -> str:
        if d in DTYPES.values():
            return next(k for k, v in DTYPES.items() if v == d)
        if d >= 100:  # a NumPy dtype by its type number
            by_num = {np.dtype(t).num: np.dtype(t).name for t in set(np.sctypeDict.values())}
            if d - 100 in by_num:
                return by_num[d - 100]
        return "(a dtype NumPy does not name)" if d == 99 else f"#{d}"

    desc = "; ".join(f"rank {r}: refused its arguments (see its error)" if k == _REFUSED else
                     f"rank {r}: {names.get(int(k), k)} count={c} dtype={dtype_text(int(d))} op={opn.get(int(o), '-')} "
                     f"root={ro} {'CUDA' if dv else 'host'} array"
                     for r, (k, c, d, o, ro, dv) in enumerate(rows.tolist()))
    raise ValueError(f"rank {comm.rank}: {kind}: the ranks disagree ({desc}); call each collective with "
                     "the same kind, size, dtype, op and root, and arrays on the same kind of device, "
                     "on every rank")


_NATIVE = None


def _native_module():
    """The extension module, imported on first use (a function-level import costs ~0.4 us a call)."""
    global _NATIVE
    if _NATIVE is None:
        from . import _native
        _NATIVE = _native
    return _NATIVE


def gathered_shape(shape: tuple, size: int) -> tuple:
    """Shape of `size` arrays of `shape` stacked along the first axis (all_gather, gather): (k, m)
    gives (size * k, m); a 0-d array counts as one element."""
    return (size * (shape[0] if shape else 1),) + tuple(shape[1:])


def block_shape(shape: tuple, size: int) -> tuple:
    """Shape of one rank's block of an array of `shape` split into `size` blocks (reduce_scatter,
    scatter): along the first axis when it divides, else flat. So x of shape (size * k, m)
    gives (k, m), undoing gathered_shape."""
    if shape and shape[0] % size == 0:
        return (shape[0] // size,) + tuple(shape[1:])
    return (math.prod(shape) // size,)


def _as_array(x: Any, what: str, name: str = "x") -> np.ndarray:
    """x as a C-contiguous NumPy array sharing its memory (no copy), else ValueError/TypeError;
    `name` is the argument's name in the message."""
    if isinstance(x, np.ndarray):
        a = x
    else:
        try:
            a = np.asarray(memoryview(x))
        except TypeError:
            from .comm import _as_buffer
            a = _as_buffer(x, what)  # a NumPy view; a CPU torch.bfloat16 tensor comes typed bfloat16
    if not a.flags.c_contiguous:
        fix = f"{name}.contiguous()" if a is not x and hasattr(x, "contiguous") else f"np.ascontiguousarray({name})"
        raise ValueError(f"{what}: {name} is not C-contiguous; pass {fix}")
    if a.dtype.hasobject:  # refused here, before the call takes its number (not natively, after)
        raise TypeError(f"{what}: {name} holds Python objects ({a.dtype}); only plain numbers can be sent")
    return a


def _host_out(out: Any, what: str) -> np.ndarray:
    """out for a host collective; a CUDA out with a host x is a clear TypeError."""
    if type(out) is not np.ndarray and _gpu_coll.is_cuda(out):
        raise _gpu_coll.host_device_mix(what, False)
    return _as_array(out, what, "out")


def _dtype_name(a: np.ndarray, dtype: Optional[str]) -> str:
    if dtype is not None:
        dtype = str(dtype)
        if dtype not in DTYPES:
            raise TypeError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        if np.dtype(dtype if dtype != "bfloat16" else np.uint16).itemsize != a.itemsize:
            raise TypeError(f"dtype={dtype!r} does not match the array's {a.itemsize}-byte elements")
        if not a.dtype.isnative:  # dtype= names the values' type, not their byte order
            raise _byte_order_error(a)
        return dtype
    name = _NAMES.get(a.dtype)
    if name is None and not a.dtype.isnative:  # '>f4' is named float32, but is not reduced as one
        raise _byte_order_error(a)
    return name if name is not None else _dtype_label(a.dtype)


def _value_type(dt: np.dtype) -> str:
    """The values' type name, never raising: V2 is bfloat16, '>f4' is float32 (the byte order
    is the dtype's; compare dtypes for that)."""
    name = _NAMES.get(dt)
    return name if name is not None else _dtype_label(dt)


def _shown(dt: np.dtype) -> str:
    """A dtype for an error message: its name, and its byte order where that is not native
    (both '<f4' and '>f4' are named float32)."""
    if dt.isnative or dt.itemsize == 1:
        return _value_type(dt)
    return f"{_value_type(dt)} in the other byte order ({dt.str})"


def _byte_order_error(a: np.ndarray) -> TypeError:
    return TypeError(f"the array's byte order is not this machine's ({a.dtype.str}); reductions need "
                     f"native byte order: x.astype(x.dtype.newbyteorder('='))")


_LABELS: dict = {}


def _dtype_label(dt: np.dtype) -> str:
    """dt.name, cached: NumPy computes it through issubdtype on every access (~2 us)."""
    label = _LABELS.get(dt)
    if label is None:
        label = _LABELS[dt] = dt.name
    return label


def _raw(a: np.ndarray) -> np.ndarray:
    """A view the native layer can take through the buffer protocol (bfloat16 as uint16)."""
    if a.dtype.kind == "V":  # bfloat16 (ml_dtypes) and other records; dtype.name is slow
        return a.view(np.uint16 if a.itemsize == 2 else np.uint8)
    return a


# Set on an argument error the native layer raised after the call took its number (and that
# refusal was announced under it): CollectivesMixin._refused_under_number.
REFUSED_UNDER_NUMBER = "_linkwise_refused_under_number"


def _skips_on_argument_error(method):
    """Wraps a collective: when its arguments raise on this rank (ValueError, TypeError) before
    it reached the native layer, this rank numbers its calls as if it had run (_skip_call). If
    every rank refused it (the same arguments everywhere), they stay in step and go on; if only
    this rank did, the others are in the call: those waiting there for this rank raise at once
    (_skip_call tells them), and this rank's next call meets it under another number, which
    raises on both sides (a mismatch) instead of pairing with it. A call refused natively
    after it took its number on the message path (CollectivesMixin._refused_under_number) was
    published under that number already: no second number is taken. A call that failed
    natively otherwise has already failed the communicator (every later call raises), so the
    skip changes nothing there (nor is a refusal published then)."""
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        seq = self._coll_seq
        try:
            return method(self, *args, **kwargs)
        except (ValueError, TypeError) as exc:
            if getattr(exc, REFUSED_UNDER_NUMBER, False):
                raise  # refused under the number it had taken, and the peers told (_run)
            # Refused before LINKWISE_CHECK's exchange (it takes a number): join it anyway.
            if self._coll_seq == seq and check_on() \
                    and self.__dict__.get("_native") is not None and self.size > 1:
                check_refused(self)
            self._skip_call()
            raise
    return guarded


def _check_tunables() -> None:
    """Raise ValueError (naming the variable and its value) when LINKWISE_CHUNK_SIZE or
    LINKWISE_ALGO is set to something that does not parse. The shared-memory branch of _run,
    the GPU dispatch and the setup of the latency paths (the first collective) call it; the
    point-to-point branch parses both in _schedule. So a bad value fails every kind of
    collective alike, even those it would not change."""
    if _env_set(b"LINKWISE_CHUNK_SIZE"):
        config.get("LINKWISE_CHUNK_SIZE")
    if _env_set(b"LINKWISE_ALGO"):
        config.get("LINKWISE_ALGO")

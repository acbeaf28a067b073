"""Pieces every benchmark shares: size sweeps, dtypes, ops, busbw factors, buffer layouts.

Nothing here does I/O or talks to another process. Sizes follow nccl-tests: ``-b`` to ``-e``,
multiplied by ``-f`` when it is above 1, else stepped by ``-i`` bytes.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

try:  # NumPy has no bfloat16: ml_dtypes' (its kind is "V", so test floats with is_float)
    import ml_dtypes
    BF16: Optional[np.dtype] = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BF16 = None

# nccl-tests' type names (and a few aliases) -> NumPy dtype. bfloat16 only with ml_dtypes.
DTYPES: dict[str, np.dtype] = {
    "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32), "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64), "uint64": np.dtype(np.uint64),
    "half": np.dtype(np.float16), "float": np.dtype(np.float32), "double": np.dtype(np.float64),
    **({"bfloat16": BF16} if BF16 is not None else {}),
}
DTYPE_ALIASES = {"float16": "half", "float32": "float", "float64": "double", "char": "int8",
                 "int": "int32", "bf16": "bfloat16"}
OPS = ("sum", "prod", "max", "min", "avg")

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
               "all_to_all", "sendrecv")
HAS_REDOP = {"all_reduce", "reduce", "reduce_scatter"}
HAS_ROOT = {"broadcast", "reduce"}
# Collectives whose size is split into one block per rank (size = n * per-rank block).
PER_RANK_BLOCKS = {"all_gather", "reduce_scatter", "all_to_all"}


def busbw_factor(coll: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor.

    all_reduce moves 2(n-1)/n of the data per rank (reduce-scatter + all-gather);
    all_gather, reduce_scatter and all_to_all (n-1)/n; broadcast, reduce, sendrecv 1."""
    n = int(nranks)
    if n < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    if coll == "all_reduce":
        return 2.0 * (n - 1) / n
    if coll in PER_RANK_BLOCKS:
        return (n - 1) / n
    if coll in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {coll!r}; expected one of {', '.join(COLLECTIVES)}")


def parse_size(text: str) -> int:
    """'8', '64K', '1M', '2G', '4MiB', '1KB' -> bytes (powers of 1024)."""
    t = str(text).strip().upper()
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and len(t) > len(suffix):
            t = t[: -len(suffix)]
            break
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    if mult > 1:
        t = t[:-1]
    value = int(float(t) * mult)
    if value < 0:
        raise ValueError(f"size must be >= 0, got {text!r}")
    return value


def sweep(minbytes: int, maxbytes: int, factor: float = 2.0, step: int = 1 << 20) -> list[int]:
    """Sizes from minbytes to maxbytes inclusive: times factor if factor > 1, else + step."""
    if maxbytes < minbytes:
        raise ValueError(f"-e {maxbytes} is smaller than -b {minbytes}")
    out, size = [], max(0, minbytes)
    while size <= maxbytes:
        out.append(size)
        if factor > 1:
            nxt = int(size * factor) if size > 0 else 1
            size = nxt if nxt > size else size + 1
        else:
            if step <= 0:
                break
            size += step
    return out


def is_float(dtype: np.dtype) -> bool:
    """A floating-point type, bfloat16 included (ml_dtypes' has kind "V")."""
    return dtype.kind == "f" or (BF16 is not None and dtype == BF16)


def resolve_dtypes(text: str) -> list[str]:
    """-d: comma-separated names or aliases, or all (bfloat16 only where ml_dtypes imports)."""
    names = list(DTYPES) if text == "all" else [DTYPE_ALIASES.get(t, t) for t in text.split(",")]
    for name in names:
        if name == "bfloat16" and BF16 is None:
            raise ValueError("-d bfloat16 needs ml_dtypes (NumPy has no bfloat16): pip install ml_dtypes")
        if name not in DTYPES:
            raise ValueError(f"unknown type {name!r}; expected one of {', '.join(DTYPES)} or all")
    return names


def resolve_ops(text: str) -> list[str]:
    names = list(OPS) if text == "all" else text.split(",")
    for name in names:
        if name not in OPS:
            raise ValueError(f"unknown op {name!r}; expected one of {', '.join(OPS)} or all")
    return names


def counts(coll: str, nbytes: int, itemsize: int, nranks: int) -> Optional[tuple[int, int]]:
    """(total elements, elements per rank block) for a test size, or None if it is too small.

    For the per-rank-block collectives the total is rounded down to a multiple of nranks."""
    total = nbytes // itemsize
    if coll in PER_RANK_BLOCKS:
        block = total // nranks
        if block == 0 and nbytes > 0:
            return None
        return block * nranks, block
    return total, total


def input_values(coll: str, op: str, rank: int, n: int, dtype: np.dtype) -> np.ndarray:
    """Rank ``rank``'s deterministic input of n elements: small integers, exact in every dtype."""
    i = np.arange(n, dtype=np.int64)
    if op == "prod":
        vals = 1 + ((i + rank) % 3 == 0)  # ones and twos: a product of 8 ranks stays <= 256
    else:
        vals = (i * 7 + rank * 3) % 11 + 1
    return vals.astype(dtype)


def reduce_reference(stack: np.ndarray, op: str, dtype: np.dtype) -> np.ndarray:
    """Reduce rank inputs (axis 0) as the collective should, in the element type."""
    if op == "sum":
        return stack.sum(axis=0, dtype=dtype)
    if op == "prod":
        return stack.prod(axis=0, dtype=dtype)
    if op == "max":
        return stack.max(axis=0)
    if op == "min":
        return stack.min(axis=0)
    if op == "avg":
        s = stack.astype(np.float64).sum(axis=0) / stack.shape[0]
        return s.astype(dtype) if is_float(dtype) else np.floor(s).astype(dtype)
    raise ValueError(op)


def count_wrong(got: np.ndarray, want: np.ndarray, op: str = "sum") -> int:
    """Elements of got that differ from want (avg on integers may round either way by 1;
    floats within 1e-3, bfloat16, with its 8-bit significand, within 2**-7)."""
    if got.shape != want.shape:
        return int(max(got.size, want.size))
    if is_float(got.dtype):
        tol = 2.0 ** -7 if got.dtype.kind == "V" else 1e-3  # "V": bfloat16
        bad = ~np.isclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    elif op == "avg":
        bad = np.abs(got.astype(np.int64) - want.astype(np.int64)) > 1
    else:
        bad = got != want
    return int(np.count_nonzero(bad))

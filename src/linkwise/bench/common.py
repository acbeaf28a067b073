"""Pieces every benchmark shares: size sweeps, dtypes, ops, busbw factors, buffer layouts.

Nothing here does I/O or talks to another process. Sizes follow nccl-tests: ``-b`` to ``-e``,
multiplied by ``-f`` when it is above 1, else stepped by ``-i`` bytes.
"""
from __future__ import annotations

import itertools
from typing import Iterator, Optional

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
OPS = ("sum", "prod", "max", "min", "avg")  # nccl-tests' five; what -o all means
BITWISE_OPS = ("band", "bor", "bxor")  # linkwise's own; named explicitly (-o band,bxor)
# Types linkwise reduces (collectives._redop); uint32 / uint64 it moves but cannot reduce.
REDUCIBLE = tuple(t for t in DTYPES if t not in ("uint32", "uint64"))
# Types linkwise's bitwise ops take (collectives._redop).
BITWISE_TYPES = ("int8", "uint8", "int32", "int64")
SIZE_HINT = "not a size (use e.g. 8, 64K, 1M, 2G)"

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


def parse_size(text: str, flag: str = "size") -> int:
    """'8', '64K', '1M', '2G', '4MiB', '1KB' -> bytes (powers of 1024).

    Anything else (negative, NaN, 'abc', '1T') raises ValueError naming ``flag`` and the
    user's text: ``-b abc: not a size (use e.g. 8, 64K, 1M, 2G)``."""
    t = str(text).strip().upper()
    for suffix in ("IB", "B"):
        if t.endswith(suffix) and len(t) > len(suffix):
            t = t[: -len(suffix)]
            break
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    if mult > 1:
        t = t[:-1]
    try:
        number = float(t)
    except ValueError:
        number = float("nan")
    if not (0 <= number < float("inf")):  # also NaN
        raise ValueError(f"{flag} {text}: {SIZE_HINT}")
    return int(number * mult)


def _sizes(minbytes: int, maxbytes: int, factor: float, step: int) -> Iterator[int]:
    size = max(0, minbytes)
    while size <= maxbytes:
        yield size
        if factor > 1:
            nxt = int(size * factor) if size > 0 else 1
            size = nxt if nxt > size else size + 1
        else:
            if step <= 0:
                break
            size += step


def sweep(minbytes: int, maxbytes: int, factor: float = 2.0, step: int = 1 << 20) -> list[int]:
    """Sizes from minbytes to maxbytes inclusive: times factor if factor > 1, else + step."""
    if maxbytes < minbytes:
        raise ValueError(f"-e {maxbytes} is smaller than -b {minbytes}")
    return list(_sizes(minbytes, maxbytes, factor, step))


# Sizes one sweep may have. Each costs a row and at least -w + -n + -c calls of each variant;
# far more is a typo (-i 1 for -i 1M: a billion sizes, whose list alone filled the memory).
MAX_SIZES = 100_000


def sweep_count(minbytes: int, maxbytes: int, factor: float, step: int,
                limit: int = MAX_SIZES) -> int:
    """How many sizes :func:`sweep` gives, without making them; above ``limit`` only some
    number above it (counting stops there)."""
    if maxbytes < max(0, minbytes):
        return 0
    if factor <= 1:
        return 1 if step <= 0 else (maxbytes - max(0, minbytes)) // step + 1
    return sum(1 for _ in itertools.islice(_sizes(minbytes, maxbytes, factor, step), limit + 1))


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
    """-o: comma-separated ops, or all = nccl-tests' five arithmetic ops (never the bitwise
    ones, so that -o all means the same sweep whatever -d is)."""
    names = list(OPS) if text == "all" else text.split(",")
    for name in names:
        if name not in OPS + BITWISE_OPS:
            raise ValueError(f"-o {text}: unknown op {name!r}; expected one of "
                             f"{', '.join(OPS + BITWISE_OPS)} or all")
    return names


def point_na(coll: str, tname: str, op: str) -> Optional[str]:
    """Why no system can run this (collective, type, op) point, or None. A bitwise op on a
    floating-point type is meaningless everywhere (MPI and Gloo would raise, not decline), so
    the sweep shows such points as n/a without calling any system."""
    if coll in HAS_REDOP and op in BITWISE_OPS and is_float(DTYPES[tname]):
        return f"{op} is for integer types"
    return None


def check_plan(coll: str, dtypes: list[str], ops: list[str]) -> None:
    """Refuse up front (ValueError) a reducing sweep in which linkwise can measure no point:
    only types it cannot reduce (uint32, uint64), or only bitwise ops and no type they take.
    A mix is allowed; the points it cannot run show n/a (each with its reason)."""
    if coll not in HAS_REDOP:
        return  # -o does not apply (redop none), every type moves
    if not any(t in REDUCIBLE for t in dtypes):
        raise ValueError(f"-d {','.join(dtypes)}: linkwise cannot reduce {' or '.join(dtypes)} "
                         f"({coll} reduces); use one of {', '.join(REDUCIBLE)}")
    if not any(op in OPS for op in ops) and not any(t in BITWISE_TYPES for t in dtypes):
        raise ValueError(f"-o {','.join(ops)}: bitwise ops need an integer type "
                         f"(-d {', '.join(BITWISE_TYPES)}); -d {','.join(dtypes)} has none")


def counts(coll: str, nbytes: int, itemsize: int, nranks: int) -> tuple[int, int]:
    """(total elements, elements per rank block) for a test size.

    For the per-rank-block collectives the total is rounded down to a multiple of nranks; a
    size below one element per rank gives (0, 0): the collective runs on empty buffers and
    the row shows size 0, count 0, as in nccl-tests (never a dropped row)."""
    total = nbytes // itemsize
    if coll in PER_RANK_BLOCKS:
        block = total // nranks
        return block * nranks, block
    return total, total


def shown_count(coll: str, total: int, block: int) -> int:
    """nccl-tests' count column: elements per rank for all_gather, reduce_scatter and
    all_to_all (whose size column is the whole buffer, nranks blocks), else the total."""
    return block if coll in PER_RANK_BLOCKS else total


def page_aligned(a: np.ndarray) -> np.ndarray:
    """A copy of a that starts on a 4 KiB page, as OSU's benchmarks place their buffers.

    Without it, where an array lands depends on each process's heap history, which differs
    between the systems compared; a copy whose destination sits 1-31 bytes past its source
    modulo 4 KiB runs several times slower on some CPUs (csrc/core/copy.h), so a run could
    win or lose by placement alone. Aligned, every system sees the same distances."""
    buf = np.empty(a.nbytes + 4096, np.uint8)
    start = (-buf.ctypes.data) % 4096
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def input_values(coll: str, op: str, rank: int, n: int, dtype: np.dtype, seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s deterministic input of n elements: small integers, exact in every dtype.
    ``seed`` shifts the pattern, so that each check iteration (``-c N``) moves other values
    than the one before (a result left over from it does not pass)."""
    i = np.arange(n, dtype=np.int64) + seed
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
    bitwise = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}.get(op)
    if bitwise is not None:
        return bitwise.reduce(stack, axis=0).astype(dtype)
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

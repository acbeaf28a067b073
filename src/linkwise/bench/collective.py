"""nccl-tests-style sweep of one collective on one backend (runs on every rank).

For each size, type, op and root: out-of-place then in-place, each timed as ``-w`` warm-up
calls, a barrier, ``-n`` timed calls; the time reported is the mean per call, the max over
ranks. With ``-c N`` (N >= 1) every rank then, up to N times as nccl-tests does, refills its
inputs (other values each time), runs the operation once more and counts the elements that
differ from a NumPy reference (summed over ranks); the first iteration with wrong elements
ends the check and gives the row's count.

Sizes are nccl-tests': for all_gather, reduce_scatter and all_to_all ``size`` is the whole
buffer (n blocks of size/n bytes), rounded down to a multiple of n elements, and ``count``
the elements of one block (per rank). ``-w`` counts the untimed first call that probes
whether the system has the form (:func:`first_call`): ``-w 0`` and ``-w 1`` both make that
one call, which also sets up the connections, before the timed ones.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from . import common
from .backends import Backend, Unsupported, first_call, inplace_views, time_loop


def _inputs(coll: str, op: str, rank: int, size: int, total: int, block: int, dtype, root: int):
    """(send, recv) filled as rank's inputs, with recv holding this rank's in-place input; both
    page-aligned (common.page_aligned)."""
    send, recv = _unaligned_inputs(coll, op, rank, size, total, block, dtype, root)
    return common.page_aligned(send), common.page_aligned(recv)


def _unaligned_inputs(coll: str, op: str, rank: int, size: int, total: int, block: int, dtype,
                      root: int, seed: int = 0):
    if coll == "all_gather":
        send = common.input_values(coll, op, rank, block, dtype, seed)
        recv = np.zeros(total, dtype)
        recv[rank * block:(rank + 1) * block] = send
        return send, recv
    if coll == "reduce_scatter":
        return common.input_values(coll, op, rank, total, dtype, seed), np.zeros(block, dtype)
    send = common.input_values(coll, op, rank, total, dtype, seed)
    if coll == "broadcast":
        recv = send.copy() if rank == root else np.zeros(total, dtype)
        return send, recv
    if coll in ("all_reduce", "reduce", "all_to_all", "sendrecv"):
        return send, send.copy()
    return send, np.zeros(total, dtype)


def expected(coll: str, op: str, rank: int, size: int, total: int, block: int, dtype,
             root: int, seed: int = 0) -> Optional[np.ndarray]:
    """What this rank's result must be (inputs made with ``seed``); None where nothing is
    defined (reduce off root)."""
    def inp(r, n):
        return common.input_values(coll, op, r, n, dtype, seed)
    if coll == "all_reduce":
        return common.reduce_reference(np.stack([inp(r, total) for r in range(size)]), op, dtype)
    if coll == "reduce":
        if rank != root:
            return None
        return common.reduce_reference(np.stack([inp(r, total) for r in range(size)]), op, dtype)
    if coll == "broadcast":
        return inp(root, total)
    if coll == "all_gather":
        return np.concatenate([inp(r, block) for r in range(size)]) if size else inp(0, 0)
    if coll == "reduce_scatter":
        full = common.reduce_reference(np.stack([inp(r, total) for r in range(size)]), op, dtype)
        return full[rank * block:(rank + 1) * block]
    if coll == "all_to_all":
        return np.concatenate([inp(r, total)[rank * block:(rank + 1) * block] for r in range(size)])
    if coll == "sendrecv":
        return inp((rank - 1) % size, total)
    raise ValueError(coll)


def _one_variant(backend: Backend, coll: str, dtype, op: str, root: int, total: int, block: int,
                 inplace: bool, iters: int, warmup: int, check: int) -> dict:
    """Time (and check) one variant; {'na': reason} when the system has no such form.

    check: how many check iterations (nccl-tests' ``-c``), each on inputs of its own seed; the
    first that finds wrong elements ends them and gives the count (0: no check)."""
    rank, size = backend.rank, backend.size
    send, recv = _inputs(coll, op, rank, size, total, block, dtype, root)
    try:
        fn = backend.bind(coll, send, recv, inplace, op, root)
    except Unsupported as exc:
        return {"na": str(exc)}
    why = first_call(fn)
    if why is not None:
        return {"na": why}
    timer = getattr(backend, "timer", None)  # GPU backends time with CUDA events
    try:
        seconds = (timer(fn, iters, max(0, warmup - 1)) if timer is not None
                   else time_loop(backend, fn, iters, max(0, warmup - 1)))
    except Unsupported as exc:  # e.g. not capturable in a CUDA graph (GPU --graph)
        return {"na": str(exc)}
    wrong = 0
    for seed in range(1, int(check) + 1):  # seed 0 made the timed calls' inputs
        fresh_send, fresh_recv = _unaligned_inputs(coll, op, rank, size, total, block, dtype,
                                                   root, seed)
        send[...] = fresh_send
        recv[...] = fresh_recv
        want = expected(coll, op, rank, size, total, block, dtype, root, seed)
        if not inplace and want is not None:
            _poison(recv, want)
        if timer is not None:  # device buffers: bind again to upload the fresh inputs
            fn = backend.bind(coll, send, recv, inplace, op, root)
        backend.barrier()
        fn()
        mine = 0
        if want is not None:
            got = backend.result_view(coll, send, recv, inplace)
            mine = common.count_wrong(got, want, op)
        wrong = backend.sum_over_ranks(mine)  # the same on every rank: all stop together
        if wrong:
            break
    nbytes = total * dtype.itemsize
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return {"time_us": seconds * 1e6, "algbw": algbw,
            "busbw": algbw * common.busbw_factor(coll, size), "wrong": wrong if check else None}


def _poison(out: np.ndarray, want: np.ndarray) -> None:
    """Fill an out-of-place output with values that differ from the answer in every element
    (each byte complemented), so that an element the call never writes counts as wrong: the
    in-place inputs recv holds can already be the answer (a broadcast root's, all_to_all's
    own block, all_gather's own block)."""
    if out.nbytes == want.nbytes:
        out.view(np.uint8)[...] = ~np.ascontiguousarray(want).view(np.uint8).reshape(-1)


def run_sweep(backend: Backend, coll: str, sizes: list[int], dtypes: list[str], ops: list[str],
              root: int, iters: int, warmup: int, check: int,
              progress: Optional[Callable[[], None]] = None) -> list[dict]:
    """Every (size, type, op) point of the sweep on this backend; rows are valid on rank 0.

    Every size gives a row (one too small for an element per rank runs on empty buffers:
    size 0, count 0), except that sizes rounding to the same element count as an earlier one
    give no second row (-b 0: sizes 0, 1, 2 of float are all 0 elements): the earlier row
    lists them in ``merged_sizes`` (and the table says so), and the first size always gives
    a row. ``count`` is nccl-tests' (:func:`common.shown_count`); ``size`` is
    the bytes of the whole buffer. Points no system can run (:func:`common.point_na`) are
    rows whose cells are n/a, with the reason."""
    if coll not in common.COLLECTIVES:
        raise ValueError(f"unknown collective {coll!r}")
    rows: list[dict] = []
    op_list = ops if coll in common.HAS_REDOP else ["none"]
    # nccl-tests' order: the whole size sweep for each type, then each op.
    for tname in dtypes:
        dtype = common.DTYPES[tname]
        for op in op_list:
            seen: dict = {}  # total elements -> the row measured for it
            for nbytes in sizes:
                if progress:
                    progress()
                total, block = common.counts(coll, nbytes, dtype.itemsize, backend.size)
                if total in seen:  # not silent: the row names the sizes it stands for too
                    seen[total].setdefault("merged_sizes", []).append(nbytes)
                    continue
                row = {"size": total * dtype.itemsize, "count": common.shown_count(coll, total, block),
                       "type": tname, "redop": op, "root": root if coll in common.HAS_ROOT else -1}
                why = common.point_na(coll, tname, op)
                for key, inplace in (("oop", False), ("ip", True)):
                    row[key] = {"na": why} if why else _one_variant(
                        backend, coll, dtype, op if op != "none" else "sum", root, total, block,
                        inplace, iters, warmup, check)
                rows.append(row)
                seen[total] = row
    return rows


def sweep_points(coll: str, sizes: list[int], dtypes: list[str], ops: list[str]) -> int:
    return len(sizes) * len(dtypes) * (len(ops) if coll in common.HAS_REDOP else 1)


__all__ = ["run_sweep", "expected", "sweep_points", "inplace_views"]

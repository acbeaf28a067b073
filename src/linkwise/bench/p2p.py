"""OSU-style point-to-point tests between ranks 0 and 1 (other ranks wait at the barrier).

* latency: ping-pong; one-way latency is half the round trip (us).
* bandwidth: rank 0 posts a window of isends, rank 1 a window of irecvs; after each window
  rank 1 sends a 4-byte acknowledgement (as osu_bw). GB/s = size * window * iters / time.
* bibw: both ranks post a window of irecvs and isends at once (as osu_bibw); bytes both ways.

Iteration counts shrink with size so a 64 MiB point takes a fraction of a second:
``iters_for(size)``. All messages of a window share one buffer, page-aligned, as OSU does.

With ``check`` (``-c 1``, the default) the sent buffers hold a pattern that depends on the
size, and after the timed rounds (outside the timing) the received buffers are compared with
it: the row's ``wrong`` is the count of wrong bytes over its tests (rank 1's count reaches
rank 0 in one more message). Without it the buffers are zeros and ``wrong`` is absent.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from .backends import Backend
from .common import page_aligned

TESTS = ("latency", "bw", "bibw")
_LAT_BUDGET = 256 << 20    # bytes a latency point moves, at most (each way)
_BW_BUDGET = 1 << 30       # bytes a bandwidth point moves, at most


def lat_iters(size: int, iters: int) -> int:
    return max(10, min(iters, _LAT_BUDGET // max(1, size)))


def warmup_for(size: int, warmup: int) -> int:
    """Warm-up rounds: as asked for small sizes, about a tenth of the timed rounds for large."""
    return max(2, min(warmup, lat_iters(size, warmup * 10) // 10))


def window_for(size: int, window: int) -> int:
    if size <= 1 << 20:
        return window
    return max(4, min(window, (64 << 20) // size))


def bw_iters(size: int, window: int, iters: int) -> int:
    return max(5, min(max(10, iters // 10), _BW_BUDGET // max(1, size * window)))


def pattern(size: int) -> np.ndarray:
    """What rank 0 sends at this size: bytes that differ from zero and from one size to the
    next, so that a stale or partly written message shows up."""
    return ((np.arange(size, dtype=np.uint32) * 7 + size) % 251 + 1).astype(np.uint8)


def _wrong_bytes(got: np.ndarray, size: int) -> int:
    return int(np.count_nonzero(got != pattern(size)))


def _wrong_on_rank0(b: Backend, mine: int) -> int:
    """Rank 1's count of wrong bytes sent to rank 0 (outside the timing): the sum there."""
    count = np.array([mine], np.int64)
    if b.rank == 1:
        b.send(count, 0)
        return mine
    if b.rank == 0:
        other = np.zeros(1, np.int64)
        b.recv(other, 1)
        return mine + int(other[0])
    return 0


def latency(b: Backend, size: int, iters: int, warmup: int, check: bool = False):
    """One-way latency in microseconds (valid on rank 0); with check, (latency, wrong bytes):
    rank 1 returns what it received, so rank 0's buffer at the end holds rank 0's pattern only
    if both directions delivered it."""
    buf = page_aligned(np.zeros(size, np.uint8))  # as the collectives' (common.page_aligned)
    if check and b.rank == 0:
        buf[:] = pattern(size)
    n = lat_iters(size, iters)
    me = b.rank

    def rounds(k: int) -> None:
        for _ in range(k):
            if me == 0:
                b.send(buf, 1)
                b.recv(buf, 1)
            elif me == 1:
                b.recv(buf, 0)
                b.send(buf, 0)
    rounds(warmup_for(size, warmup))
    b.barrier()
    t0 = time.perf_counter()
    rounds(n)
    dt = time.perf_counter() - t0
    b.barrier()
    us = dt / n / 2 * 1e6
    if not check:
        return us
    return us, (_wrong_bytes(buf, size) if b.rank == 0 else 0)


def bandwidth(b: Backend, size: int, iters: int, warmup: int, window: int, bidir: bool,
              check: bool = False):
    """GB/s from rank 0 to rank 1 (bidir: both ways added; valid on rank 0); with check,
    (GB/s, wrong bytes in the receive buffers of ranks 0 and 1, valid on rank 0)."""
    sbuf = page_aligned(np.zeros(size, np.uint8))
    rbuf = page_aligned(np.zeros(size, np.uint8))
    if check:
        sbuf[:] = pattern(size)
    ack = np.zeros(4, np.uint8)
    w = window_for(size, window)
    n = bw_iters(size, w, iters)
    me = b.rank

    def windows(k: int) -> None:
        for _ in range(k):
            if me > 1:
                return
            peer = 1 - me
            if bidir:
                reqs = [b.irecv(rbuf, peer) for _ in range(w)]
                reqs += [b.isend(sbuf, peer) for _ in range(w)]
                b.waitall(reqs)
            elif me == 0:
                b.waitall([b.isend(sbuf, 1) for _ in range(w)])
                b.recv(ack, 1)
            else:
                b.waitall([b.irecv(rbuf, 0) for _ in range(w)])
                b.send(ack, 0)
    windows(max(1, min(warmup // 10, n // 5)))
    b.barrier()
    t0 = time.perf_counter()
    windows(n)
    dt = time.perf_counter() - t0
    b.barrier()
    moved = size * w * n * (2 if bidir else 1)
    gbps = moved / dt / 1e9
    if not check:
        return gbps
    receives = b.rank == 1 or (bidir and b.rank == 0)
    return gbps, _wrong_on_rank0(b, _wrong_bytes(rbuf, size) if receives else 0)


def run_sweep(b: Backend, sizes: list[int], tests: list[str], iters: int, warmup: int,
              window: int, progress: Optional[Callable[[], None]] = None,
              check: bool = False) -> list[dict]:
    """Rows {size, latency_us, bw_GBps, bibw_GBps} (tests not asked for are absent), and with
    check {wrong}: wrong bytes received over the row's tests (valid on rank 0)."""
    if b.size < 2:
        raise ValueError("the point-to-point benchmark needs at least 2 ranks")
    rows = []
    for size in sizes:
        row: dict = {"size": size}
        results = {}
        if "latency" in tests:
            results["latency_us"] = latency(b, size, iters, warmup, check)
        if "bw" in tests:
            results["bw_GBps"] = bandwidth(b, size, iters, warmup, window, False, check)
        if "bibw" in tests:
            results["bibw_GBps"] = bandwidth(b, size, iters, warmup, window, True, check)
        for key, value in results.items():
            row[key] = value[0] if check else value
        if check:
            row["wrong"] = sum(value[1] for value in results.values())
        rows.append(row)
        if progress:
            progress()
    return rows

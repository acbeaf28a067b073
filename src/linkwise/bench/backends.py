"""The one interface the benchmark loops drive, and its linkwise implementation.

A backend wraps one communication system on this rank. The timing loops in ``p2p.py`` and
``collective.py`` see only this interface, so linkwise, Gloo and Open MPI (``compare.py``)
run exactly the same sweep. Buffers are NumPy arrays; a backend that needs something else
(torch tensors) wraps them once in :meth:`Backend.bind`, outside the timed loop.

Contract of :meth:`Backend.bind`: returns a zero-argument callable that runs the collective
once on the given buffers, or raises :class:`Unsupported` (the same on every rank) when this
system has no such operation, dtype, op or in-place form.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from . import common

# Tags the harness uses for its own barrier and reductions (far from user tags).
_TAG_BARRIER = (1 << 61) + 11
_TAG_REDUCE = (1 << 61) + 12
_TAG_BCAST = (1 << 61) + 13
_REDUCIBLE = {common.DTYPES[t] for t in common.REDUCIBLE}


class Unsupported(Exception):
    """This system does not offer the requested operation (reported as n/a, not an error)."""


def inplace_views(coll: str, send: np.ndarray, recv: np.ndarray, rank: int, size: int):
    """(input, output) arrays of nccl-tests' in-place form of coll."""
    if coll in ("all_reduce", "broadcast", "reduce", "all_to_all", "sendrecv"):
        return recv, recv
    if coll == "all_gather":
        block = recv.size // size
        return recv[rank * block:(rank + 1) * block], recv
    if coll == "reduce_scatter":
        block = send.size // size
        return send, send[rank * block:(rank + 1) * block]
    raise Unsupported(f"{coll} has no in-place form here")


class Backend:
    """One rank's handle on a communication system (see the module docstring)."""

    name = "base"
    rank = 0
    size = 1

    # -- harness helpers (outside timed regions) -------------------------------------------
    def barrier(self) -> None:
        raise NotImplementedError

    def max_over_ranks(self, value: float) -> float:
        """The largest value over all ranks (valid at least on rank 0)."""
        raise NotImplementedError

    def sum_over_ranks(self, value: int) -> int:
        """The sum over all ranks, returned on every rank (the check iterations of ``-c N``
        stop on it, every rank at the same one)."""
        raise NotImplementedError

    # -- point-to-point --------------------------------------------------------------------
    def send(self, x: np.ndarray, peer: int) -> None:
        raise NotImplementedError

    def recv(self, x: np.ndarray, peer: int) -> None:
        raise NotImplementedError

    def isend(self, x: np.ndarray, peer: int) -> Any:
        raise NotImplementedError

    def irecv(self, x: np.ndarray, peer: int) -> Any:
        raise NotImplementedError

    def waitall(self, reqs: list) -> None:
        for r in reqs:
            r.wait()

    # -- collectives -----------------------------------------------------------------------
    def bind(self, coll: str, send: np.ndarray, recv: np.ndarray, inplace: bool, op: str,
             root: int) -> Callable[[], Any]:
        raise NotImplementedError

    def result_view(self, coll: str, send: np.ndarray, recv: np.ndarray, inplace: bool) -> np.ndarray:
        """Where the result lands (nccl-tests' layout unless a system differs)."""
        if not inplace:
            return recv
        return inplace_views(coll, send, recv, self.rank, self.size)[1]

    def close(self) -> None:
        pass


class LinkwiseBackend(Backend):
    """linkwise's Communicator. Harness barriers and reductions use point-to-point only, so
    the benchmark works before (and independently of) the collectives."""

    name = "linkwise"

    def __init__(self, comm=None):
        if comm is None:
            import linkwise
            comm = linkwise.init()
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size

    def available(self, coll: str) -> bool:
        if coll == "sendrecv":
            return True
        return callable(getattr(self.comm, coll, None))

    def _gather_reduce(self, value: float, fn) -> float:
        """Rank 0 receives every rank's value, combines them with fn, sends the result back."""
        c, buf = self.comm, np.array([value], np.float64)
        if self.size == 1:
            return value
        if self.rank == 0:
            acc = value
            for peer in range(1, self.size):
                c.recv(buf, peer, _TAG_REDUCE)
                acc = fn(acc, float(buf[0]))
            buf[0] = acc
            for peer in range(1, self.size):
                c.send(buf, peer, _TAG_BCAST)
            return acc
        c.send(buf, 0, _TAG_REDUCE)
        c.recv(buf, 0, _TAG_BCAST)
        return float(buf[0])

    def barrier(self) -> None:
        self._gather_reduce(0.0, max)

    def max_over_ranks(self, value: float) -> float:
        return self._gather_reduce(value, max)

    def sum_over_ranks(self, value: int) -> int:
        return int(self._gather_reduce(float(value), lambda a, b: a + b))

    def send(self, x, peer):
        self.comm.send(x, peer)

    def recv(self, x, peer):
        self.comm.recv(x, peer)

    def isend(self, x, peer):
        return self.comm.isend(x, peer)

    def irecv(self, x, peer):
        return self.comm.irecv(x, peer)

    def bind(self, coll, send, recv, inplace, op, root):
        c = self.comm
        if coll == "sendrecv":
            nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
            if inplace:  # nccl-tests' in-place sendrecv: sent from and received into recv
                return lambda: c.sendrecv_replace(recv, nxt, prv)

            def sendrecv():
                c.sendrecv(send, nxt, recv, prv)
            return sendrecv
        fn = getattr(c, coll, None)
        if not callable(fn):
            raise Unsupported(f"comm.{coll} is not available in this build")
        if coll in common.HAS_REDOP and send.dtype not in _REDUCIBLE:  # short n/a reason
            raise Unsupported(f"linkwise cannot reduce {send.dtype}")
        src, dst = inplace_views(coll, send, recv, self.rank, self.size) if inplace else (send, recv)
        # Plain calls, as the other systems' harnesses make (compare.py) and as a user writes
        # them: a call through fn(src, **kw) cost ~0.5 us more (its dict), a quarter of an
        # 8-byte all_reduce on the 2-core VM.
        with_out = not (inplace and coll in ("all_reduce", "broadcast", "reduce", "all_to_all"))
        if coll in ("all_reduce", "reduce_scatter"):
            return (lambda: fn(src, op, dst)) if with_out else (lambda: fn(src, op))
        if coll == "reduce":
            return (lambda: fn(src, root, op, dst)) if with_out else (lambda: fn(src, root, op))
        if coll == "broadcast":
            return (lambda: fn(src, root, dst)) if with_out else (lambda: fn(src, root))
        return (lambda: fn(src, dst)) if with_out else (lambda: fn(src))

    def close(self) -> None:
        self.comm.close()


def time_loop(backend: Backend, fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """Seconds per call of fn: warm up, barrier, time iters calls; the max over ranks."""
    for _ in range(warmup):
        fn()
    backend.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t0) / max(1, iters)
    return backend.max_over_ranks(dt)


def first_call(fn: Callable[[], Any]) -> Optional[str]:
    """Run fn once; returns None, or why the system does not support it (TypeError and
    NotImplementedError from a binding mean 'no such form'; other errors propagate)."""
    try:
        fn()
    except Unsupported as exc:
        return str(exc)
    except (TypeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None

"""Collective operations of a Communicator (issue 3).

Every collective is called by every rank of the communicator, in the same order. Arrays are
NumPy arrays or anything with the buffer protocol / ``__dlpack__`` (viewed through NumPy; a CPU
torch.bfloat16 tensor through its bits, see _bf16); they must be C-contiguous. Results land in
place (``out=None``) or in ``out``, and the collective returns the caller's own object there:
the x it was given, or the out it was given (a torch tensor stays a tensor, not a NumPy view).
Collectives whose result has another size (all_gather, reduce_scatter, gather, scatter)
allocate a NumPy array when ``out`` is not given and return it; gather returns None off root.

Forms: blocking (the default; the GIL is released while the native executor runs),
``async_op=True`` (returns a :class:`CollectiveRequest`; ``wait()`` returns the same result), and
coroutines ``await comm.aall_reduce(x)`` (the communicator's native worker thread runs the
collective and signals an eventfd that the asyncio loop watches: no busy loop). On a one-rank
communicator, which waits for no one, async calls run when issued (their request is done at
once) and the latency entries are bind_solo.cc's copies (comm._fast_shm from the start).

Ordering contract: each call takes the next number of this communicator's collective
sequence, which names its messages (tag bit 63 set, so never a user tag). Ranks must issue
collectives in the same order; async ones run in issue order on one worker thread.

Tunables (read per call): LINKWISE_ALGO forces an algorithm, LINKWISE_CHUNK_SIZE the
pipelining chunk (a value of either that does not parse makes every collective raise
ValueError, even those it would not change; except that a LINKWISE_CHUNK_SIZE set in the
environment only after the shared-memory latency path was taken, which no chunk size changes,
is not looked at by that path's small all_reduce, reduce, broadcast and barrier), LINKWISE_CHECK=1
verifies that all ranks agree on kind/size/dtype/op/root first and raises ValueError on every
rank when they do not.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import numpy as np

from . import _gpu_coll, _shm_exec, config
from ._coll_fast import all_reduce_bf16_fast
from ._request import DoneCollective
from .plan.schedule import default_schedule
from ._coll_args import (  # noqa: F401 - KINDS/OPS/DTYPES stay importable from here
    _ENV, _FAST_CODES, _REDUCING, _U8, ALGO_CODES, DTYPES, KINDS, OPS, REFUSED_UNDER_NUMBER,
    CollectiveRequest, _as_array,
    _check_tunables, _dtype_label, _dtype_name, _env_set, _host_out, _native_module, _raw, _shown,
    _value_type,
    _skips_on_argument_error,
    block_shape, check_agree, check_on, gathered_shape)


_BARRIER_CODE = _FAST_CODES[(np.dtype(np.uint8), "sum")]
_ndarray = np.ndarray  # one global lookup instead of two in the latency paths
_uint16 = np.uint16
_ALL_GATHER, _REDUCE_SCATTER, _ALL_TO_ALL = KINDS["all_gather"], KINDS["reduce_scatter"], KINDS["all_to_all"]
# The executor's defaults live in _shm_exec; importable from here as before.
_NEVER, _cma_settings, DEFAULT_MAX_THREADS = _shm_exec.NEVER, _shm_exec.cma_settings, _shm_exec.DEFAULT_MAX_THREADS


class CollectivesMixin(_shm_exec.ExecutorMixin):
    """Mixed into Communicator; uses self._native, self.rank, self.size, self.timeout."""

    # The latency entries: the shared-memory executor while the latency paths may use it (set
    # when attached, cleared for good once async collectives exist: they need issue order), or
    # a one-rank communicator's SoloColl (bind_solo.cc) from the start; None once closed. Its
    # serves_async says whether its entries serve async_op=True calls too (one rank only): the
    # one rule every latency path and _run read for async calls.
    _fast_shm = None
    # Large two-rank broadcasts go point-to-point (one single-copy message) unless the
    # executor has its own single-copy (CMA) broadcast; known once the executor is attached.
    _pair_bcast_p2p = True
    # The eager CUDA fast path (cuda/fast.py FastPath), set once the GPU data plane is built
    # (cuda.gpu_comm), cleared by GpuComm.close(); it declines (None) whatever it does not handle.
    _gpu_fast = None
    _coll_seq = 0  # point-to-point collectives so far (their tags' seq; the same on every rank)
    _sched_cache = None  # (kind, root, bytes, env) -> the native call's schedule arguments

    # -- plumbing ------------------------------------------------------------------------
    def _next_seq(self) -> int:
        seq = self._coll_seq
        self._coll_seq = seq + 1
        return seq

    def _done(self, result: Any) -> CollectiveRequest:
        """The request of an async collective that already ran (one rank: the latency path
        serves async calls too, there being no one to wait for)."""
        return CollectiveRequest(DoneCollective(), self.timeout, result)

    def _schedule(self, kind: str, root: int, nbytes: int) -> tuple:
        env = ((os.environ.get("LINKWISE_ALGO", ""), os.environ.get("LINKWISE_CHUNK_SIZE", ""))
               if _env_set(b"LINKWISE_ALGO") or _env_set(b"LINKWISE_CHUNK_SIZE") else None)
        key = (kind, root, nbytes, env)
        cache = self._sched_cache
        if cache is None:
            cache = self._sched_cache = {}
        hit = cache.get(key)
        if hit is None:
            algo = config.get("LINKWISE_ALGO") or None
            chunk = config.get("LINKWISE_CHUNK_SIZE") or None
            s = default_schedule(kind, self.size, self.rank, root, nbytes, algo=algo, chunk=chunk)
            hit = (ALGO_CODES[s.algorithm], s.chunk_bytes, list(s.ring_order), s.parent, list(s.children))
            if len(cache) > 4096:
                cache.clear()
            cache[key] = hit
        return hit

    def _check_open(self, op: str) -> None:
        if self._native is None:
            from .errors import CommAbortedError
            raise CommAbortedError(f"rank {self.rank}: {op} on a closed communicator")

    def _check_agree(self, kind: str, count: int, dtype: str, op: str, root: int,
                     device: str = "host") -> None:
        """LINKWISE_CHECK: raise on every rank if the ranks' calls differ (_coll_args.check_agree)."""
        check_agree(self, kind, count, dtype, op, root, device)

    def _run(self, kind: str, x: Optional[np.ndarray], out: Optional[np.ndarray], dtype: str, op: str,
             root: int, count: int, nbytes: int, async_op: bool, result: Any):
        self._check_open(kind)
        if check_on():
            self._check_agree(kind, count, dtype, op, root)
        worker = self.__dict__.get("_coll_worker")
        # Collectives run in issue order: inline when no async one is pending, else queued
        # behind them on the worker (and waited for, when blocking). One rank waits for no
        # one: its async calls run inline too (a copy at most), their request done at once;
        # its latency entries (SoloColl) say so, serves_async, and they are open while this is.
        fast = self._fast_shm
        inline = ((not async_op or (fast is not None and fast.serves_async))
                  and (worker is None or worker.pending == 0))
        shm = self._shm_for(kind, nbytes)
        if shm is not None:
            _check_tunables()  # the other branch parses them in _schedule
            # out: None on a reduce's or gather's non-root; x: None on a scatter's non-root
            xr, outr = (None if x is None else _raw(x)), (None if out is None else _raw(out))
            if inline:
                if kind == "all_reduce":
                    shm.all_reduce(xr, outr, DTYPES[dtype] * 8 + OPS[op], self.timeout)
                elif kind == "reduce":  # outr: None except on the root
                    shm.reduce(xr, outr, DTYPES[dtype] * 8 + OPS[op], root, self.timeout)
                elif kind == "broadcast":  # out of place, the root copies x into out natively
                    shm.broadcast(outr, root, self.timeout, xr)
                elif kind == "gather":  # outr: None except on the root
                    shm.gather(xr, outr, root, self.timeout)
                elif kind == "scatter":  # xr: None except on the root
                    shm.scatter(xr, outr, root, self.timeout)
                else:
                    shm.exchange(KINDS[kind], xr, outr, DTYPES.get(dtype, _U8) * 8 + OPS.get(op, 0), self.timeout)
                return result
            args = (KINDS[kind], xr, outr, DTYPES.get(dtype, _U8) if kind in _REDUCING else _U8,
                    OPS.get(op, 0), root, 0, 0, 1, [], -1, [], self.timeout, shm)
        else:
            native = self._native  # None if close() ran on another thread since _check_open
            if native is None:
                self._check_open(kind)  # CommAbortedError, not a TypeError from the native call
            algo, chunk, order, parent, children = self._schedule(kind, root, nbytes)
            dcode = DTYPES[dtype] if kind in _REDUCING else _U8
            xr = None if x is None else _raw(x)
            outr = None if out is None else _raw(out)
            args = (KINDS[kind], xr, outr, dcode, OPS.get(op, 0), root, self._next_seq(), algo, chunk,
                    order, parent, children, self.timeout)
            if inline:  # a failure here stops the shared-memory executor natively (Engine's failure hook)
                with self._refused_under_number(args[6]):
                    _native_module().coll(native, *args)
                if async_op:  # one rank (see inline)
                    return self._done(result)
                return result
        if worker is None:
            worker = self._coll_worker = _native_module().CollWorker(self._native)
            self._fast_shm = None
        # Each call queued ahead may take up to the timeout before this one starts; and the
        # call's own error (raised natively at its timeout) should win over this wait's.
        ahead = worker.pending
        with self._refused_under_number(args[6] if shm is None else None):
            submitted = worker.submit(*args)
        req = CollectiveRequest(submitted, self.timeout * (1 + ahead) + 1.0, result)
        if async_op:
            return req
        try:
            return req.wait()
        except BaseException:
            # A collective that failed stopped the shared-memory executor natively already;
            # this wait may also give up first (its own timeout), leaving the call behind.
            self._stop_shm()
            raise

    @contextlib.contextmanager
    def _refused_under_number(self, seq: Optional[int]):
        """Around a native call that already has its number `seq` (the message path): an
        argument error raised there (before any data moves; say, an out= the buffer protocol
        will not give writable) is a refusal of that call, so the peers waiting in it get the
        notice for `seq`, and the error is marked (REFUSED_UNDER_NUMBER) so that
        _skips_on_argument_error numbers no further call as refused (that would tell them about
        the next number and leave this rank one ahead)."""
        try:
            yield
        except (ValueError, TypeError) as exc:
            native = self.__dict__.get("_native")
            if seq is not None and native is not None:
                native.notify_refused(seq)
                setattr(exc, REFUSED_UNDER_NUMBER, True)
            raise

    def _root(self, root: Any, op: str) -> int:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):  # True is an int
            raise ValueError(f"{op}: root must be an integer rank 0..{self.size - 1}, got {root!r} "
                             f"({type(root).__name__})")
        if not 0 <= root < self.size:
            raise ValueError(f"{op}: root {root!r} is out of range; this communicator has ranks 0..{self.size - 1}")
        return int(root)

    def _redop(self, op: Any, dtype: str, what: str) -> str:
        if not isinstance(op, str) or op not in OPS:  # op=['sum'] is not hashable
            raise ValueError(f"{what}: op {op!r} is not one of {', '.join(OPS)}")
        if dtype not in DTYPES:
            raise TypeError(f"{what}: dtype {dtype} cannot be reduced; use one of {', '.join(DTYPES)} "
                            "(e.g. x.astype(np.float32))")
        if op in ("band", "bor", "bxor") and dtype not in ("int8", "uint8", "int32", "int64"):
            raise TypeError(f"{what}: op {op!r} is for integer arrays; {dtype} supports sum, prod, min, max, avg")
        return op

    @staticmethod
    def _writable(a: np.ndarray, what: str) -> None:
        if not a.flags.writeable:
            raise ValueError(f"{what}: the result array is read-only; pass a writable array or out=")

    @staticmethod
    def _same_dtype(a: np.ndarray, b: np.ndarray, dt: Optional[str] = None) -> bool:
        """Two forms of one dtype match (a V2 array against an ml_dtypes / torch bfloat16
        one; with dt, the call's dtype=, a uint16 x named bfloat16 too)."""
        # Names looked up, not _dtype_name: that refuses another byte order as a reduction
        # would, which is not the question here ('>f4' and '<f4' simply differ).
        return b.dtype == a.dtype or (dt or _value_type(a.dtype)) == _value_type(b.dtype) == "bfloat16"

    def _same(self, a: np.ndarray, b: np.ndarray, what: str, n: int = 1, dt: Optional[str] = None) -> None:
        if not self._same_dtype(a, b, dt) or b.size != a.size * n:
            raise ValueError(f"{what}: out must be a {_shown(a.dtype)} array of {a.size * n} elements, "
                             f"got {_shown(b.dtype)} with {b.size}")

    def _gathered_out(self, x: np.ndarray, out: Any, what: str) -> tuple:
        """(result, out array) of a collective that concatenates every rank's x: out allocated
        (size blocks along x's first axis) or checked (dtype, size, writable)."""
        if out is None:
            result = arr = np.empty(gathered_shape(x.shape, self.size), dtype=x.dtype)
        else:
            result, arr = out, _host_out(out, what)
            self._same(x, arr, what, self.size)
        self._writable(arr, what)
        return result, arr

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum", out: Any = None, async_op: bool = False,
                   dtype: Optional[str] = None, stream: Any = None):
        """Combine x across ranks with op; every rank gets bitwise the same result (in x, or out).

        A CUDA array runs on the GPU data plane, enqueued on `stream` (else its current stream)."""
        fast = self._fast_shm  # None once closed
        # The latency paths: straight to shared memory. The executor's all_reduce_fast makes the
        # tests (NumPy array, dtype, op, out) natively and returns NotImplemented where it does
        # not serve the call (an argument error it raises, after numbering the call as refused
        # here through self._skip_call); bfloat16 forms go through uint16 views here. Every
        # *_fast entry also declines while LINKWISE_ALGO or LINKWISE_CHECK is set (to anything,
        # even empty): the general path honours them. A value that means the default takes
        # the same protocol there (the executor), so ranks may differ in that (slower only).
        if fast is not None and (not async_op or fast.serves_async) and dtype is None:
            r = fast.all_reduce_fast(self, x, op, out)
            if r is NotImplemented and type(x) is _ndarray and x.dtype.kind == "V":
                r = all_reduce_bf16_fast(self, fast, x, op, out)
            if r is not NotImplemented:
                return self._done(r) if async_op else r
        return self._all_reduce(x, op, out, async_op, dtype, stream)

    @_skips_on_argument_error
    def _all_reduce(self, x: Any, op: str, out: Any, async_op: bool, dtype: Optional[str], stream: Any):
        if type(x) is not np.ndarray:
            gf = self._gpu_fast
            if gf is not None and not async_op and dtype is None:
                r = gf.all_reduce(x, op, out, stream)
                if r is not None:
                    return r
            if _gpu_coll.is_cuda(x):
                return _gpu_coll.dispatch(self, "all_reduce", x, out=out, red=op, async_op=async_op,
                                     dtype=dtype, stream=stream)
        result = x if out is None else out  # the caller's own object (a tensor stays a tensor)
        x = _as_array(x, "all_reduce")
        dt = _dtype_name(x, dtype)
        self._redop(op, dt, "all_reduce")
        if out is None:
            out = x
        else:
            out = _host_out(out, "all_reduce")
            self._same(x, out, "all_reduce", dt=dt)
        # Here, before the call takes its number, not natively after (_refused_under_number).
        self._writable(out, "all_reduce")
        return self._run("all_reduce", x, out, dt, op, 0, x.size, x.nbytes, async_op, result)

    def broadcast(self, x: Any, root: int = 0, out: Any = None, async_op: bool = False,
                  stream: Any = None):
        """Copy root's x to every rank (into x, or into out). CUDA arrays: on the GPU, on `stream`."""
        fast = self._fast_shm
        # The latency path: the executor's broadcast_fast tests x, root and out natively (as
        # all_reduce_fast) and returns NotImplemented where it does not serve the call (also
        # two-rank broadcasts that go point-to-point as one single-copy message).
        if fast is not None and (not async_op or fast.serves_async):
            r = fast.broadcast_fast(self, x, root, out)
            if r is not NotImplemented:
                return self._done(r) if async_op else r
        return self._broadcast(x, root, out, async_op, stream)

    @_skips_on_argument_error
    def _broadcast(self, x: Any, root: Any, out: Any, async_op: bool, stream: Any):
        gf = self._gpu_fast
        if gf is not None and not async_op and type(x) is not np.ndarray:
            r = gf.broadcast(x, root, out, stream)
            if r is not None:
                return r
        if type(x) is not np.ndarray and _gpu_coll.is_cuda(x):  # it checks root (a refusal there)
            return _gpu_coll.dispatch(self, "broadcast", x, out=out, root=root, async_op=async_op,
                                 stream=stream)
        root = self._root(root, "broadcast")
        result = x if out is None else out
        x = _as_array(x, "broadcast")
        if out is None:
            out = x
        else:
            out = _host_out(out, "broadcast")
            self._same(x, out, "broadcast")
        self._writable(out, "broadcast")
        return self._run("broadcast", x, out, _dtype_label(x.dtype), "", root, x.size, x.nbytes, async_op, result)

    def reduce(self, x: Any, root: int = 0, op: str = "sum", out: Any = None, async_op: bool = False,
               dtype: Optional[str] = None):
        """Combine x across ranks onto root (into x, or out, on root; other ranks' x is untouched)."""
        fast = self._fast_shm  # the latency path: the executor's reduce_fast, as all_reduce_fast
        if fast is not None and (not async_op or fast.serves_async) and dtype is None:
            r = fast.reduce_fast(self, x, root, op, out)
            if r is not NotImplemented:
                return self._done(r) if async_op else r
        return self._reduce(x, root, op, out, async_op, dtype)

    @_skips_on_argument_error
    def _reduce(self, x: Any, root: Any, op: Any, out: Any, async_op: bool, dtype: Optional[str]):
        root = self._root(root, "reduce")
        if type(x) is not np.ndarray and _gpu_coll.is_cuda(x):
            raise _gpu_coll.unsupported("reduce", "use all_reduce (every rank gets the result) or copy x to the host")
        result = x if out is None else out
        x = _as_array(x, "reduce")
        dt = _dtype_name(x, dtype)
        self._redop(op, dt, "reduce")
        if out is None:
            out = x
            if self.rank == root:
                self._writable(x, "reduce")
        else:  # checked on every rank, though only the root writes it: a bad one raises everywhere
            out = _host_out(out, "reduce")
            self._same(x, out, "reduce", dt=dt)
            self._writable(out, "reduce")
        return self._run("reduce", x, out if self.rank == root else None, dt, op, root, x.size, x.nbytes,
                         async_op, result)

    def all_gather(self, x: Any, out: Any = None, async_op: bool = False, stream: Any = None):
        """Concatenate every rank's x (rank order) into out (size * len(x) elements).
        CUDA arrays: on the GPU, on `stream`."""
        fast = self._fast_shm  # the latency path: the executor's exchange_fast, as all_reduce_fast
        if fast is not None and (not async_op or fast.serves_async):
            r = fast.exchange_fast(self, _ALL_GATHER, x, out, "")
            if r is not NotImplemented:
                return self._done(r) if async_op else r
        return self._all_gather(x, out, async_op, stream)

    @_skips_on_argument_error
    def _all_gather(self, x: Any, out: Any, async_op: bool, stream: Any):
        if type(x) is not np.ndarray and _gpu_coll.is_cuda(x):
            return _gpu_coll.dispatch(self, "all_gather", x, out=out, async_op=async_op, stream=stream)
        x = _as_array(x, "all_gather")
        result, out = self._gathered_out(x, out, "all_gather")
        return self._run("all_gather", x, out, _dtype_label(x.dtype), "", 0, x.size, x.nbytes, async_op, result)

    def reduce_scatter(self, x: Any, op: str = "sum", out: Any = None, async_op: bool = False,
                       dtype: Optional[str] = None, stream: Any = None):
        """Combine x across ranks; rank r gets block r (x has size * len(out) elements).
        CUDA arrays: on the GPU, on `stream`."""
        fast = self._fast_shm
        if fast is not None and (not async_op or fast.serves_async) and dtype is None:
            r = fast.exchange_fast(self, _REDUCE_SCATTER, x, out, op)
            if r is not NotImplemented:
                return self._done(r) if async_op else r
        return self._reduce_scatter(x, op, out, async_op, dtype, stream)

    @_skips_on_argument_error
    def _reduce_scatter(self, x: Any, op: str, out: Any, async_op: bool, dtype: Optional[str], stream: Any):
        if type(x) is not np.ndarray and _gpu_coll.is_cuda(x):
            return _gpu_coll.dispatch(self, "reduce_scatter", x, out=out, red=op, async_op=async_op,
                                 dtype=dtype, stream=stream)
        x = _as_array(x, "reduce_scatter")
        dt = _dtype_name(x, dtype)
        self._redop(op, dt, "reduce_scatter")
        if x.size % self.size:
            raise ValueError(f"reduce_scatter: x has {x.size} elements, not a multiple of the "
                             f"communicator size {self.size}")
        if out is None:
            out = result = np.empty(block_shape(x.shape, self.size), dtype=x.dtype)
        else:
            result, out = out, _host_out(out, "reduce_scatter")
            if not self._same_dtype(x, out, dt) or out.size * self.size != x.size:
                raise ValueError(f"reduce_scatter: out must be a {x.dtype} array of {x.size // self.size} "
                                 f"elements, got {out.dtype} with {out.size}")
        self._writable(out, "reduce_scatter")
        return self._run("reduce_scatter", x, out, dt, op, 0, out.size, x.nbytes, async_op, result)

    def all_to_all(self, x: Any, out: Any = None, async_op: bool = False, stream: Any = None):
        """Rank r's block j (x split into size equal blocks) goes to rank j's block r.
        CUDA arrays: on the GPU, on `stream`."""
        fast = self._fast_shm
        if fast is not None and (not async_op or fast.serves_async):
            r = fast.exchange_fast(self, _ALL_TO_ALL, x, out, "")
            if r is not NotImplemented:
                return self._done(r) if async_op else r
        return self._all_to_all(x, out, async_op, stream)

    @_skips_on_argument_error
    def _all_to_all(self, x: Any, out: Any, async_op: bool, stream: Any):
        if type(x) is not np.ndarray and _gpu_coll.is_cuda(x):
            return _gpu_coll.dispatch(self, "all_to_all", x, out=out, async_op=async_op, stream=stream)
        result = x if out is None else out
        x = _as_array(x, "all_to_all")
        if x.size % self.size:
            raise ValueError(f"all_to_all: x has {x.size} elements, not a multiple of the "
                             f"communicator size {self.size}")
        if out is None:
            out = x
        else:
            out = _host_out(out, "all_to_all")
            self._same(x, out, "all_to_all")
        self._writable(out, "all_to_all")
        return self._run("all_to_all", x, out, _dtype_label(x.dtype), "", 0, x.size, x.nbytes, async_op, result)

    def barrier(self, async_op: bool = False, stream: Any = None):
        """Return once every rank has entered the barrier.

        With `stream` (a CUDA stream), a device-side barrier on the GPU data plane: enqueued on
        that stream, and waited for (every rank's stream has reached it when this returns)."""
        if (stream is None and self.size == 1 and self._fast_shm is not None  # one rank, open
                and not (_ENV is None or b"LINKWISE_ALGO" in _ENV or b"LINKWISE_CHECK" in _ENV
                         or b"LINKWISE_CHUNK_SIZE" in _ENV)):
            # Nobody to wait for (nor any message to number). The general path runs it while
            # those are set, as it runs the other one-rank latency paths' calls (bind_solo.cc).
            return self._done(None) if async_op else None
        return self._barrier(async_op, stream)

    @_skips_on_argument_error
    def _barrier(self, async_op: bool, stream: Any):
        if stream is not None:
            # plane made: the others' barrier kernels may wait; else they may be making it
            from .cuda.plane_setup import checks_of_a_gpu_call
            with checks_of_a_gpu_call(self, None, stream):
                if async_op:
                    raise TypeError("barrier: async_op=True cannot be combined with stream=")
            return self.cuda().barrier(stream=stream)  # an int cudaStream_t or a stream object
        if (self.size > 1 and self._native is not None and not check_on()
                and self._shm_for("all_reduce", 1) is not None):
            # On one host: a one-byte all_reduce through the shared-memory executor (no rank
            # leaves before every rank has arrived; ~1 us instead of a dissemination over
            # messages). The choice depends only on what every rank shares (the host, the
            # values of LINKWISE_CHECK and LINKWISE_ALGO, not whether they are set: 0 or an
            # empty value is the default's path), so all ranks take the same path whatever
            # forms they call.
            token = self.__dict__.get("_barrier_token")
            if token is None:
                token = self._barrier_token = np.zeros(1, np.uint8)
            fast = self._fast_shm
            if fast is not None and not async_op:
                fast.all_reduce(token, token, _BARRIER_CODE, self.timeout)
                return None
            return self._run("all_reduce", token, token, "uint8", "sum", 0, 1, 1, async_op, None)
        return self._run("barrier", None, None, "uint8", "", 0, 0, 0, async_op, None)

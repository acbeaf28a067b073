"""GpuComm: one Communicator's GPU data plane (the C++ engine in csrc/cuda/).

Setup (collective over the communicator, in the constructor; plane_setup.py): pick the device
(``LINKWISE_DEVICE``, else local_rank % device_count), allocate the scratch area, exchange CUDA
IPC handles through the rendezvous store (``comm._store``), map every peer's area, barrier. A
rank that died meanwhile makes the others raise PeerError naming it; one that refused its first
GPU call's arguments, ValueError naming it (both at once, not at the timeout).

Large messages (``LINKWISE_GPU_REG_MIN`` bytes and up, default 4 MiB; ``LINKWISE_GPU_REG=0``
turns it off): all_gather, broadcast and send/recv register the user buffers instead of
copying through the scratch area: each rank describes the allocation holding its buffer
(IPC handle of its base, offset), the descriptions go over the CPU engine (collectives: a
host all_gather; send/recv: a host message to the receiver), each peer allocation is mapped
once and cached per (peer, base) (remapped when the handle changes; bounded by
``LINKWISE_GPU_REG_CACHE_ENTRIES`` / ``_BYTES``, and closed once the peer describes an
allocation overlapping it: csrc/cuda/reg_cache.h), and the copy engines
move the data between user buffers (reg_engine.cu); memory CUDA IPC cannot export (torch's
expandable_segments, cudaMallocAsync pools) takes the scratch path instead, agreed by every
rank (registered.py); broadcast (from
``LINKWISE_GPU_BCAST_REG_MIN``, 64 MiB) is a push chain of SM stores into the
next rank's buffer in one kernel, its blocks claiming 128 KiB items dynamically
(bcast_dchain.cu). all_reduce (algo "auto") and
reduce_scatter of ``LINKWISE_GPU_REG_REDUCE_MIN`` bytes and up (the whole buffer; default 64
MiB) read the peers' registered inputs directly: rank r reduces chunk r from every rank's x
with NVLink loads and writes it into its own out and (all_reduce) every peer's out, between
two device-side rendezvous (reg_reduce.cu, reg_engine.cu). The ranks agree on it in the same
host all_gather that carries the descriptions: if any rank's buffer cannot be registered, all
of them take the scratch path. From ``LINKWISE_GPU_AR_RSAG_MIN`` (512 MiB) an all_reduce is
that reduce_scatter into out's own chunk followed by a copy-engine all_gather, in one engine
call (_rsag; at any size with ``LINKWISE_GPU_AR_ALGO=rsag``). On 2 ranks from
``LINKWISE_GPU_AR_PRS_MIN`` (64 MiB), and at any size and rank count with
``LINKWISE_GPU_AR_ALGO=prs``, an all_reduce is instead one kernel of SM stores only:
each rank pushes chunk p of its x into owner p's scratch, the owner reduces it from local
memory and pushes the result into every rank's out (reg_prs.cu, _prs).
Below the threshold, and on a capturing stream, they go through
the scratch area (so they stay capturable; every rank must then capture alike, as always).
With ``LINKWISE_P2P_DISABLE=1`` everything is host-staged (staged.py).

CUDA graphs: all_reduce, reduce_scatter, all_to_all, broadcast (on a capturing stream it
takes the scratch kernel at every size) and all_gather below ``LINKWISE_GPU_REG_MIN`` on the
NVLink path can be captured (torch.cuda.graph, cudaStreamBeginCapture) and replayed: their kernels number
epochs on the device, so nothing per call lives on the host. Registered-buffer paths,
send/recv, barrier and the host-staged path cannot: called under capture they raise
RuntimeError instead of hanging.

Semantics as NCCL's: every method enqueues on ``stream`` (an int cudaStream_t or a stream
object), else on the current stream of the array's library (torch / cupy), else on the stream
a ``__cuda_array_interface__`` v3 names (x's; 1 legacy, 2 per-thread, None or absent: the
legacy stream), and returns
without waiting for the GPU. All ranks issue the same collectives in the same order, on one
stream (or streams the caller orders). send/recv between a pair match in issue order; the
tag is accepted for API symmetry and not matched. Results are bitwise identical on every rank.

Async forms (``request``, ``isend`` / ``irecv``; the Communicator's ``async_op=True``, ``a*``
coroutines, isend/irecv/asend/arecv route here): the operation is enqueued as above and a
:class:`linkwise._request.GpuRequest` records a CUDA event on the stream right after it.
``wait()`` blocks the host until the event completes, ``await`` polls it without blocking the
loop; both then raise the communicator's recorded failure, if any. As with NCCL, a receive
enqueued before the matching send on one stream waits for it on the GPU: two ranks that both
irecv before they isend on one stream deadlock (until the timeout); order them, or use two
streams. recv / irecv never wait on the host for the sender: a registered receive, whose
sender's description comes later, is placed on the stream at once and enqueued by a helper
thread when the description arrives (deferred.py).

Failures: a peer process that dies (watched through its pidfd when it runs on this host,
peer_watch.h) aborts every device wait of this communicator within a millisecond: kernels
drain, and the next call on it, ``synchronize()``, ``check()`` or a request's ``wait()``
raises PeerError naming the peer. A device wait longer than the communicator's timeout raises
TimeoutError the same way. Either is final: the data of operations in flight is undefined and
the communicator cannot be used any more (make a new one). So is an argument a rank refuses
(ValueError / TypeError of any method's checks: another ``out`` size, dtype or device there,
the root's ``out`` of a broadcast, which only the root checks, a bad op or stream): it raises
there and stops every rank's GPU plane at once (refusal.py; the others' kernels may be waiting
for it), after which every call raises CommAbortedError naming that rank; a call refused on
every rank alike stops it too (no rank can know the others refused). A rank whose GPU plane
stops for a failure of its own (a receive that cannot map its sender's buffer, a failed launch,
``abort()``) stops its live peers' too, and their next call raises PeerError naming it, so a
sender waiting for that receive does not wait until its timeout. Plain stream synchronisation
(``torch.cuda.synchronize()``, ``tensor.cpu()``) returns once kernels drained and raises
nothing: call ``check()`` after it when a peer may have failed. After ``close()`` every
method (``check()`` and ``synchronize()`` too) raises CommAbortedError; ``comm.cuda()`` keeps
returning the closed GpuComm (make a new communicator for more GPU work).
"""
from __future__ import annotations

from typing import Any, Optional

from .. import config
from . import registered as reg
from .arrays import DTYPES, OPS, DevArray, check_out, stream_handle, view
from .plane_setup import _native, exchange_cards, member_watch, plane_key, select_device
from .refusal import RefusalMixin

_DEFAULT_SLOT = 16 << 20
_ALGOS = {"auto": 0, "oneshot": 1, "twoshot": 2}
_REFUSED = 3  # GpuEngine::error_code after a refusal (gpu_device.cuh kErrRefused)


def unavailable_reason() -> str:
    """Why the GPU data plane cannot run in this process ('' when it can)."""
    n = _native()
    if not hasattr(n, "_GpuEngine"):
        return "linkwise was built without CUDA (set LINKWISE_CUDA=ON and rebuild where nvcc is found)"
    if n.cuda_device_count() <= 0:
        return "no CUDA device is visible"
    return ""


def available() -> bool:
    """True when the extension was built with CUDA and a device is visible."""
    return not unavailable_reason()


def gpu_comm(comm) -> "GpuComm":
    """The communicator's GpuComm, built on first use (collective: every rank must call it)."""
    g = getattr(comm, "_gpu_comm", None)
    if g is None:
        g = GpuComm(comm)
        comm._gpu_comm = g
        # The eager fast path of all_reduce / broadcast (fast.py); not under LINKWISE_CHECK,
        # whose agreement check runs in _gpu_coll.dispatch (set it before the first GPU call).
        if g._staged is None and not config.get("LINKWISE_CHECK"):
            from .fast import FastPath
            comm._gpu_fast = g._fast = FastPath(g)
    return g


class GpuComm(RefusalMixin):
    _deferred = None  # deferred.DeferredReceives, made on the first deferred receive (recv)

    def __init__(self, comm, device: Optional[int] = None, slot_bytes: Optional[int] = None):
        n = _native()
        if not hasattr(n, "_GpuEngine"):
            raise RuntimeError("linkwise was built without CUDA (set LINKWISE_CUDA=ON and rebuild)")
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self._closed = True  # until made: every entry refuses a GpuComm that is not open
        # Every store wait of the setup (and of close) raises PeerError once a rank died.
        self._key, self._watch = plane_key(comm), member_watch(comm)
        # First: settings one rank refuses (a device out of range too), or a rank's refusal of
        # its first call's arguments, fail every rank here (plane_setup.exchange_cards).
        pids = exchange_cards(comm, device, self._key, self._watch)  # to watch (peer_watch.h)
        self.device = select_device(comm, device)
        slot = int(slot_bytes or config.get("LINKWISE_GPU_SLOT_BYTES") or _DEFAULT_SLOT)
        self._engine = n._GpuEngine(self.rank, self.size, self.device, slot, float(comm.timeout))
        self._staged = None
        try:
            self._connect(comm, pids)
        except BaseException:
            # Released now, not when whatever holds this failed GpuComm (the exception's
            # traceback: a logger, a debugger, a retry loop) lets go of it: the scratch, the
            # pinned flags, the watcher thread and the peers' mappings.
            if self._staged is not None:
                self._staged.close()
            self._engine.close()
            raise
        self._closed = False
        self._fast = None  # the FastPath gpu_comm() installed on comm, if any

    def _connect(self, comm, pids) -> None:
        """The setup after the engine is made: tunables, the host-staged path, the peers'
        watch and the scratch areas' mappings (collective)."""
        if config.get("LINKWISE_GPU_ONESHOT_MAX"):
            self._engine.oneshot_max = config.get("LINKWISE_GPU_ONESHOT_MAX")
        if config.get("LINKWISE_GPU_MAX_BLOCKS"):
            self._engine.max_blocks = config.get("LINKWISE_GPU_MAX_BLOCKS")
        self._reg_on = bool(config.get("LINKWISE_GPU_REG"))
        self._reg_min = config.get("LINKWISE_GPU_REG_MIN") if self._reg_on else 1 << 62
        self._chain_piece = config.get("LINKWISE_GPU_CHAIN_PIECE")
        # Registered-buffer all_reduce / reduce_scatter from this many bytes (whole buffer).
        self._red_reg_min = config.get("LINKWISE_GPU_REG_REDUCE_MIN") if self._reg_on else 1 << 62
        self._engine.reg_blocks = config.get("LINKWISE_GPU_REG_REDUCE_BLOCKS")  # 0: engine default
        self._engine.reg_cache_limits(config.get("LINKWISE_GPU_REG_CACHE_ENTRIES"),
                                      config.get("LINKWISE_GPU_REG_CACHE_BYTES"))
        # The push chains beat the scratch broadcast kernel at 64 MiB (docs/benchmarks.md).
        self._bcast_reg_min = max(self._reg_min, config.get("LINKWISE_GPU_BCAST_REG_MIN"))
        self._prs_mapped = None  # set once every rank's prs scratch is mapped (slot 2)
        if config.get("LINKWISE_P2P_DISABLE"):
            from .staged import Staged
            self._staged = Staged(self)
        if self.size > 1:
            self._engine.watch_peers(pids)
        if self.size > 1 and self._staged is None:
            store, key = comm._store, self._key
            handles = store.all_gather(f"{key}/ipc", self.rank, self.size, self._engine.ipc_handle(),
                                       watch=self._watch)
            self._engine.open_peers(handles)
            store.barrier(f"{key}/open", self.size, watch=self._watch)

    @property
    def slot_bytes(self) -> int:
        return self._engine.slot_bytes

    def _open(self, op: str) -> None:
        """Raises CommAbortedError once close() ran (the engine is gone: a call into it would
        crash the process), then the recorded failure, if any (check())."""
        if self._closed:
            from ..errors import CommAbortedError
            raise CommAbortedError(f"rank {self.rank}: {op} on a closed GPU communicator "
                                   "(GpuComm.close() ran; make a new communicator to go on)")
        self._raise_failure()

    def _raise_failure(self) -> None:
        """Raises the recorded failure: a deferred receive's helper's (deferred.py: it aborted
        the engine, whose own error would only say a peer died or failed), else the engine's."""
        if self._deferred is not None and self._deferred.failure is not None:
            raise self._deferred.failure
        self._engine.check()

    def check(self) -> None:
        """Raises PeerError if a peer of this communicator died, TimeoutError if a GPU wait timed
        out (either is final), CommAbortedError after close(). Does not synchronise: it reports
        what was recorded so far."""
        self._open("check")

    def abort(self, peer: int = -1) -> None:
        """Aborts every device wait of this communicator now (as a dead peer would; `peer` is the
        rank to blame, -1 unknown). Later calls raise PeerError. The live peers' device waits
        are stopped too, and their next call raises PeerError naming this rank (they may be
        waiting for this rank's part). For error handlers and tests."""
        # Told only as GpuEngine::abort decides (its first abort, the blamed peer alive): the
        # host-staged peers through their channels (staged.py).
        if self._engine.abort(peer) and self._staged is not None and not self._closed:
            self._staged.stop(failed=True)

    # -- async requests ----------------------------------------------------------------------
    def request(self, x: Any, stream: Any = None, result: Any = None):
        """A GpuRequest for the work enqueued so far on x's stream (`stream`, else x's current
        stream): its wait() returns `result` once the GPU got there."""
        from .._request import GpuRequest
        self._open("request")
        s = stream_handle(stream, view(x, "request"))
        return GpuRequest(self._engine, self._engine.event_record(s), float(self.comm.timeout),
                          result, check=self._raise_failure)

    def isend(self, x: Any, dst: int, tag: int = 0, stream: Any = None):
        """send() as a request; wait() returns the bytes sent."""
        self.send(x, dst, tag, stream=stream)
        return self.request(x, stream, view(x, "isend").nbytes)

    def irecv(self, x: Any, src: int, tag: int = 0, stream: Any = None):
        """recv() as a request; wait() returns the bytes received (once they are in x)."""
        n = self.recv(x, src, tag, stream=stream)
        return self.request(x, stream, n)

    # -- helpers ---------------------------------------------------------------------------
    def _view(self, x: Any, op: str) -> DevArray:
        self._open(op)  # every operation starts here: a closed or failed communicator raises
        v = view(x, op)
        if v.device is not None and v.device != self.device:
            raise ValueError(f"rank {self.rank}: {op}: the array is on cuda:{v.device} but this "
                             f"communicator uses cuda:{self.device} (set LINKWISE_DEVICE)")
        return v

    def _no_capture(self, s: int, what: str) -> None:
        """Raises when stream s is being captured: `what` has host-side state per call."""
        if _native().cuda_stream_capturing(s):
            raise RuntimeError(
                f"rank {self.rank}: {what} cannot be captured in a CUDA graph (it synchronises "
                "with the host or keeps per-call state there); capturable: all_reduce, "
                "reduce_scatter, all_to_all, broadcast, and all_gather below "
                "LINKWISE_GPU_REG_MIN, without LINKWISE_P2P_DISABLE")

    def _reduce_args(self, v: DevArray, op: str, what: str) -> tuple[int, int]:
        if v.dtype not in DTYPES:
            raise TypeError(f"{what}: dtype {v.dtype} is not supported on GPU "
                            f"(supported: {', '.join(DTYPES)})")
        if op not in OPS:
            raise ValueError(f"{what}: op must be one of {', '.join(OPS)}, not {op!r}")
        return DTYPES[v.dtype], OPS[op]

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum", out: Any = None, stream: Any = None,
                   algo: str = "auto") -> Any:
        with self._refusing(x, stream):  # a refusal stops the ranks waiting for this one
            v = self._view(x, "all_reduce")
            o = v if out is None else self._view(out, "all_reduce")
            if o.count != v.count or o.dtype != v.dtype:
                raise ValueError(f"all_reduce: out must have the same size and dtype as x ({v.count} "
                                 f"{v.dtype}), got {o.count} {o.dtype}")
            dt, opc = self._reduce_args(v, op, "all_reduce")
            if algo not in _ALGOS:
                raise ValueError(f"all_reduce: algo must be one of {', '.join(_ALGOS)}, not {algo!r}")
            a = _ALGOS[algo]
            s = stream_handle(stream, v)
        if self._staged is not None:
            self._no_capture(s, "host-staged all_reduce")
            self._staged.all_reduce(v, o, op, s)
            return x if out is None else out
        # LINKWISE_GPU_AR_ALGO=prs / rsag: the registered forms at any size (reg.forced_algo).
        if a == 0 and (reg.reduce_ok(self, v.nbytes, s) or reg.forced_algo(self, s)):
            if reg.prs(self, v, o, dt, opc, s):
                return x if out is None else out
            if reg.rsag(self, v, o, dt, opc, s):
                return x if out is None else out
            if reg.reg_many(self, [v.ptr, o.ptr]):
                self._engine.all_reduce_reg(v.count, dt, opc, s)
                return x if out is None else out
        self._engine.all_reduce(v.ptr, o.ptr, v.count, dt, opc, s, a)
        return x if out is None else out

    def reduce_scatter(self, x: Any, out: Any, op: str = "sum", stream: Any = None) -> Any:
        with self._refusing(x, stream):
            v, o = self._view(x, "reduce_scatter"), self._view(out, "reduce_scatter")
            if v.count != o.count * self.size or o.dtype != v.dtype:
                raise ValueError(f"reduce_scatter: x must have size * len(out) elements "
                                 f"({self.size} * {o.count}) of out's dtype, got {v.count} {v.dtype}")
            dt, opc = self._reduce_args(v, op, "reduce_scatter")
            s = stream_handle(stream, v)
        if self._staged is not None:
            self._no_capture(s, "host-staged reduce_scatter")
            self._staged.reduce_scatter(v, o, op, s)
            return out
        if o.count and reg.reduce_ok(self, v.nbytes, s) and reg.reg_many(self, [v.ptr]):
            self._engine.reduce_scatter_reg(o.ptr, o.count, dt, opc, s)
            return out
        self._engine.reduce_scatter(v.ptr, o.ptr, o.count, dt, opc, s)
        return out

    def broadcast(self, x: Any, root: int = 0, stream: Any = None, out: Any = None) -> Any:
        """Root's x into every rank's x (out None or x), or into every rank's out (non-roots
        ignore x's contents; the root's x and out must have the same dtype and size and must not
        overlap). Below the LL size and on the registered path's one-kernel chain the root's
        kernel copies x to out itself; otherwise (host-staged path, the other registered forms)
        a copy on the stream precedes the broadcast."""
        with self._refusing(x, stream):
            v = self._view(x, "broadcast")
            o = v if out is None or out is x else self._view(out, "broadcast")
            if not 0 <= root < self.size:
                raise ValueError(f"broadcast: root {root!r} is out of range 0..{self.size - 1}")
            s = stream_handle(stream, v)
            if o is not v and self.rank == root and (o.nbytes != v.nbytes or o.dtype != v.dtype):
                raise ValueError(f"broadcast: out is {o.dtype} with {o.nbytes} bytes, x is "
                                 f"{v.dtype} with {v.nbytes}; they must have the same dtype and "
                                 "the same size on the root (the bytes are copied, not converted)")
        staged = self._staged is not None
        # Registered-buffer path from LINKWISE_GPU_BCAST_REG_MIN, except while the stream is
        # being captured into a CUDA graph: then the scratch kernel below (capturable).
        use_reg = (not staged and self.size > 1 and o.nbytes >= self._bcast_reg_min
                   and not _native().cuda_stream_capturing(s))
        if o is not v and self.rank == root and staged:
            self._engine.copy_async(o.ptr, v.ptr, o.nbytes, s)
        if staged:
            self._no_capture(s, "host-staged broadcast")
            self._staged.broadcast(o, root, s)
        elif use_reg and reg.reg_many(self, [o.ptr]):  # every rank's out exported, else none
            # The root's x goes along when out of place: the one-kernel chain reads it and fills
            # out in the same pass; the other forms copy it into out first (reg_engine.cu).
            src = v.ptr if o is not v and self.rank == root else 0
            self._engine.broadcast_reg(o.ptr, o.nbytes, root, reg.piece(self, o.nbytes), s, src)
        else:
            self._engine.broadcast_from(v.ptr, o.ptr, o.nbytes, root, s)
        return x if o is v else out

    def all_gather(self, x: Any, out: Any, stream: Any = None) -> Any:
        with self._refusing(x, stream):
            v, o = self._view(x, "all_gather"), self._view(out, "all_gather")
            check_out(v, o, self.size, "all_gather")  # as the host path: dtype and element count
            s = stream_handle(stream, v)
        if self._staged is not None:
            self._no_capture(s, "host-staged all_gather")
            self._staged.all_gather(v, o, s)
            return out
        if self.size > 1 and o.nbytes >= self._reg_min:
            self._no_capture(s, "all_gather of registered buffers (LINKWISE_GPU_REG_MIN)")
            if reg.reg_many(self, [v.ptr]):  # every rank's x exported, else none: scratch path
                self._engine.all_gather_reg(o.ptr, v.nbytes, s)
                return out
        self._engine.all_gather(v.ptr, o.ptr, v.nbytes, s)
        return out

    def all_to_all(self, x: Any, out: Any, stream: Any = None) -> Any:
        with self._refusing(x, stream):
            v, o = self._view(x, "all_to_all"), self._view(out, "all_to_all")
            if v.count % self.size:  # elements, not bytes: blocks never split an element
                raise ValueError(f"all_to_all: x has {v.count} elements, not a multiple of the "
                                 f"communicator size {self.size}")
            check_out(v, o, 1, "all_to_all")
            s = stream_handle(stream, v)
        if self._staged is not None:
            self._no_capture(s, "host-staged all_to_all")
            self._staged.all_to_all(v, o, s)
            return out
        self._engine.all_to_all(v.ptr, o.ptr, v.nbytes // self.size, s)
        return out

    def send(self, x: Any, dst: int, tag: int = 0, stream: Any = None) -> None:
        with self._refusing(x, stream, collective=False):  # the peer's kernel waits for it
            v = self._view(x, "send")
            s = stream_handle(stream, v)
        self._no_capture(s, "send")
        if self._staged is not None:
            self._staged.send(v, dst, s)
        elif v.nbytes >= self._reg_min:
            reg.send(self, v, dst, s)  # tells dst whether x could be registered (else scratch)
        else:
            self._engine.send(v.ptr, v.nbytes, dst, s)

    def recv(self, x: Any, src: int, tag: int = 0, stream: Any = None) -> int:
        with self._refusing(x, stream, collective=False):  # the peer's kernel waits for it
            v = self._view(x, "recv")
            s = stream_handle(stream, v)
        self._no_capture(s, "recv")
        if self._staged is not None:
            self._staged.recv(v, src, s)
        elif v.nbytes >= self._reg_min or (self._deferred is not None and self._deferred.busy(src)):
            # the sender's description comes later: the receive is deferred, never waited for
            # here (deferred.py); smaller ones from src queue behind, to keep the pair's order
            if self._deferred is None:
                from .deferred import DeferredReceives
                self._deferred = DeferredReceives(self)
            self._deferred.post(x, v.ptr, v.nbytes, src, s, registered=v.nbytes >= self._reg_min)
        else:
            self._engine.recv(v.ptr, v.nbytes, src, s)
        return v.nbytes

    def barrier(self, stream: Any = None) -> None:
        """Device-side barrier enqueued on `stream` (an int cudaStream_t or a torch / cupy
        stream object; default: the legacy stream), then waits for it."""
        self._open("barrier")
        with self._refusing(None, stream):
            h = stream_handle(stream, None)  # None: 0, the legacy stream
        self._no_capture(h, "barrier")
        if self._staged is not None:
            self.synchronize(h)
            self.comm.barrier()
            return
        self._engine.barrier(h)
        self.synchronize(h)

    def synchronize(self, stream: int = 0) -> None:
        """Waits for `stream` (GIL released), then raises a recorded failure (see check())."""
        self._open("synchronize")
        try:
            self._engine.synchronize(stream)
        except Exception:  # noqa: BLE001 - a deferred receive's failure explains it better
            self._raise_failure()
            raise
        self._raise_failure()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._fast is not None and getattr(self.comm, "_gpu_fast", None) is self._fast:
            self.comm._gpu_fast = None  # before the engine goes (fast.py's contract)
        self._fast = None
        try:
            self._engine.synchronize(0)
        except Exception:  # noqa: BLE001 - a failed communicator still releases everything
            if not self._engine.error_code():
                raise
        if self._deferred is not None:  # before the engine goes: no helper touches it after
            self._deferred.close(float(self.comm.timeout))
        if self._staged is not None:
            self._staged.close()
        # Collective close on both paths: no rank tears down (or exits, taking the rendezvous
        # store with it) while a peer is still inside a call that needs it.
        # Not after a failure: a dead or hung peer would hold everyone up until the timeout.
        failed = self._engine.error_code() not in (0, _REFUSED)  # a refusal leaves every rank alive
        if self.size > 1 and not failed and getattr(self.comm, "_store", None) is not None:
            from ..errors import PeerError
            try:
                self.comm._store.barrier(f"{self._key}/close", self.size, watch=self._watch)
            except PeerError:
                pass  # a rank that died needs nothing of this one: tear down, as after a failure
        self._engine.close()

    def __repr__(self) -> str:
        return f"<linkwise.cuda.GpuComm rank {self.rank} of {self.size} on cuda:{self.device}>"

"""The Communicator: the user-facing object of linkwise.

Threading: point-to-point calls may come from several threads (the native engine serialises
its own state); collectives from one thread at a time, in the same order on every rank (the
README: give each thread its own split). Blocking calls release the GIL. Async calls (``await comm.arecv(...)``) wait on an
eventfd registered with the running asyncio loop, never on a busy loop; on CUDA arrays they
poll a CUDA event recorded after the operation (GpuRequest), napping between polls.

Buffers: anything with the buffer protocol (NumPy, bytearray, memoryview, array.array) is used
in place; objects with ``__dlpack__`` only (PyTorch CPU tensors, JAX arrays) are viewed through
NumPy without a copy, CPU torch.bfloat16 tensors too (through their bits: ``_bf16``). A
receive writes into the array it is given.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import weakref
from typing import Any, Optional

import numpy as np

from . import config
from . import _bf16, _setup, _shm_exec
from ._request import Request, adopt_native  # noqa: F401 - Request is linkwise.Request
from ._coll_args import _as_array, _raw
from ._coll_coroutines import CoroutineCollectivesMixin
from ._coll_gather import GatherScatterMixin
from ._split_watch import MemberWatch, record_cause
from .collectives import CollectivesMixin
from .errors import BootstrapError, CommAbortedError, PeerError

MAX_TAG = (1 << 62) - 1

_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
# The communicators open on each rendezvous store (the world and those split from it share
# it): the store closes when the last of them closes, so that closing the world on one rank
# leaves its sub-communicators working (their first collective, a split, use the store).
_store_users: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_native_adopted = False


def _native():
    global _native_adopted
    from . import _native as native
    if not _native_adopted:
        adopt_native(native)  # its requests count as linkwise.Request; await on them works
        # comm.isend / irecv / sendrecv / sendrecv_replace become native methods
        # (bind_p2p_entries.cc): they run a plain call (host arrays, int peers and tags)
        # themselves, 0.3-0.6 us faster, and pass any other to the Python definitions below
        # (isend / irecv: to _post, which is all those do; the other two as _sendrecv and
        # _sendrecv_replace).
        Communicator.isend = native.comm_isend
        Communicator.irecv = native.comm_irecv
        Communicator.sendrecv = native.comm_sendrecv
        Communicator.sendrecv_replace = native.comm_sendrecv_replace
        _native_adopted = True
    return native


def _is_cuda(x: Any) -> bool:
    """True for arrays in CUDA device memory (torch CUDA tensors, CuPy, CUDA DLPack)."""
    if not (hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack_device__") or hasattr(x, "is_cuda")):
        return False
    from .cuda.arrays import is_cuda_array
    return is_cuda_array(x)


def _as_buffer(x: Any, op: str) -> Any:
    """A NumPy view (no copy) of x, an object whose buffer the native layer could not take: a
    DLPack array, a CPU torch.bfloat16 tensor (typed as _bf16.dtype()), or x itself when it is
    a NumPy array of a dtype the buffer protocol cannot export (ml_dtypes' bfloat16). Pass it
    to the native layer through _raw (those dtypes as raw bytes)."""
    if _is_cuda(x):
        raise TypeError(f"{op}: got a CUDA array ({type(x).__name__}); {op} moves host memory. "
                        "Use send/recv or the collectives, which take CUDA arrays and are already "
                        "asynchronous (enqueued on the array's stream), or copy it to the host.")
    import numpy as np
    if isinstance(x, np.ndarray) and x.dtype.kind == "V":
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, BufferError, RuntimeError) as exc:
            a = _bf16.torch_view(x)  # np.from_dlpack has no bfloat16
            if a is not None:
                return a
            raise TypeError(f"{op}: cannot view {type(x).__name__} through DLPack on the host: {exc}") from None
    raise TypeError(f"{op}: expected an array with the buffer protocol or __dlpack__, got {type(x).__name__}")


def _default_spin_us(cpus_per_rank: float) -> float:
    spin = config.get("LINKWISE_SPIN_US")
    if spin >= 0:
        return float(spin)
    # A core per local rank: spinning a while saves a futex wake-up. More ranks than cores:
    # a spinning rank steals the core its peer needs, so go to sleep almost at once.
    return 50.0 if cpus_per_rank >= 1 else 1.0


class Communicator(CollectivesMixin, GatherScatterMixin, CoroutineCollectivesMixin):
    """A group of ranks that can message each other. Made by :func:`linkwise.init`."""

    def __init__(self, rank: int, size: int, *, local_rank: int = 0, local_size: int = 1,
                 launcher: str = "none", store=None, job_id: str = "", comm_id: str = "world",
                 timeout: Optional[float] = None, _watch=None):
        # _watch (split only): a _split_watch.MemberWatch that every wait of this setup calls
        # between short slices, raising PeerError when a member died (the store no longer
        # watches ranks once init() is done).
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.launcher = launcher
        self.job_id = job_id
        self.comm_id = comm_id
        self.timeout = config.get("LINKWISE_TIMEOUT") if timeout is None else config.seconds(timeout)
        self._store = store
        self._closed = False
        if store is not None:
            _store_users.setdefault(store, weakref.WeakSet()).add(self)
            self._unclosed = weakref.finalize(self, _release_unclosed, store, os.getpid())
            self._unclosed.atexit = False  # at exit, _close_all (or the process's end) decides
        tag = f"{comm_id}/setup"
        cards = _setup.exchange_host_cards(store, tag, rank, size, _watch) if size > 1 else [_setup.own_card(0)]
        _setup.refuse_bad_cards(store, tag, rank, size, cards, self.timeout, _watch)
        # CPUs this rank may count as its own (spinning, helper threads; see cpus_per_rank).
        self._cpus_per_rank = _setup.cpus_per_rank(
            cards, rank, max(local_size, config.get("LINKWISE_LOCAL_SIZE") or 1))
        detour = config.get("LINKWISE_COPY_DETOUR")
        _native().set_copy_detour(-1 if detour == "auto" else int(detour in ("on", "1")))
        self._native = _native().NativeComm(rank, size, _default_spin_us(self._cpus_per_rank),
                                            config.get("LINKWISE_SHM_RNDV_THRESHOLD"))
        self.transports: dict[int, str] = {}
        if size > 1:
            self.transports = _setup.setup_links(self._native, store, tag, rank, size, job_id, self.timeout,
                                                 cards, comm_id="" if comm_id == "world" else comm_id,
                                                 watch=_watch)
        _live.add(self)
        self._shm = size > 1 and _shm_exec._all_shm(self) and self._attach_shm() or False
        if size == 1:  # the latency paths of one rank: a copy of x, natively (bind_solo.cc)
            self._fast_shm = _native().SoloColl()

    # -- argument checks ------------------------------------------------------------------
    def _check(self, peer: Any, tag: Any, op: str) -> tuple[int, int]:
        """(peer, tag) as Python ints (NumPy integers accepted, as for roots), or the error."""
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: {op} on a closed communicator")
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):  # True is an int
            raise ValueError(f"{op}: rank must be an integer 0..{self.size - 1}, got {peer!r} "
                             f"({type(peer).__name__})")
        if not 0 <= peer < self.size:
            raise ValueError(f"{op}: rank {peer!r} is out of range; this communicator has ranks 0..{self.size - 1}")
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag <= MAX_TAG:
            raise ValueError(f"{op}: tag must be an int in 0..2**62-1, got {tag!r}")
        return int(peer), int(tag)

    def _timeout(self, timeout: Optional[float], op: str) -> float:
        return self.timeout if timeout is None else config.seconds(timeout, op)

    # -- point-to-point -------------------------------------------------------------------
    def send(self, x: Any, dst: int, tag: int = 0, *, timeout: Optional[float] = None,
             stream: Any = None) -> None:
        """Send array x to rank dst. Returns once x may be reused.

        A CUDA array goes GPU to GPU (CUDA IPC / NVLink), enqueued on `stream` (else the array's
        current stream) like NCCL: it returns before the GPU has moved the data."""
        dst, tag = self._check(dst, tag, "send")
        try:
            self._native.send(x, dst, tag, self._timeout(timeout, "send"))
        except TypeError as exc:
            if "buffer protocol" not in str(exc):
                raise
            if _is_cuda(x):
                self.cuda().send(x, dst, tag, stream=stream)
                return
            self._native.send(_raw(_as_buffer(x, "send")), dst, tag, self._timeout(timeout, "send"))

    def recv(self, x: Any, src: int, tag: int = 0, *, timeout: Optional[float] = None,
             stream: Any = None) -> int:
        """Receive into array x from rank src; returns the number of bytes received.

        A message larger than x raises ValueError (and stays queued for a larger receive).
        A CUDA array is received GPU to GPU, enqueued on `stream` as for send."""
        src, tag = self._check(src, tag, "recv")
        try:
            return self._native.recv(x, src, tag, self._timeout(timeout, "recv"))
        except TypeError as exc:
            if "buffer protocol" not in str(exc):
                raise
            if _is_cuda(x):
                return self.cuda().recv(x, src, tag, stream=stream)
            return self._native.recv(_raw(_as_buffer(x, "recv")), src, tag, self._timeout(timeout, "recv"))

    def sendrecv(self, x: Any, dst: int, out: Any, src: int, send_tag: int = 0, recv_tag: int = 0, *,
                 timeout: Optional[float] = None, stream: Any = None) -> int:
        """Send x to rank dst while receiving into out from rank src (MPI_Sendrecv); returns the
        bytes received. One call: no deadlock when every rank of a ring calls it at once.

        Host arrays go in one native call; CUDA arrays through the GPU plane, enqueued on
        `stream` (else the array's current stream) like send and recv (linkwise.cuda.sendrecv)."""
        dst, send_tag = self._check(dst, send_tag, "sendrecv")
        src, recv_tag = self._check(src, recv_tag, "sendrecv")
        t = self._timeout(timeout, "sendrecv")
        try:
            return self._native.sendrecv(x, dst, send_tag, out, src, recv_tag, t)
        except TypeError as exc:
            if "buffer protocol" not in str(exc):
                raise
        if _is_cuda(x) or _is_cuda(out):  # both must be CUDA arrays: view() says so otherwise
            from .cuda.sendrecv import gpu_sendrecv
            return gpu_sendrecv(self.cuda(), x, dst, out, src, send_tag, recv_tag, stream)
        # DLPack host arrays (torch CPU tensors): NumPy views of them in the same native call,
        # which checks them as it checks any array (x and out must not overlap).
        return self._native.sendrecv(_raw(_as_array(x, "sendrecv")), dst, send_tag,
                                     _raw(_as_array(out, "sendrecv", "out")), src, recv_tag, t)

    def sendrecv_replace(self, x: Any, dst: int, src: int, send_tag: int = 0, recv_tag: int = 0, *,
                         timeout: Optional[float] = None, stream: Any = None) -> int:
        """Send x to rank dst, then hold in x what rank src sent (MPI_Sendrecv_replace); returns
        the bytes received. The message from src may be shorter than x (the rest of x keeps what
        it held) but not longer (ValueError, as for recv).

        A copy of x is sent while the receive lands in x: one extra copy of x, as MPI makes
        (into memory the communicator keeps for it, up to 16 MiB). A CUDA array (torch, cupy,
        DLPack) is copied on `stream` (else its current stream) and exchanged as sendrecv does;
        its message must be x's size, as for GPU send and recv. One known only by
        __cuda_array_interface__ raises TypeError (nothing could allocate its copy)."""
        dst, send_tag = self._check(dst, send_tag, "sendrecv_replace")
        src, recv_tag = self._check(src, recv_tag, "sendrecv_replace")
        t = self._timeout(timeout, "sendrecv_replace")
        try:
            return self._native.sendrecv_replace(x, dst, send_tag, src, recv_tag, t)
        except TypeError as exc:
            if "buffer protocol" not in str(exc):
                raise
        if _is_cuda(x):
            from .cuda.sendrecv import gpu_sendrecv_replace
            return gpu_sendrecv_replace(self.cuda(), x, dst, src, send_tag, recv_tag, stream)
        # DLPack arrays (torch CPU tensors, bfloat16 ones too): through sendrecv's own fallback.
        return self.sendrecv(_as_buffer(x, "sendrecv_replace").copy(), dst, x, src, send_tag, recv_tag,
                             timeout=t)

    # The general paths of the native sendrecv / sendrecv_replace (_native() above).
    _sendrecv, _sendrecv_replace = sendrecv, sendrecv_replace

    def cuda(self):
        """This communicator's GPU data plane (linkwise.cuda.GpuComm), built on first use.

        Building it is collective: every rank of the communicator must reach its first GPU
        operation (or call comm.cuda()) so that CUDA IPC handles can be exchanged."""
        g = getattr(self, "_gpu_comm", None)
        if g is None:
            from .cuda import gpu_comm
            g = gpu_comm(self)
        return g

    def _post(self, x: Any, peer: int, tag: int, is_send: bool, is_async: bool,
              timeout: Optional[float], stream: Any = None):
        op = ("asend" if is_async else "isend") if is_send else ("arecv" if is_async else "irecv")
        peer, tag = self._check(peer, tag, op)  # the native isend / irecv took the plain calls before this
        post = self._native.isend if is_send else self._native.irecv
        try:
            native_req = post(x, peer, tag, is_async, self._timeout(timeout, op))
        except TypeError as exc:
            if "buffer protocol" not in str(exc):
                raise
            if _is_cuda(x):  # enqueued on the stream; a GpuRequest (CUDA event) tracks it
                g = self.cuda()
                req = (g.isend if is_send else g.irecv)(x, peer, tag, stream=stream)
                req._timeout = self._timeout(timeout, op)
                return req
            x = _raw(_as_buffer(x, op))
            native_req = post(x, peer, tag, is_async, self._timeout(timeout, op))
        return native_req  # it holds x (and its buffer) until done

    # isend / irecv: replaced by native methods of the same behaviour when the native module is
    # loaded (_native() above); these are their general path. (So are sendrecv and
    # sendrecv_replace above, which the native methods call as _sendrecv / _sendrecv_replace.)
    def isend(self, x: Any, dst: int, tag: int = 0, *, timeout: Optional[float] = None,
              stream: Any = None):
        """Start sending x to rank dst; the returned request's wait()/test() finish it.

        A CUDA array is enqueued on `stream` (else its current stream) as send() does; the
        request (linkwise._request.GpuRequest) waits for a CUDA event recorded after it."""
        return self._post(x, dst, tag, True, False, timeout, stream)

    def irecv(self, x: Any, src: int, tag: int = 0, *, timeout: Optional[float] = None,
              stream: Any = None):
        """Start receiving into x from rank src; the returned request's wait()/test() finish it
        (CUDA arrays: as isend)."""
        return self._post(x, src, tag, False, False, timeout, stream)

    async def asend(self, x: Any, dst: int, tag: int = 0, *, timeout: Optional[float] = None,
                    stream: Any = None) -> None:
        """Coroutine send: ``await comm.asend(x, dst)``."""
        await self._post(x, dst, tag, True, True, timeout, stream)

    async def arecv(self, x: Any, src: int, tag: int = 0, *, timeout: Optional[float] = None,
                    stream: Any = None) -> int:
        """Coroutine receive: ``n = await comm.arecv(x, src)``; returns bytes received."""
        return await self._post(x, src, tag, False, True, timeout, stream)

    # -- sub-communicators ---------------------------------------------------------------
    def split(self, color: Optional[int], key: Optional[int] = None):
        """A new communicator over the ranks that pass the same color, ordered by (key, rank).

        Every rank must call it; color=None (MPI_UNDEFINED) joins no group and returns None.
        The new communicator has its own links and its own collective sequence."""
        from ._setup import host_identity
        self._check_open("split")
        # Arguments one rank refuses still take part in the exchange (a "refused" card), so
        # every rank raises and the splits stay numbered alike: a refusal on one rank alone
        # once paired its next split with the others' earlier one.
        why = None
        if color is not None and (isinstance(color, bool) or not isinstance(color, (int, np.integer)) or color < 0):
            why = f"color must be a non-negative int or None, got {color!r}"
        elif key is not None and (isinstance(key, bool) or not isinstance(key, (int, np.integer))):
            why = f"key must be an int or None, got {key!r}"
        key = self.rank if key is None or why else int(key)
        n = getattr(self, "_split_count", 0)
        self._split_count = n + 1
        tag = f"{self.comm_id}/split{n}"
        me = json.dumps(["refused", why, None] if why else
                        [None if color is None else int(color), key, host_identity()]).encode()
        if self.size == 1:
            cards = [json.loads(me)]
        else:  # a peer that died fails the split at once (PeerError)
            everyone = MemberWatch(self._native, self.rank, range(self.size), "split")
            cards = [json.loads(c) for c in self._store.all_gather(tag, self.rank, self.size, me,
                                                                     alive=everyone.alive)]
        refused = [(r, c[1]) for r, c in enumerate(cards) if c[0] == "refused"]
        if refused:
            r, reason = refused[0]
            where = "this rank" if r == self.rank else f"rank {r}"
            raise ValueError(f"split: {where} refused its arguments ({reason}); no rank split")
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k, _) in enumerate(cards) if c == color)
        ranks = [r for _, r in members]
        new_rank = ranks.index(self.rank)
        host = cards[self.rank][2]
        local = [r for r in ranks if cards[r][2] == host]
        comm_id = f"{self.comm_id}-s{n}c{int(color)}"
        # Its setup waits on its members only: a death in another colour does not stop it.
        notes = f"{tag}/gave-up"  # who named whom (_split_watch: the rank that actually died)
        members = MemberWatch(self._native, self.rank, ranks, f"split (setting up {comm_id})",
                              self._store, notes)
        try:
            return type(self)(new_rank, len(ranks), local_rank=local.index(self.rank), local_size=len(local),
                              launcher=self.launcher, store=self._store, job_id=self.job_id,
                              comm_id=comm_id, timeout=self.timeout, _watch=members)
        except Exception as exc:
            # A failure of the new one's setup while a member is known to have died is that
            # death, named as this communicator numbers it: the new one's own steps (its
            # executor's) use its numbers, and opening a dead rank's segment fails as an
            # OSError. The watch's errors (op "split") and the store's (StoreClosedError:
            # rank 0) name it so already.
            if not (isinstance(exc, PeerError) and (exc.op == "split" or isinstance(exc, BootstrapError))):
                try:
                    members()
                except PeerError as named:
                    record_cause(self._store, notes, self.rank, named.peer)
                    raise named from exc
            elif exc.op == "split":  # the watch named a dead member (not the store's end: rank 0)
                record_cause(self._store, notes, self.rank, exc.peer)
            raise

    # -- information and lifetime ---------------------------------------------------------
    def link(self, peer: int) -> str:
        """How this rank reaches peer, e.g. 'shared memory to rank 1 (pid 123)'."""
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: link on a closed communicator")
        return self._native.describe_link(peer)

    def close(self) -> None:
        """Release links and shared memory. Pending operations fail with CommAbortedError."""
        if self._closed:
            return
        self._closed = True
        gpu = getattr(self, "_gpu_comm", None)
        if gpu is not None:
            gpu.close()
            self._gpu_comm = None
        # The peers learn of the close as of a death: PeerError naming this rank once they wait
        # on it for something it never sent (the executor's closed word; the links' streams
        # end after what was written).
        shm = self.__dict__.get("_shm")
        if shm:
            shm.mark_closed()
            # A call in progress (another thread's, or async ones pending) fails too: its own
            # waits see this rank's failed word. Calls already done are not touched (the stop
            # is from the next number; a wait on a word already reached never looks).
            shm.stop()
            # Released now, not when this object is collected (~6 MiB of shared memory, pidfds,
            # the engine it holds). Calls in progress hold their own reference. Peers lose
            # nothing: the segment is one memfd that every rank maps, and pieces a peer may
            # still read after a completed call (a broadcast root returns before its readers)
            # stay in its own mapping; no peer reads this rank's private memory once a call
            # has returned here (the single-copy paths wait for every peer's done word).
            self._shm = False
        self._native.close("the communicator was closed")
        self._native = None
        self._fast_shm = None  # the latency paths end here; later calls take the general path and raise
        unclosed = self.__dict__.get("_unclosed")
        if unclosed is not None:
            unclosed.detach()
        users = _store_users.get(self._store) if self._store is not None else None
        if users is not None:
            users.discard(self)
            if not users:  # the last open communicator on this store
                self._store.close()
        self._store = None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<linkwise.Communicator rank {self.rank} of {self.size} ({self.comm_id})>"


def _release_unclosed(store, pid: int) -> None:
    """A communicator collected without close(): its store closes with the last communicator
    using it, as close() does. Before, rank 0's listener and its accept thread outlived it, and
    each later init() moved to the next spare port until none was left ("cannot listen").
    Never in a forked child (pid: the maker's): its copies of the store's sockets are the
    parent's, which closing them would shut down."""
    if os.getpid() != pid:
        return
    users = _store_users.get(store)
    if users is None or not any(True for _ in users):  # iterating skips the collected ones
        store.close()


def _forget_parents_communicators() -> None:
    """In a forked child: the parent's communicators are not the child's to close (closing
    them at the child's exit shut the parent's store sockets, which the two share); _world
    forgets the parent's world counts itself."""
    _live.clear()
    _store_users.clear()


os.register_at_fork(after_in_child=_forget_parents_communicators)


@atexit.register
def _close_all() -> None:
    # A daemon thread still alive at exit may be blocked in a linkwise call: closing would wake
    # it, and a thread that takes the GIL back while the interpreter finalizes is ended by
    # pthread_exit, which aborts the process from native frames (SIGABRT). Then leave the
    # communicators to the process exit, which peers see as this rank leaving (PeerError).
    main = threading.main_thread()
    if any(t is not main and not t.name.startswith("linkwise-") for t in threading.enumerate()):
        return
    for comm in list(_live):
        try:
            comm.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def __getattr__(name: str):
    """``linkwise.comm.init``: where ``init`` lived before it moved to ``_world`` (imported
    lazily: _world imports this module)."""
    if name == "init":
        from ._world import init
        return init
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The shared-memory collective executor of a communicator (csrc/algo/shm_coll.h): its
default settings (single-copy thresholds, helper threads, one-shot limit), attaching it, and
ExecutorMixin, the Communicator's side of it (which calls it runs, calls refused on this
rank). Used by collectives.py; the settings are rank 0's once connected, so every rank takes
the same protocol.
"""
from __future__ import annotations

import time

from . import config
from ._coll_args import _ENV, _check_tunables, _env_set, _native_module
from .plan.schedule import LARGE_PAIR_BCAST

NEVER = (1 << 63) - 1
# Helper threads per rank by default at most. LINKWISE_COLL_THREADS may ask for up to 16 (the
# executor's lane counters, ShmColl::kMaxLanes). 16 threads for 4 ranks on the 64-core host (all
# 64 cores busy) ran the 4 MiB all_reduce in ~210-260 us instead of ~310-400 on one VM, and 2-3x
# slower than 8 on two others, where any other runnable task preempts a lane that every peer
# waits for (docs/benchmarks.md, ninth session). So the default leaves cores free: at most 8,
# and at most 3/4 of the CPUs a rank may count as its own (THREAD_SHARE). On three VMs of the
# eleventh session, 16 ranks with 4 threads each (all 64 cores) ran the 1-4 MiB all_reduce
# about 2x slower than with 2 or 3, and 8 ranks with 8 each 2-3x slower than with 4. A rank
# with 2 CPUs still gets 2 (THREADS_AT_TWO_CPUS): on the 32-core host (fifteenth session,
# alternated) 16 ranks with 2 threads each ran the 1-16 MiB all_reduce faster than with 1 in
# most rounds (up to 2.4x; one round 2.5x slower, every core busy), and 4 ranks on 8 CPUs
# 1.2-2.3x faster in every round.
DEFAULT_MAX_THREADS = 8
THREAD_SHARE = 0.75
THREADS_AT_TWO_CPUS = 2
ONE_SHOT_CAP = 32 << 10    # the executor's one-shot area (ShmColl::kOneMax)
_ONE_SHOT_READS = 16 << 10  # one-shot while ranks x bytes stay within this (see cma_settings)


def cma_settings(cpus_per_rank: float, size: int) -> tuple:
    """The executor's single-copy (CMA), helper-thread and one-shot settings: (enable,
    all_reduce min, broadcast min, chunk, piece, lane min, threads, one-shot max). Threads
    default to 3/4 of the CPUs this rank may count as its own (``_setup.cpus_per_rank``: its
    share of the host's), at most DEFAULT_MAX_THREADS, so a many-core host moves a big message
    with several cores per rank and keeps a quarter free; 2 with 2 to 8/3 CPUs (faster than 1
    there, measured); 1 when cores are scarce.
    With several threads, the copy-through-shared-memory two-shot all_reduce and ring
    broadcast run a message of at least 2 × lane min bytes as up to `threads` independent
    lanes (rank 0's threads decide the count). Default thresholds (docs/benchmarks.md):
    - all_reduce from 8 MiB, and only with several threads per rank: with one, the kernel's
      copies lose to the copy-through-shared-memory path's memcpy (2-core VM, A/B runs); at
      4 MiB the lanes through the segment beat it (64-core host, 4 ranks: ~290-360 us against
      450-940), at 8 MiB and more it wins. Below 4 MiB NumPy arrays have 4 KiB pages (it asks
      for huge pages from 4 MiB on), and process_vm_readv/writev pay ~1 us per page;
    - broadcast: from 8 MiB (below, the ring through the segment stays in cache and wins, 2
      ranks A/B), up to 4 ranks (with 16, the readers all pinning the root's pages at once ran
      slower than the ring on the 64-core host); from 4 MiB with 2 ranks of one thread (where
      NumPy's arrays get huge pages: out of place ~20% faster than the ring, in place level,
      2-core VM, twenty-fifth session);
    - one-shot all_reduce (every rank reads every input) up to 16 KiB / ranks bytes when each
      rank has a core, two-shot above: on the 64-core host the two-shot was faster from 2 KiB
      at 16 ranks (4.5-5.2 us against 7.8-8.4), 4 KiB at 8, 8 KiB at 5 and 16 KiB at 4 ranks
      (ninth session). With 2 ranks, or ranks sharing cores (where each extra wait can cost a
      context switch), one-shot up to the executor's 32 KiB.
    The executor takes rank 0's sizes, so every rank picks the same protocol."""
    threads = config.get("LINKWISE_COLL_THREADS")
    if threads <= 0:
        share = max(int(cpus_per_rank * THREAD_SHARE), min(THREADS_AT_TWO_CPUS, int(cpus_per_rank)))
        threads = max(1, min(DEFAULT_MAX_THREADS, share))
    ar_min = config.get("LINKWISE_COLL_CMA_MIN") or (8 << 20 if threads > 1 else NEVER)
    bc_min = config.get("LINKWISE_COLL_CMA_BCAST_MIN") or (
        (4 << 20 if size == 2 and threads == 1 else 8 << 20) if size <= 4 else NEVER)
    one_max = config.get("LINKWISE_COLL_ONE_SHOT_MAX") or (
        ONE_SHOT_CAP if size <= 2 or cpus_per_rank < 1 else max(64, _ONE_SHOT_READS // size))
    return (config.get("LINKWISE_SHM_CMA"), ar_min, bc_min, config.get("LINKWISE_COLL_CMA_CHUNK"),
            config.get("LINKWISE_COLL_CMA_PIECE"), config.get("LINKWISE_COLL_LANE_MIN"), threads, one_max)


def _all_shm(comm) -> bool:
    return comm._store is not None and bool(comm.transports) and all(v == "shm" for v in comm.transports.values())


def _state_key(comm, rank: int) -> str:
    return f"{comm.comm_id}/shmcoll/state/{rank}"  # that rank reached attach (its state: "ok")


def _raise_if_aborted(comm) -> None:
    """CommAbortedError when an abort notice has reached this rank (read now); ValueError
    when a peer refused the arguments of the call this rank attaches for (its refusal notice,
    Engine::notify_refused: collectives through the executor leave the point-to-point number
    as it is, so this call's is the communicator's current one), since it would never come."""
    from .errors import CommAbortedError
    comm._native.poll()
    why = comm._native.abort_reason_for(comm._coll_seq)  # a peer's notice may stop only later calls
    if why:
        peer = comm._native.abort_peer_for(comm._coll_seq)
        if peer >= 0:  # a rank died or failed (a peer's notice names it): as the engine's own errors
            from .errors import PeerError
            raise PeerError(why, comm.rank, peer, "collective setup") from None
        raise CommAbortedError(why) from None
    who = comm._native.refused_by(comm._coll_seq)
    if who >= 0:
        raise ValueError(f"rank {comm.rank}: rank {who} refused its arguments of the collective this rank sets "
                         "up the shared-memory executor for (its ValueError or TypeError says why) and will not "
                         "take part; call each collective with the same arguments, in the same order, on every "
                         "rank")


def _raise_if_gone(comm, peer: int) -> None:
    """PeerError when peer's process is known to have exited (or closed its link)."""
    if not comm._native.peer_alive(peer):
        from .errors import PeerError
        raise PeerError(f"rank {comm.rank}: peer rank {peer} died or left ({comm._native.describe_link(peer)}) "
                        "before this communicator's shared-memory collectives were set up. Look at that "
                        "rank's output for the cause.", comm.rank, peer, "collective setup") from None


def _state_of(comm, r: int) -> bytes:
    """Rank r's state for attach, waited for in short slices: between them the engine reads
    abort notices, since a peer whose collective failed may not come here at all (it may
    call something else, or sleep) while its notice is already on the way, and looks whether
    r (or rank 0, the store's host) died, which it would otherwise learn only at the timeout.
    When rank 0 stopped the collectives and then exited, the store is gone, and the abort
    notice it sent first is what this rank reports (not the closed store)."""
    from .errors import TimeoutError
    from .store import StoreClosedError
    key = _state_key(comm, r)
    deadline = time.monotonic() + comm.timeout
    while True:
        try:
            return comm._store.get(key, max(0.0, min(0.1, deadline - time.monotonic())))
        except StoreClosedError:
            _raise_if_aborted(comm)
            _raise_if_gone(comm, 0)
            raise
        except TimeoutError:
            _raise_if_aborted(comm)
            _raise_if_gone(comm, r)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rank {comm.rank}: rank {r} did not reach this communicator's first "
                                   f"shared-memory collective within {comm.timeout:g} s (LINKWISE_TIMEOUT); "
                                   "every rank must make the same collective calls in the same order") from None


def _step(comm, name: str) -> None:
    """A barrier of comm's ranks through the store that raises PeerError within ~0.25 s when
    a rank that has not arrived died (a plain store barrier waited the whole timeout)."""
    comm._store.all_gather(name, comm.rank, comm.size, b"", comm.timeout,
                           alive=lambda r: r == comm.rank or comm._native.peer_alive(r))


def attach(comm):
    """Maps comm's shared-memory collective segment (a collective step: every rank of an
    all-shared-memory communicator reaches it when the communicator is made, see
    ExecutorMixin._attach_shm) and connects the executor; None when some peer is not reached
    over shared memory. Sets comm._pair_bcast_p2p; the latency path comes later (_shm_for)."""
    if not _all_shm(comm):
        return None
    from ._setup import SHM_PREFIX
    from .comm import _default_spin_us
    from .errors import CommAbortedError
    name = f"/{SHM_PREFIX}{comm.job_id}-coll-{comm.comm_id}"
    tag = f"{comm.comm_id}/shmcoll"
    spin = _default_spin_us(comm._cpus_per_rank)
    # Every rank says it has come: the first step, waited for in slices that look for dead
    # ranks and abort notices (_state_of).
    from .store import StoreClosedError
    try:
        comm._store.set(_state_key(comm, comm.rank), b"ok")
    except StoreClosedError:  # rank 0 stopped the collectives and exited (see _state_of)
        _raise_if_aborted(comm)
        raise
    for r in range(comm.size):
        state = _state_of(comm, r)
        if state != b"ok":
            raise CommAbortedError(f"rank {comm.rank}: rank {r} had stopped this communicator's collectives "
                                   f"when they were to be set up here ({state.decode(errors='replace')})")
    shm = None
    try:
        # Rank 0 makes a private segment (memfd, never in /dev/shm) and says where it is.
        if comm.rank == 0:
            shm = _native_module().ShmColl(comm._native, name, True, spin)
            comm._store.set(f"{tag}/name", shm.segment_name.encode())
        _step(comm, f"{tag}/created")
        if comm.rank != 0:
            where = comm._store.get(f"{tag}/name", comm.timeout).decode()
            shm = _native_module().ShmColl(comm._native, where, False, spin)
        _step(comm, f"{tag}/mapped")
    finally:
        if comm.rank == 0 and shm is not None:
            shm.unlink()  # every rank has mapped it (or setup failed): no one else may open it
    shm.connect(comm.timeout, *cma_settings(comm._cpus_per_rank, comm.size))
    comm._pair_bcast_p2p = shm.cma_bcast_min > LARGE_PAIR_BCAST  # agreed: same on every rank
    shm.enable_fast_entries()
    shm.fast_bcast_max = LARGE_PAIR_BCAST if comm.size == 2 and comm._pair_bcast_p2p else NEVER
    return shm


# Collectives the shared-memory executor runs at every size within a host (the block ones:
# its one-shot area when small, rounds in its two-shot areas when larger).
_EXECUTOR_KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather")
# scatter only while its blocks fit the one-shot area: through the executor the root would
# post every block (n x the bytes on one rank), where messages let each rank copy its block
# straight out of the root's x (16 ranks, 32-core host: 4-9x slower from 1 MiB).


class ExecutorMixin:
    """The executor's side of CollectivesMixin: which calls it runs, attaching it, and numbering
    calls refused on this rank (uses self._native, self._coll_seq, self.size, self.timeout)."""

    def _skip_call(self) -> None:
        """A collective refused on this rank: its point-to-point number and its shared-memory
        executor call number move on as if it had run (see _skips_on_argument_error), and the
        peers waiting in it for this rank raise instead of waiting for the timeout (the
        executor's refused word; over messages, a refusal notice that fails their receives of
        it from this rank)."""
        seq = self._coll_seq
        self._coll_seq = seq + 1
        native = self.__dict__.get("_native")
        if native is not None:
            native.notify_refused(seq)
        shm = self.__dict__.get("_shm")
        if shm:
            worker = self.__dict__.get("_coll_worker")
            if worker is not None and worker.pending:
                worker.submit_skip(shm)  # behind the pending async calls: issue order
            else:
                shm.skip_call()

    def _stop_shm(self) -> None:
        """This rank gave up on a collective: the ranks' collective sequences may no longer
        agree, so stop the shared-memory executor too from this rank's next call (a call of it
        in progress here fails, its waiting peers raise PeerError, and every later call there
        raises; a late rank still finishes the calls before), rather than let the next call
        pair with a different call on another rank."""
        shm = self.__dict__.get("_shm")
        if shm:
            shm.stop()

    def _shm_for(self, kind: str, nbytes: int):
        """The shared-memory executor for this call, or None for the point-to-point algorithms.

        Used for all_reduce, reduce and broadcast when every peer is on this host (shared-memory
        links) and LINKWISE_ALGO does not force a point-to-point algorithm ("direct" = one-shot
        through shared memory for all_reduce), for reduce_scatter, all_gather, all_to_all and
        gather (one round through the segment while all the blocks have at most 32 KiB, else
        rounds in the two-shot areas), and for scatter whose size blocks have at most 32 KiB
        (nbytes is one block's). The same on every rank (the executor itself was attached when
        the communicator was made: self._shm, False where some peer is not on this host)."""
        if self.size == 1:
            return None
        if kind == "scatter":
            if nbytes * self.size > ONE_SHOT_CAP:
                return None
        elif kind not in _EXECUTOR_KINDS:
            return None
        if kind == "broadcast" and self.size == 2 and nbytes >= LARGE_PAIR_BCAST and self._pair_bcast_p2p:
            return None  # without CMA in the executor: one single-copy message beats two copies
        algo = config.get("LINKWISE_ALGO") if _env_set(b"LINKWISE_ALGO") else ""
        if algo and not (algo == "direct" and kind == "all_reduce"):
            return None
        shm = self.__dict__.get("_shm")
        if shm and self.__dict__.get("_latency_later"):
            # The latency path (comm._fast_shm) reads no tunable: they are checked first, at
            # this first general-path call. Not while async collectives exist: they run in
            # issue order on the worker, which the latency path would overtake.
            _check_tunables()
            self._latency_later = False
            if self.__dict__.get("_coll_worker") is None and _ENV is not None:
                self._fast_shm = shm
        return shm or None

    def _attach_shm(self):
        """Attaches the executor when the communicator is made (init, split: collective steps
        every rank reaches), not at its first collective: that set-up waits for every rank, so
        an async first collective waited for them, and over shared memory a rank that sent its
        peer a message after an async all_reduce hung. The latency path follows at the first
        general-path call (_shm_for)."""
        self._latency_later = True
        try:
            return attach(self)
        except BaseException as exc:
            # The ranks left the setup step at different points: no later collective of this
            # communicator can be trusted to pair up (nor would setup be retried in step), so
            # every later one raises CommAbortedError, here and (the notice) on the peers: a
            # peer that refused the call this setup was for must not wait at the next one.
            from .errors import PeerError
            blame = exc.peer if isinstance(exc, PeerError) else -1  # the peers' PeerError names it
            self._native.abort(f"setting up the shared-memory collectives failed: {exc}", notify=True, blame=blame,
                               stop_from=self._coll_seq)
            raise

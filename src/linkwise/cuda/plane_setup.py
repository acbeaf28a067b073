"""Making a communicator's GPU plane (GpuComm's constructor): the steps every rank takes
through the rendezvous store (``comm._store``) before any kernel can run, and what the others
see when one rank fails there.

Steps, collective, under one store key per attempt (:func:`plane_key`: every attempt takes the
next number on every rank, so after a failed attempt the ranks' next ones still meet):
 1. cards (:func:`exchange_cards`): each rank's (host, pid namespace, pid) and its first
    invalid GPU setting; or, from a rank that refused the arguments of its first GPU call
    (:func:`refuse_before_plane`), that refusal;
 2. the IPC handles of every rank's scratch area, then a barrier once every rank mapped them
    (GpuComm.__init__; not host-staged);
 3. at close(), a barrier.
Every wait of them polls the communicator's own peer watch (:func:`member_watch`, as a split's
setup does, _split_watch.py): a rank that died raises PeerError naming it within about
store.WATCH_SLICE instead of LINKWISE_TIMEOUT. The store no longer watches ranks once init()
is done, and the GPU engine's own watch (peer_watch.h) starts only once the plane is made.

Threading: the caller's thread, one setup at a time per communicator (as GpuComm).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

from .. import config

_counter: dict = {}  # comm_id -> GPU plane attempts so far in this process


def _native():
    from .. import _native as n
    return n


def select_device(comm, device: Optional[int] = None) -> int:
    """`device`, else LINKWISE_DEVICE, else local_rank % the visible GPUs; ValueError when
    the ordinal is not one of the visible GPUs (CUDA would fail every call on it later)."""
    if device is None:
        device = config.get("LINKWISE_DEVICE")  # ValueError naming the variable when not an int
    count = _native().cuda_device_count()
    if count <= 0:
        raise RuntimeError(f"rank {comm.rank}: no CUDA device is visible")
    if device is None:
        return int(getattr(comm, "local_rank", comm.rank)) % count
    device = int(device)
    if not 0 <= device < count:
        src = "LINKWISE_DEVICE" if os.environ.get("LINKWISE_DEVICE") else "device"
        raise ValueError(f"rank {comm.rank}: {src}={device} is out of range: {count} CUDA "
                         f"device(s) visible to this process (ordinals 0..{count - 1}, after "
                         "CUDA_VISIBLE_DEVICES)")
    return device


def plane_key(comm) -> str:
    """The store key of this communicator's next GPU plane attempt (takes its number)."""
    cid = getattr(comm, "comm_id", "world")
    k = _counter[cid] = _counter.get(cid, 0) + 1
    return f"{cid}/gpu/{k}"


def member_watch(comm):
    """A watch for the store waits of the plane's setup and close: raises PeerError naming a
    rank of `comm` that died (its CPU engine watches every peer: a pidfd on this host, the
    stream's end over TCP). None where there is no engine to ask (a one-rank communicator)."""
    native = comm.__dict__.get("_native") if hasattr(comm, "__dict__") else None
    if native is None or comm.size == 1:
        return None
    from .._split_watch import MemberWatch
    return MemberWatch(native, comm.rank, range(comm.size), "the GPU plane's setup",
                       op="gpu setup", renumbered=False)


def exchange_cards(comm, device: Optional[int], key: str, watch) -> list:
    """Step 1. Every rank's (host, pid namespace, pid) and its first invalid GPU setting
    (config.READ_BY_GPU_PLANE; the CUDA code reads several with atoi, unchecked; a device out
    of range, select_device). Raises on every rank alike when one refused: ValueError where a
    rank refused its first call's arguments (naming it and why: so the Communicator's wrapper
    numbers the call as refused on every rank, and they stay in step); for a setting,
    ValueError on that rank and BootstrapError naming it on the others. Returns the pids to
    watch (peer_watch.h): those that mean the same process here, else 0 (left to the CPU
    engine and the timeout)."""
    from .._setup import host_identity, raise_for_refused_setting
    rank = comm.rank
    error = config.first_invalid(config.READ_BY_GPU_PLANE)
    if not error:
        try:
            select_device(comm, device)
        except (ValueError, RuntimeError) as exc:
            error = str(exc).removeprefix(f"rank {rank}: ")  # the rank is named again below
    if comm.size == 1:
        raise_for_refused_setting(rank, [error], "make the GPU plane")
        return []
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = "?"
    me = {"who": f"{host_identity()}|{pidns}", "pid": os.getpid(), "error": error}
    raw = comm._store.all_gather(f"{key}/pids", rank, comm.size, json.dumps(me).encode(), watch=watch)
    cards = [json.loads(r) for r in raw]
    refused = [(r, c["refused"]) for r, c in enumerate(cards) if "refused" in c]
    if refused:
        r, why = refused[0]
        raise ValueError(f"rank {rank}: rank {r} refused the arguments of its first GPU call ({why}) "
                         "and will not take part, so no rank made the GPU plane; call each operation "
                         "with the same arguments, in the same order, on every rank")
    raise_for_refused_setting(rank, [c["error"] for c in cards], "make the GPU plane")
    return [c["pid"] if c["who"] == me["who"] and pidns != "?" else 0 for c in cards]


def refuse_before_plane(comm, exc: BaseException, agreed_first: bool) -> None:
    """This rank refused the arguments of a GPU call before its plane exists (the
    Communicator's own checks: _gpu_coll, barrier). The ranks that passed theirs go on to make
    the plane and wait there for this rank's card: it is sent now, carrying the refusal, so
    they raise at once (exchange_cards) instead of at the timeout; this rank does not wait.
    Not on one rank, nor when the others meet this rank first in LINKWISE_CHECK's agreement
    exchange (`agreed_first`, the collectives of _gpu_coll: under LINKWISE_CHECK they pass it
    before they make the plane, and it tells them: _coll_args._skips_on_argument_error)."""
    from .._coll_args import check_on
    store = getattr(comm, "_store", None)
    if comm.size == 1 or store is None or (agreed_first and check_on()):
        return
    why = f"{type(exc).__name__}: {exc}"
    store.all_gather_offer(f"{plane_key(comm)}/pids", comm.rank, json.dumps({"refused": why}).encode())


@contextlib.contextmanager
def checks_of_a_gpu_call(comm, x=None, stream=None, agreed_first: bool = False):
    """Around the Communicator's own argument checks of a GPU call (x, stream: the caller's):
    once the plane exists, its refusal (refusal.py: the others' kernels may wait for this
    rank); before, refuse_before_plane (`agreed_first`: see there). The ValueError or
    TypeError is re-raised either way."""
    g = getattr(comm, "_gpu_comm", None)
    if g is not None:
        with g._refusing(x, stream):
            yield
        return
    try:
        yield
    except (ValueError, TypeError) as exc:
        refuse_before_plane(comm, exc, agreed_first)
        raise

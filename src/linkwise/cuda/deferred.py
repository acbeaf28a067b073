"""Deferred receives of the GPU plane: recv() / irecv() never wait on the host for the sender.

A receive of ``LINKWISE_GPU_REG_MIN`` bytes or more pulls from the sender's own buffer, whose
description is a host message that the sender's send() issues (registered.py). Waiting for it
inside recv() blocked this thread until the sender got there, so "irecv, then isend" on both
ranks of a pair deadlocked until the timeout. Now recv() places the receive on the caller's
stream at once (``GpuEngine.recv_defer_begin``: that stream waits on the device until the data
is in) and a native helper thread of the source takes the description and enqueues the copy on
the source's private stream (``recv_defer_finish``; the engine's side of the contract is in
csrc/cuda/p2p_defer.cu, the threads' in csrc/bindings/defer_workers.h).

The helpers are native and never take the GIL: Python helper threads (the thirty-fifth
session's) needed it to go on after the description came, and a caller running pure Python
holds it for up to ``sys.getswitchinterval()`` (5 ms) at a time, so a receive posted before
its send started its copy a few of those late (docs/benchmarks.md, thirty-sixth session).

Fast case: when nothing from ``src`` is deferred and its description is already here (the
sender got there first), the receive is enqueued on the caller's thread at once
(``recv_now``), as before: no helper, no extra launches.

Ordering: the engine matches a pair's pieces in issue order, and the descriptions' host
receives are posted by the caller's thread in issue order too. While a receive from ``src`` is
deferred (:meth:`DeferredReceives.busy`), every later receive from ``src``, small ones
included, is deferred behind it on the same helper, so src's receive state has one user at a
time and the order is kept; once the helper has caught up, receives from src are enqueued
directly again.

Threading: :meth:`post`, :meth:`busy` and :meth:`close` are called by the communicator's caller
thread (GpuEngine's one thread). One native thread per source, started on its first deferred
receive, runs that source's queue; close() joins them, and none calls the engine after it.
A GpuComm dropped without close() closes its helpers when it is collected (their queued
receives then abort the engine).

Failures: a helper that fails (the sender died, the description did not come within the
communicator's timeout, a mapping failed) aborts the engine naming the source (every device
wait of this rank's communicator gives up, as for a dead peer), records the error and drops
its queue; the communicator's next call, GpuComm.synchronize / check and its requests' waits
raise the recorded error. The abort also stops the live peers' device waits (GpuEngine::abort
writes this rank's failure into their control words), so the sender, whose send waits for this
receive's copy, raises PeerError naming this rank at once instead of at its timeout. A receive
enqueued on the caller's thread that cannot map the sender's buffer does the same.
"""
from __future__ import annotations

from typing import Any, Optional

from .. import _native
from .registered import DESC_BYTES, _REG_TAG


class DeferredReceives:
    """The deferred receives of GpuComm ``g`` (made on its first one). ``target``: what the
    helpers drive, ``g``'s engine unless a test gives a ``_native._DeferTestTarget``."""

    def __init__(self, g, target: Any = None) -> None:
        self._g = g
        self._workers = _native._DeferWorkers(g._engine if target is None else target, g.size)

    @property
    def failure(self) -> Optional[BaseException]:
        """The recorded failure of a helper, or None."""
        if not self._workers.failed():
            return None
        try:
            self._workers.rethrow()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller to raise
            return exc
        return None

    def busy(self, src: int) -> bool:
        """True while a receive from src is deferred: a later one from src must queue behind."""
        return self._workers.busy(src)

    def post(self, x: Any, ptr: int, nbytes: int, src: int, stream: int, registered: bool) -> None:
        """Receives nbytes at ptr from src on `stream`: enqueued here when nothing from src is
        deferred and (`registered`: the sender sends a description first) the description is
        already here, else deferred to src's helper. x is held until its receive is enqueued."""
        if self._workers.failed():
            self._workers.rethrow()
        msg = request = None
        if registered:  # posted here, in issue order: descriptions match their receives
            import numpy as np
            msg = np.empty(1 + DESC_BYTES, np.uint8)
            request = self._g.comm.irecv(msg, src, _REG_TAG)
            if not self._workers.busy(src) and request.test():  # the sender is ahead: as a plain receive
                self._g._engine.recv_now(ptr, nbytes, src, stream, _description(msg))
                return
        event = self._g._engine.recv_defer_begin(src, stream)
        self._workers.post(src, request, x, msg, event, ptr, nbytes)

    def close(self, timeout: float) -> None:
        """Lets the queued receives finish (up to `timeout` seconds: their senders may still be
        on the way), then stops the helpers; after it returns no helper calls the engine. Queued
        receives left then abort the engine, so their device waits give up at once."""
        self._workers.close(timeout)


def _description(msg) -> bytes:
    """The sender's buffer description from its message (registered.send), or b"" for its flag
    0: its buffer could not be exported, so it sends through the scratch and so do we."""
    return msg[1:].tobytes() if msg[0] else b""

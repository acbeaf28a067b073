"""Deferred receives of the GPU plane: recv() / irecv() never wait on the host for the sender.

A receive of ``LINKWISE_GPU_REG_MIN`` bytes or more pulls from the sender's own buffer, whose
description is a host message that the sender's send() issues (registered.py). Waiting for it
inside recv() blocked this thread until the sender got there, so "irecv, then isend" on both
ranks of a pair deadlocked until the timeout. Now recv() places the receive on the caller's
stream at once (``GpuEngine.recv_defer_begin``: that stream waits on the device until the data
is in) and a helper thread of the source takes the description and enqueues the copy on the
source's private stream (``recv_defer_finish``; the engine's side of the contract is in
csrc/cuda/p2p_defer.cu).

Fast case: when nothing from ``src`` is deferred and its description is already here (the
sender got there first), the receive is enqueued on the caller's thread at once
(``recv_now``), as before: no helper, no extra launches. A helper costs more than launches: it
needs the GIL to go on, and a caller running pure Python holds it for up to
``sys.getswitchinterval()`` (5 ms) at a time (docs/benchmarks.md, thirty-fifth session).

Ordering: the engine matches a pair's pieces in issue order, and the descriptions' host
receives are posted by the caller's thread in issue order too. While a receive from ``src`` is
deferred (:meth:`DeferredReceives.busy`), every later receive from ``src``, small ones
included, is deferred behind it on the same helper, so src's receive state has one user at a
time and the order is kept; once the helper has caught up, receives from src are enqueued
directly again.

Threading: :meth:`post`, :meth:`busy` and :meth:`close` are called by the communicator's caller
thread (GpuEngine's one thread). One helper thread per source, started on its first deferred
receive, runs that source's queue. ``_cv`` guards the queues, the pending counts, ``failure``
and ``closed``; ``_gate`` is held around every engine call of a helper, so close() can wait for
one in progress and no helper touches the engine after it.

Failures: a helper that fails (the sender died, the description did not come within the
communicator's timeout, a mapping failed) aborts the engine naming the source (every device
wait of this rank's communicator gives up, as for a dead peer), records the error and drops
its queue; the communicator's next call, GpuComm.synchronize / check and its requests' waits
raise the recorded error. The sender is not told: its send waits until its timeout (a
failure to map its buffer left it waiting before deferral too). A GpuComm dropped without
close() keeps its helper threads (and so itself) alive: close it.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Optional

from .registered import DESC_BYTES, _REG_TAG


class DeferredReceives:
    """The deferred receives of GpuComm ``g`` (made on its first one)."""

    def __init__(self, g) -> None:
        self._g = g
        self._cv = threading.Condition()
        self._gate = threading.Lock()
        self._queues: dict[int, collections.deque] = {}
        self._pending = [0] * g.size
        self.failure: Optional[BaseException] = None
        self.closed = False

    def busy(self, src: int) -> bool:
        """True while a receive from src is deferred: a later one from src must queue behind."""
        with self._cv:
            return self._pending[src] > 0

    def post(self, x: Any, ptr: int, nbytes: int, src: int, stream: int, registered: bool) -> None:
        """Receives nbytes at ptr from src on `stream`: enqueued here when nothing from src is
        deferred and (`registered`: the sender sends a description first) the description is
        already here, else deferred to src's helper. x is held until its receive is enqueued."""
        if self.failure is not None:
            raise self.failure
        msg = request = None
        if registered:  # posted here, in issue order: descriptions match their receives
            import numpy as np
            msg = np.empty(1 + DESC_BYTES, np.uint8)
            request = self._g.comm.irecv(msg, src, _REG_TAG)
            if not self.busy(src) and request.test():  # the sender is ahead: as a plain receive
                self._g._engine.recv_now(ptr, nbytes, src, stream, _description(msg))
                return
        event = self._g._engine.recv_defer_begin(src, stream)
        with self._cv:
            self._pending[src] += 1
            queue = self._queues.get(src)
            if queue is None:
                queue = self._queues[src] = collections.deque()
                threading.Thread(target=self._serve, args=(src, queue), daemon=True,
                                 name=f"linkwise-gpu-recv-from-{src}").start()
            queue.append((x, msg, request, ptr, nbytes, event))
            self._cv.notify_all()

    def close(self, timeout: float) -> None:
        """Lets the queued receives finish (up to `timeout` seconds: their senders may still be
        on the way), then stops the helpers; after it returns no helper calls the engine. Queued
        receives left then abort the engine, so their device waits give up at once."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while any(self._pending) and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.1))
            stuck = any(self._pending) and self.failure is None
            self.closed = True
            self._cv.notify_all()
        with self._gate:  # a helper inside the engine finishes first; none enters after this
            if stuck:
                self._g._engine.abort(-1)

    # -- helper threads -----------------------------------------------------------------------
    def _serve(self, src: int, queue: collections.deque) -> None:
        while True:
            with self._cv:
                while not queue and not self.closed:
                    self._cv.wait()
                if self.closed or self.failure is not None:
                    _drop(self._g._engine, queue)
                    return
                item = queue.popleft()  # still pending until enqueued (busy(src) stays true)
            try:
                self._finish(src, *item[1:])
            except BaseException as exc:  # noqa: BLE001 - recorded for the caller's thread
                self._fail(src, exc)
                return
            with self._cv:
                self._pending[src] -= 1
                self._cv.notify_all()

    def _finish(self, src: int, msg, request, ptr: int, nbytes: int, event: int) -> None:
        desc = b""
        if request is not None:  # wait for the sender's description (GIL released; the timeout)
            try:
                request.wait()
            except BaseException:
                self._g._engine.event_destroy(event)  # never taken by recv_defer_finish
                raise
            desc = _description(msg)
        with self._gate:
            if self.closed:
                self._g._engine.event_destroy(event)
                return
            self._g._engine.recv_defer_finish(event, ptr, nbytes, src, desc)  # takes the event

    def _fail(self, src: int, exc: BaseException) -> None:
        # The abort first: a close() that sees the failure must find the engine aborted (its
        # device sync would wait for the deferred waits until the timeout otherwise).
        with self._gate:
            if not self.closed:
                self._g._engine.abort(src)
        with self._cv:
            if self.failure is None:
                self.failure = exc
            self._pending[src] = 0
            _drop(self._g._engine, self._queues[src])
            self._cv.notify_all()


def _drop(engine, queue: collections.deque) -> None:
    """Forgets queued receives that will never be enqueued, releasing their events."""
    while queue:
        engine.event_destroy(queue.popleft()[-1])


def _description(msg) -> bytes:
    """The sender's buffer description from its message (registered.send), or b"" for its flag
    0: its buffer could not be exported, so it sends through the scratch and so do we."""
    return msg[1:].tobytes() if msg[0] else b""

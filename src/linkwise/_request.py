"""Requests: non-blocking operations as Python sees them, and how asyncio waits for them.

Contract: a request keeps the objects its native operation reads or writes alive (`_keep`)
until it is dropped; waiting on it from asyncio registers the native request's eventfd with
the running loop (no busy loop). GPU operations (GpuRequest) have no eventfd: they are a CUDA
event recorded on the stream after the operation, polled from the loop.
"""
from __future__ import annotations

import asyncio
import os
import time
import weakref
from abc import ABCMeta
from typing import Any, Optional

from . import config
from .errors import TimeoutError

_POLL_MIN_S, _POLL_MAX_S = 50e-6, 2e-3  # GpuRequest.__await__: first and longest nap


class Request(metaclass=ABCMeta):
    """A non-blocking operation. isend / irecv return the native request
    (linkwise._native.Request, registered as a Request by adopt_native: wait(timeout=None),
    test(), done, nbytes, await); async collectives a CollectiveRequest, this class's wrapper of
    the executor's or worker's request. Keep the arrays alive and untouched until done."""

    __slots__ = ("_native", "_timeout", "_keep")

    def __init__(self, native_request, timeout: float, keep: Any):
        self._native = native_request
        self._timeout = timeout
        self._keep = keep

    def _outcome(self) -> Any:
        """What wait() and await return once the operation is done: the bytes moved."""
        return self._native.nbytes

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done (the GIL is released); raises the operation's error. Returns the
        bytes moved."""
        return self._native.wait(self._timeout if timeout is None else config.seconds(timeout, "wait"))

    def test(self) -> bool:
        """True when done (raises the operation's error if it failed)."""
        return self._native.test()

    def _wait_within(self, left: float, whole: float) -> Any:
        """wait() for wait_all: at most `left` seconds (0 or less: finished now, or given up as
        a timed-out wait is), a TimeoutError naming `whole`, the caller's timeout."""
        self._native._wait_within(left, whole)
        return self._outcome()

    @property
    def done(self) -> bool:
        return self._native.done

    @property
    def nbytes(self) -> int:
        return self._native.nbytes

    def __await__(self):
        async def run():
            await _await_native(self._native, self._timeout)
            return self._outcome()
        return run().__await__()


class CollectiveRequest(Request):
    """An async collective. ``wait()`` (or ``await req``) returns its result array."""

    __slots__ = ()

    def _outcome(self) -> Any:
        return self._keep

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done; returns the collective's result array."""
        self._native.wait(self._timeout if timeout is None else config.seconds(timeout, "wait"))
        return self._keep

    def fileno(self) -> int:
        """An eventfd that turns readable once the collective is done, for select() or an event
        loop's add_reader (as a point-to-point request's); wait() or test() then finishes it."""
        return self._native.fileno()


class DoneCollective:
    """The native side of an async collective that ran to its end when it was issued (a
    one-rank communicator runs them inline: CollectivesMixin._run), with the native
    CollRequest's interface: done, wait(), test(), _wait_now(), _wait_within(), fileno() (an eventfd that is
    readable at once, made on the first call and closed with this object). Not thread-safe
    (fileno(), as its callers are: one thread per request)."""

    __slots__ = ("_fd",)
    done = True
    nbytes = 0

    def __init__(self) -> None:
        self._fd = -1

    def wait(self, timeout: float) -> None:
        return None

    def _wait_now(self) -> None:
        return None

    def _wait_within(self, left: float, whole: float) -> None:
        return None

    def test(self) -> bool:
        return True

    def fileno(self) -> int:
        if self._fd < 0:
            self._fd = os.eventfd(1, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        return self._fd

    def __del__(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _FdWaiters(list):
    """The futures of one loop's tasks that await one eventfd. The loop's reader callback owns
    it, so those tasks live as long as their loop can wake them: once the loop is closed with
    them pending they are garbage, and collecting one drops its request, which withdraws a
    send or receive (a receive kept posted by a global table took a later message meant for
    a new receive)."""

    __slots__ = ("__weakref__",)


# The waiters of each (loop, fd), held weakly (the loop's reader holds them): a loop has one
# reader per fd (add_reader replaced the first task's, which then slept until its timeout), so
# one reader wakes them all. Touched from the loop's thread only.
_fd_waiters: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _wake(waiters: _FdWaiters) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(None)


async def _await_native(native_request, timeout: float) -> int:
    if not native_request.done:
        loop = asyncio.get_running_loop()
        fd = native_request.fileno()
        key = (loop, fd)
        waiters = _fd_waiters.get(key)
        if waiters is None:
            waiters = _FdWaiters()
            loop.add_reader(fd, _wake, waiters)  # first: if it raises, no entry is left behind
            _fd_waiters[key] = waiters
        fut = loop.create_future()
        waiters.append(fut)
        # The timeout wakes fut as the eventfd does. Not asyncio.wait_for: before Python 3.12 it
        # returns the result of a future that is done when a cancel arrives, so a task
        # cancelled in the loop iteration where its operation finished ran on.
        timer = loop.call_later(timeout, _wake, (fut,))  # as by the eventfd; then found not done
        try:
            await fut
        except asyncio.CancelledError:
            # The task was cancelled (task.cancel(), an outer asyncio.wait_for): withdraw the
            # operation too, so that its buffer is not written or sent later. The cancel is
            # always raised on, even if the operation finished meanwhile: a task that swallowed
            # it would run on (a receive loop stopped by cancel() kept receiving, and
            # asyncio.run's shutdown would wait for it). The README points to timeout=. (A task
            # collected pending, its loop closed, drops the request: withdrawn as a dropped one.)
            _withdraw(native_request)
            raise
        finally:
            timer.cancel()
            waiters.remove(fut)
            if not waiters:
                if _fd_waiters.get(key) is waiters:
                    del _fd_waiters[key]
                if not loop.is_closed():  # a closed loop has dropped its readers
                    loop.remove_reader(fd)
    return _finished(native_request, timeout)


def _finished(native_request, timeout: float) -> int:
    try:
        # Done: returns at once, or raises the operation's error. Not done (timed out): a
        # send or receive is cancelled (or, mid-transfer, the communicator aborted), so that
        # an abandoned buffer never takes a later message; a collective goes on.
        native_request._wait_now()
    except TimeoutError:
        raise TimeoutError(f"async operation did not complete within {timeout:g} s; raise "
                           "LINKWISE_TIMEOUT or pass timeout=") from None
    return native_request.nbytes


def await_request(native_request):
    """The iterator `await` runs for a native send / receive request (its __await__), with the
    request's timeout, giving the bytes moved: _await_native where the engine's progress thread
    drives it (asend / arecv), else _poll_native (isend / irecv: only test() and wait()
    progress those, so an eventfd wait alone would never end)."""
    if native_request.driven or native_request.done:
        return _await_native(native_request, native_request.timeout).__await__()
    return _poll_native(native_request).__await__()


async def _poll_native(native_request) -> int:
    """Await an isend / irecv request: test() it, with naps growing from 50 us to 2 ms between
    tries so that the loop never blocks, until done or its timeout; then as _await_native."""
    nap, deadline = _POLL_MIN_S, time.monotonic() + native_request.timeout
    try:
        while not native_request.test() and time.monotonic() < deadline:
            await asyncio.sleep(nap)
            nap = min(2 * nap, _POLL_MAX_S)
    except asyncio.CancelledError:
        _withdraw(native_request)  # as _await_native: never written or sent later
        raise
    return _finished(native_request, native_request.timeout)


def _native_wait_all(requests, timeout):  # native.wait_all once adopt_native ran
    return NotImplemented


def wait_all(requests, timeout: Optional[float] = None) -> list:
    """Wait for every request of `requests` (MPI_Waitall); returns what each one's wait() returns,
    in order (the bytes moved for a send or receive, the result array for an async collective).

    `timeout`: seconds from this call for all of them; None gives each request its own timeout
    (the communicator's, or the isend/irecv timeout=), counted from this call. A request not
    done by then is given up as its own wait() gives it up (a send or receive is cancelled, or
    the communicator aborted if bytes were moving; a collective goes on). One failed request
    does not stop the waits for the others: the first failure in list order is raised once
    every request has ended, so no array is let go while bytes still move into it (each
    request's own test() or wait() then tells its outcome). Ctrl-C is raised at once.
    A list of send / receive requests only is waited for in one native call, with the GIL
    released once (as fast as a loop of their wait()s: docs/benchmarks.md); asyncio code
    awaits requests with asyncio.gather instead."""
    if type(requests) is not list:
        requests = list(requests)
    done = _native_wait_all(requests, timeout)
    if done is not NotImplemented:
        return done
    for r in requests:
        if not isinstance(r, (Request, GpuRequest)):
            raise TypeError(f"wait_all: {type(r).__name__} is not a linkwise request")
    budget = None if timeout is None else config.seconds(timeout, "wait_all")
    start = time.monotonic()
    results, first = [], None
    for r in requests:
        own = r.timeout if hasattr(r, "timeout") else r._timeout  # native requests: .timeout
        limit = own if budget is None else budget
        left = limit - (time.monotonic() - start)
        try:  # once the budget is spent: finished now, or given up as a timed-out wait would be;
            # a TimeoutError names the whole limit, not what was left of it for this request
            results.append(r._wait_within(left, limit))
        except Exception as exc:  # noqa: BLE001 - raised below, after the other waits
            results.append(None)
            first = first or exc
    if first is not None:
        raise first
    return results


def adopt_native(native) -> None:
    """Once the native module is loaded: its send / receive requests count as Requests, and
    `await` on one runs await_request."""
    global _native_wait_all
    _native_wait_all = native.wait_all
    Request.register(native.Request)
    native.set_request_awaiter(await_request)


def _withdraw(native_request) -> None:
    """A send or receive nobody waits for any more: cancelled where it has not started moving,
    else the communicator is aborted (the engine's rule for a timed-out wait). A collective
    cannot be withdrawn: it goes on."""
    try:
        native_request._wait_now()
    except Exception:  # noqa: BLE001 - the timeout (or the operation's own error) is expected here
        pass


class GpuRequest:
    """A GPU operation enqueued on a CUDA stream (async_op=True, a* coroutines, isend/irecv of
    CUDA arrays): a CUDA event recorded on the stream right after the operation.

    ``wait()`` blocks the host until the GPU passed the event (GIL released), then raises the
    communicator's recorded failure if there is one (PeerError: a peer died; TimeoutError: a
    device wait timed out; both final, the data is then undefined) and returns the result (the
    array for a collective, the byte count for isend/irecv). ``await`` does the same, polling the
    event with naps growing from 50 us to 2 ms so that the event loop never blocks. Like NCCL's,
    the request does not order other streams: wait (or await) before using the data elsewhere.
    Keep the arrays alive and untouched until done. Not thread-safe.
    """

    __slots__ = ("_engine", "_ev", "_timeout", "_result", "_check", "__weakref__")

    def __init__(self, engine, event: int, timeout: float, result: Any, check=None):
        self._engine = engine   # the communicator's _GpuEngine
        self._ev = event        # cudaEvent_t as an int; 0 once completed and destroyed
        self._timeout = timeout
        self._result = result
        # raises the communicator's recorded failure (GpuComm passes its own: it also knows a
        # deferred receive's, cuda/deferred.py); the engine's check() by default
        self._check = check or engine.check

    def _finish(self) -> Any:
        if self._ev:
            self._engine.event_destroy(self._ev)
            self._ev = 0
        self._check()
        return self._result

    def test(self) -> bool:
        """True when the GPU has finished the operation (raises a recorded failure then)."""
        if self._ev and not self._engine.event_query(self._ev):
            return False
        self._finish()
        return True

    @property
    def done(self) -> bool:
        return not self._ev or self._engine.event_query(self._ev)

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the GPU has finished the operation; returns its result."""
        limit = self._timeout if timeout is None else config.seconds(timeout, "wait")
        return self._wait_within(limit, limit)

    def _wait_within(self, left: float, whole: float) -> Any:
        """wait() at most `left` seconds (0 or less: only if done now), its TimeoutError naming
        `whole` (wait_all's timeout, of which `left` remains)."""
        if self._ev and not (self._engine.event_wait(self._ev, left) if left > 0
                             else self._engine.event_query(self._ev)):
            self._check()  # a failure explains the wait better than the timeout
            raise TimeoutError(f"GPU operation did not complete within {whole:g} s; raise "
                               "LINKWISE_TIMEOUT or pass timeout=")
        return self._finish()

    def __await__(self):
        async def run():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._timeout
            nap = 0.0
            while self._ev and not self._engine.event_query(self._ev):
                if loop.time() > deadline:
                    self._check()
                    raise TimeoutError(f"async GPU operation did not complete within "
                                       f"{self._timeout:g} s; raise LINKWISE_TIMEOUT or pass timeout=")
                await asyncio.sleep(nap)
                nap = min(_POLL_MAX_S, max(_POLL_MIN_S, nap * 2))
            return self._finish()
        return run().__await__()

    def __del__(self) -> None:
        if getattr(self, "_ev", 0):
            try:
                self._engine.event_destroy(self._ev)  # a pending event is released once reached
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

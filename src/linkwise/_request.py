"""Requests: non-blocking operations as Python sees them, and how asyncio waits for them.

Contract: a request keeps the objects its native operation reads or writes alive (`_keep`)
until it is dropped; waiting on it from asyncio registers the native request's eventfd with
the running loop (no busy loop).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from .errors import TimeoutError


class Request:
    """A non-blocking send or receive. Keep the array alive and untouched until done."""

    __slots__ = ("_native", "_timeout", "_keep")

    def __init__(self, native_request, timeout: float, keep: Any):
        self._native = native_request
        self._timeout = timeout
        self._keep = keep

    def _outcome(self) -> Any:
        """What wait() and await return once the operation is done: the bytes moved."""
        return self._native.nbytes

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done (the GIL is released); raises the operation's error."""
        self._native.wait(self._timeout if timeout is None else float(timeout))
        return self._outcome()

    def test(self) -> bool:
        """True when done (raises the operation's error if it failed)."""
        return self._native.test()

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


async def _await_native(native_request, timeout: float) -> int:
    if not native_request.done:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fd = native_request.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(fd, ready)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"async operation did not complete within {timeout} s; raise "
                               "LINKWISE_TIMEOUT or pass timeout=") from None
        finally:
            loop.remove_reader(fd)
    native_request.wait(0.0)  # done: returns at once, or raises the operation's error
    return native_request.nbytes

"""Coroutine forms of the collectives: ``await comm.aall_reduce(x)`` and the like. Each issues
the collective with ``async_op=True`` when it is called, in call order like any other
collective, and returns a coroutine that awaits its request (which registers the native eventfd
with the running loop; see _request.py).

Issued at the call, not at the coroutine's first step: a task cancelled before it ever ran
(task.cancel(), a TaskGroup's cancel, a short asyncio.wait_for) then still takes its turn, as
the peers' do; before, such a rank skipped the collective and paired its next one with the
peers' skipped one (silently, where their sizes agreed). An argument error is raised where the
coroutine is awaited, as from an ``async def``.
"""
from __future__ import annotations

from typing import Any, Callable


async def _await_request(request) -> Any:
    return await request


async def _raise(exc: BaseException) -> Any:
    raise exc


def _issued(name: str, issue: Callable[[], Any]):
    """A coroutine awaiting the request that issue() returns (issue() runs now), named after
    the method that made it: Python's "coroutine ... was never awaited" warning then names
    `Communicator.aall_reduce`, not this module's helper."""
    try:
        request = issue()
    except Exception as exc:  # noqa: BLE001 - raised where the coroutine is awaited
        coro = _raise(exc)
    else:
        coro = _await_request(request)
    coro.__name__, coro.__qualname__ = name, f"Communicator.{name}"
    return coro


class CoroutineCollectivesMixin:
    """Mixed into Communicator after CollectivesMixin."""

    def aall_reduce(self, x, op="sum", out=None, dtype=None):
        return _issued("aall_reduce", lambda: self.all_reduce(x, op=op, out=out, async_op=True, dtype=dtype))

    def abroadcast(self, x, root=0, out=None):
        return _issued("abroadcast", lambda: self.broadcast(x, root=root, out=out, async_op=True))

    def areduce(self, x, root=0, op="sum", out=None, dtype=None):
        return _issued("areduce",
                       lambda: self.reduce(x, root=root, op=op, out=out, async_op=True, dtype=dtype))

    def aall_gather(self, x, out=None):
        return _issued("aall_gather", lambda: self.all_gather(x, out=out, async_op=True))

    def areduce_scatter(self, x, op="sum", out=None, dtype=None):
        return _issued("areduce_scatter",
                       lambda: self.reduce_scatter(x, op=op, out=out, async_op=True, dtype=dtype))

    def aall_to_all(self, x, out=None):
        return _issued("aall_to_all", lambda: self.all_to_all(x, out=out, async_op=True))

    def agather(self, x, root=0, out=None):
        return _issued("agather", lambda: self.gather(x, root=root, out=out, async_op=True))

    def ascatter(self, x, root=0, out=None):
        return _issued("ascatter", lambda: self.scatter(x, root=root, out=out, async_op=True))

    def abarrier(self):
        return _issued("abarrier", lambda: self.barrier(async_op=True))

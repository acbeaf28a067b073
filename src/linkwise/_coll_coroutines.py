"""Coroutine forms of the collectives: ``await comm.aall_reduce(x)`` and the like. Each is the
collective with ``async_op=True``, awaited (its request registers the native eventfd with the
running loop; see _request.py), so it takes its turn in the communicator's issue order.
"""
from __future__ import annotations


class CoroutineCollectivesMixin:
    """Mixed into Communicator after CollectivesMixin."""

    async def aall_reduce(self, x, op="sum", out=None, dtype=None):
        return await self.all_reduce(x, op=op, out=out, async_op=True, dtype=dtype)

    async def abroadcast(self, x, root=0, out=None):
        return await self.broadcast(x, root=root, out=out, async_op=True)

    async def areduce(self, x, root=0, op="sum", out=None, dtype=None):
        return await self.reduce(x, root=root, op=op, out=out, async_op=True, dtype=dtype)

    async def aall_gather(self, x, out=None):
        return await self.all_gather(x, out=out, async_op=True)

    async def areduce_scatter(self, x, op="sum", out=None, dtype=None):
        return await self.reduce_scatter(x, op=op, out=out, async_op=True, dtype=dtype)

    async def aall_to_all(self, x, out=None):
        return await self.all_to_all(x, out=out, async_op=True)

    async def agather(self, x, root=0, out=None):
        return await self.gather(x, root=root, out=out, async_op=True)

    async def ascatter(self, x, root=0, out=None):
        return await self.scatter(x, root=root, out=out, async_op=True)

    async def abarrier(self):
        return await self.barrier(async_op=True)

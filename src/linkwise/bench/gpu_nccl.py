"""``--compare nccl-cupy``: NCCL called directly, with nccl-tests-like overhead per operation.

:class:`NcclDirectBackend` drives an NCCL communicator through ``cupy.cuda.nccl``
(``NcclCommunicator``: one Cython call per operation, raw device pointers, a fixed stream: the
bench stream of :mod:`.gpu`), or, where cupy has no NCCL, through ``ctypes`` on the
``libnccl.so.2`` that torch ships (nvidia-nccl-cu*), which costs ~1 µs more per call; the
``how`` line says which. The unique id goes from rank 0 to the others over linkwise host
messages. Same processes as the linkwise sweep, right after it; same tensors and timing.
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Optional

import numpy as np

from .backends import Unsupported
from .gpu import GpuBackend

_TAG_ID = (1 << 61) + 22
# ncclDataType_t / ncclRedOp_t codes (nccl.h; the same in cupy.cuda.nccl).
_NCCL_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
               "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}  # ncclBfloat16: NCCL >= 2.10
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def missing_direct() -> Optional[str]:
    from .gpu import missing_nccl
    why = missing_nccl()
    if why:
        return why
    if _cupy_nccl() is None and _libnccl_path() is None:
        return "neither cupy.cuda.nccl nor torch's libnccl.so.2 was found"
    return None


def _cupy_nccl():
    try:
        from cupy.cuda import nccl
    except Exception:  # noqa: BLE001 - cupy missing or built without NCCL
        return None
    return nccl if getattr(nccl, "available", True) else None


def _libnccl_path() -> Optional[str]:
    try:
        import nvidia.nccl
        roots = list(nvidia.nccl.__path__)
    except Exception:  # noqa: BLE001
        roots = []
    for root in roots:
        hits = glob.glob(os.path.join(root, "lib", "libnccl.so*"))
        if hits:
            return sorted(hits)[0]
    return None


class _CtypesNccl:
    """The few NCCL entry points the bench needs, through ctypes (method names as cupy's)."""

    def __init__(self, lib: ctypes.CDLL, uid: bytes, nranks: int, rank: int):
        self.lib = lib
        class UniqueId(ctypes.Structure):  # ncclUniqueId, passed by value
            _fields_ = [("internal", ctypes.c_char * 128)]
        self.comm = ctypes.c_void_p()
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                         ctypes.c_int]
        rc = lib.ncclCommInitRank(ctypes.byref(self.comm), nranks, UniqueId(uid), rank)
        if rc:
            raise RuntimeError(f"ncclCommInitRank failed: {rc}")
        self.P, self.N = ctypes.c_void_p, ctypes.c_size_t

    def allReduce(self, s, r, n, t, op, st):
        self.lib.ncclAllReduce(self.P(s), self.P(r), self.N(n), t, op, self.comm, self.P(st))

    def broadcast(self, s, r, n, t, root, st):
        self.lib.ncclBroadcast(self.P(s), self.P(r), self.N(n), t, root, self.comm, self.P(st))

    def allGather(self, s, r, n, t, st):
        self.lib.ncclAllGather(self.P(s), self.P(r), self.N(n), t, self.comm, self.P(st))

    def reduceScatter(self, s, r, n, t, op, st):
        self.lib.ncclReduceScatter(self.P(s), self.P(r), self.N(n), t, op, self.comm, self.P(st))

    def send(self, s, n, t, peer, st):
        self.lib.ncclSend(self.P(s), self.N(n), t, peer, self.comm, self.P(st))

    def recv(self, r, n, t, peer, st):
        self.lib.ncclRecv(self.P(r), self.N(n), t, peer, self.comm, self.P(st))

    def destroy(self):
        self.lib.ncclCommDestroy(self.comm)


class NcclDirectBackend(GpuBackend):
    name = "nccl-cupy"

    def __init__(self, helper, device: int, graph: bool = False):
        super().__init__(helper.rank, helper.size, helper, device, graph)
        comm = helper.comm
        nccl = _cupy_nccl()
        if nccl is None:
            self._lib = ctypes.CDLL(_libnccl_path())
        # Rank 0 makes the unique id and always sends [ok, kind, 128 id bytes], so that every
        # rank fails alike (no rank left waiting) when it cannot. kind 1: cupy wants bytes back.
        msg = np.zeros(130, np.uint8)
        if self.rank == 0:
            try:
                if nccl is not None:
                    uid = nccl.get_unique_id()
                    if isinstance(uid, (bytes, bytearray)):
                        msg[1], raw = 1, bytes(uid)
                    else:
                        raw = np.array(uid, np.int64).astype(np.int8).tobytes()
                else:
                    buf = ctypes.create_string_buffer(128)
                    if self._lib.ncclGetUniqueId(buf):
                        raise RuntimeError("ncclGetUniqueId failed")
                    raw = buf.raw
                msg[2:2 + len(raw[:128])] = np.frombuffer(raw[:128], np.uint8)
                msg[0] = 1
            except Exception as exc:  # noqa: BLE001 - reported by every rank below
                print(f"nccl-cupy: no unique id on rank 0: {exc}")
            for peer in range(1, self.size):
                comm.send(msg, peer, _TAG_ID)
        else:
            comm.recv(msg, 0, _TAG_ID)
        if not msg[0]:
            raise RuntimeError("nccl-cupy: rank 0 could not make an NCCL unique id")
        raw = msg[2:].tobytes()
        if nccl is not None:
            import cupy
            as_tuple = tuple(int(v) for v in np.frombuffer(raw, np.int8))
            forms = (raw, as_tuple) if msg[1] else (as_tuple, raw)
            with cupy.cuda.Device(device):
                try:
                    self.c = nccl.NcclCommunicator(self.size, forms[0], self.rank)
                except TypeError:  # cupy versions differ in the id's Python type
                    self.c = nccl.NcclCommunicator(self.size, forms[1], self.rank)
            self._group = (nccl.groupStart, nccl.groupEnd)
            self.impl = "cupy.cuda.nccl.NcclCommunicator"
        else:
            self.c = _CtypesNccl(self._lib, raw, self.size, self.rank)
            self._group = (self._lib.ncclGroupStart, self._lib.ncclGroupEnd)
            self.impl = "ctypes on libnccl.so.2 (cupy has no NCCL here)"
        self.torch.cuda.synchronize()

    def bind(self, coll, send, recv, inplace, op, root):
        tname = str(send.dtype)
        if tname not in _NCCL_TYPES:
            raise Unsupported(f"nccl has no {send.dtype}")
        if coll in ("all_reduce", "reduce_scatter") and op not in _NCCL_OPS:
            raise Unsupported(f"nccl has no {op}")
        t, rop = _NCCL_TYPES[tname], _NCCL_OPS.get(op, 0)
        x, out, s, r = self._pair(coll, send, recv, inplace)
        c, st, n = self.c, self.stream.cuda_stream, self.size
        xp, op_ = x.data_ptr(), out.data_ptr()
        if coll == "all_reduce":
            cnt = x.numel()
            return lambda: c.allReduce(xp, op_, cnt, t, rop, st)
        if coll == "broadcast":
            cnt = x.numel()
            return lambda: c.broadcast(xp, op_, cnt, t, root, st)
        if coll == "all_gather":
            cnt = x.numel()
            return lambda: c.allGather(xp, op_, cnt, t, st)
        if coll == "reduce_scatter":
            cnt = out.numel()
            return lambda: c.reduceScatter(xp, op_, cnt, t, rop, st)
        gs, ge = self._group
        if coll == "sendrecv":
            if inplace:
                raise Unsupported("sendrecv in place")
            nxt, prv, cnt = (self.rank + 1) % n, (self.rank - 1) % n, s.numel()
            sp, rp = s.data_ptr(), r.data_ptr()

            def sendrecv():
                gs()
                c.send(sp, cnt, t, nxt, st)
                c.recv(rp, cnt, t, prv, st)
                ge()
            return sendrecv
        if coll == "all_to_all":
            if inplace:
                raise Unsupported("all_to_all in place")
            blk = s.numel() // n
            step = blk * s.element_size()
            sp, rp = s.data_ptr(), r.data_ptr()

            def all_to_all():
                gs()
                for p in range(n):
                    c.send(sp + p * step, blk, t, p, st)
                    c.recv(rp + p * step, blk, t, p, st)
                ge()
            return all_to_all
        raise Unsupported(coll)

    def close(self):
        try:
            self.torch.cuda.synchronize()
            self.c.destroy()
        except Exception:  # noqa: BLE001 - best effort
            pass

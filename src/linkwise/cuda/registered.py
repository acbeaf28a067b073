"""GpuComm's registered-buffer paths (moved out of gpu_comm.py; its docstring has the overview).

Every helper takes the GpuComm ``g``. The ranks agree on whether a call can use the registered
path before anything is enqueued: a buffer CUDA IPC cannot export (torch's
``expandable_segments``, cudaMallocAsync pools, host or managed memory) makes every rank of a
collective take the scratch path instead (:func:`reg_many`), and the sender of a send/recv
tells the receiver in the same host message that carries its buffer's description
(:func:`send`, :func:`recv`), so both take the scratch path for that message.
"""
from __future__ import annotations

from typing import Optional

from .. import config

DESC_BYTES = 88  # reg_engine.cu kDescBytes
_REG_TAG = (1 << 61) + 4243  # host messages carrying a send's buffer description


def _native():
    from .. import _native as n
    return n


def reg_all(g, ptr: int, slot: int = 0) -> None:
    """Every rank's description of its buffer (host all_gather), mapped as `slot`. For
    buffers this process allocated itself (the prs scratch): a failure raises on that rank."""
    import numpy as np
    mine = np.frombuffer(g._engine.reg_describe(ptr), np.uint8)
    everyone = g.comm.all_gather(mine)
    k = mine.size
    g._engine.reg_map([everyone[r * k:(r + 1) * k].tobytes() for r in range(g.size)], slot)


def reg_many(g, ptrs: list) -> bool:
    """Maps every rank's buffers ptrs[i] as slot i, in one host all_gather. False (nothing
    mapped) on every rank when any rank could not describe its buffers."""
    import numpy as np
    k = DESC_BYTES * len(ptrs)
    try:
        mine = b"\x01" + b"".join(g._engine.reg_describe(p) for p in ptrs)
    except Exception:  # noqa: BLE001 - not a cudaMalloc allocation, IPC refused, ...
        mine = b"\x00" * (1 + k)
    everyone = g.comm.all_gather(np.frombuffer(mine, np.uint8))
    rows = [everyone[r * (1 + k):(r + 1) * (1 + k)].tobytes() for r in range(g.size)]
    if any(row[0] != 1 for row in rows):
        return False
    for i in range(len(ptrs)):
        g._engine.reg_map([row[1 + DESC_BYTES * i:1 + DESC_BYTES * (i + 1)] for row in rows], i)
    return True


def reduce_ok(g, nbytes: int, s: int) -> bool:
    """Whether a reduction of nbytes takes the registered path (same answer on every rank).
    An all_reduce with LINKWISE_GPU_AR_ALGO=prs or rsag takes it at any size (all_reduce)."""
    return (g.size > 1 and g._staged is None and nbytes >= g._red_reg_min
            and not _native().cuda_stream_capturing(s))


def forced_algo(g, s: Optional[int] = None) -> bool:
    """LINKWISE_GPU_AR_ALGO=prs / rsag asks for that form at any size: True where the
    registered path may run at all (2+ ranks, NVLink path, LINKWISE_GPU_REG on, and stream
    s, when given, not capturing; the fast path asks once, without one). The same answer on
    every rank when the variable is set alike."""
    return (config.get("LINKWISE_GPU_AR_ALGO") in ("prs", "rsag") and g.size > 1
            and g._staged is None and g._reg_on
            and (s is None or not _native().cuda_stream_capturing(s)))


def piece(g, nbytes: int) -> int:
    if g._chain_piece:
        return g._chain_piece
    if g.size == 2:  # the copy-engine chain's one hop: nobody downstream to overlap with
        return nbytes
    return min(32 << 20, max(2 << 20, (nbytes // 8) >> 12 << 12))  # measured best of the two tried


def rsag(g, v, o, dt: int, opc: int, s: int) -> bool:
    """Large all_reduce as the registered reduce_scatter (x's chunk r reduced into out's
    chunk r) then the registered all_gather of out's chunks: faster than the one-kernel
    form at 512 MiB on 4xH200, slower at 64 MiB (docs/benchmarks.md, fourth session).
    LINKWISE_GPU_AR_ALGO: 'rsag' forces it, 'direct' disables it; else from
    LINKWISE_GPU_AR_RSAG_MIN bytes. Needs count divisible by the ranks. In place is safe:
    the reduce_scatter's closing rendezvous precedes the all_gather's writes into out."""
    algo = config.get("LINKWISE_GPU_AR_ALGO")
    if algo == "direct" or v.count % g.size or (
            algo != "rsag" and v.nbytes < config.get("LINKWISE_GPU_AR_RSAG_MIN")):
        return False
    m = v.count // g.size
    own = o.ptr + g.rank * m * (v.nbytes // v.count)
    # One host all_gather maps every rank's x (slot 0) and its own chunk of out (slot 1);
    # every rank agrees here that both can be registered, before anything is enqueued
    # (else all take another path). The engine call is reduce_scatter into that chunk,
    # one rendezvous, the copy-engine all_gather of the chunks (reg_engine.cu).
    if not reg_many(g, [v.ptr, own]):
        return False
    g._engine.all_reduce_rsag_reg(m, dt, opc, s)
    return True


def prs(g, v, o, dt: int, opc: int, s: int) -> bool:
    """Large all_reduce as one kernel of SM stores only (reg_prs.cu): each rank pushes the
    items of chunk p of its x into owner p's prs scratch, the owner reduces them from local
    memory and pushes the result into every rank's out. LINKWISE_GPU_AR_ALGO='prs' selects
    it at any size; with no LINKWISE_GPU_AR_ALGO it is the default on 2 ranks from
    LINKWISE_GPU_AR_PRS_MIN bytes, the only case where it has been measured at or above NCCL
    (docs/benchmarks.md, sixth session; 4 ranks not measured yet). Any count; in place is
    safe (contract in reg_prs.cu)."""
    algo = config.get("LINKWISE_GPU_AR_ALGO")
    if algo != "prs" and (algo or g.size != 2 or v.nbytes < config.get("LINKWISE_GPU_AR_PRS_MIN")):
        return False
    if g._prs_mapped is None:  # every rank's prs scratch as slot 2, once (collective)
        reg_all(g, g._engine.prs_scratch(), 2)
        g._prs_mapped = True
    if not reg_many(g, [o.ptr]):  # slot 0 = every rank's out; x is only read locally
        return False
    g._engine.all_reduce_prs_reg(v.ptr, v.count, dt, opc, s)
    return True


def send(g, v, dst: int, s: int) -> None:
    """A registered send: one host message to dst, a flag byte then the description of the
    allocation holding x; flag 0 (x cannot be exported) makes both sides use the scratch send
    for this message, so the receiver never waits for a description that is not coming. The
    receiver takes it on a helper thread (deferred.py), so it need not have called recv yet."""
    import numpy as np
    try:
        msg = b"\x01" + g._engine.reg_describe(v.ptr)
    except Exception:  # noqa: BLE001 - not a cudaMalloc allocation, IPC refused, ...
        msg = b"\x00" * (1 + DESC_BYTES)
    g.comm.send(np.frombuffer(msg, np.uint8), dst, _REG_TAG)
    if msg[0]:
        g._engine.send_reg(v.nbytes, dst, s)
    else:
        g._engine.send(v.ptr, v.nbytes, dst, s)

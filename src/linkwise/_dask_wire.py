"""The byte stream of a ``linkwise://`` Dask comm (dask_comm.py): records, the handshake, and
socket helpers.

Wire (little-endian), each record a 16-byte head (magic, kind, count), then:
  HELLO  (count = JSON bytes): host identity, pid, probe address and value, and the address
         of this side's live word (1 until the comm fails), as JSON;
  CAN    (count 0/1): 1 when this side could read the peer's memory (the peer may then send
         frames by address);
  MSG    (count = number of frames): per frame (nbytes, address; address 0: inline), then the
         inline frames' bytes in order;
  ACK    (count = messages acknowledged): the reader copied every by-address frame of that
         many MSG records, in order.
Every function here runs on the comm's event loop.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import struct
import types

import dask
import numpy as np
from dask.utils import parse_timedelta
from distributed.comm.core import CommClosedError
from distributed.comm.tcp import set_tcp_timeout

from . import _native
from ._setup import host_identity

MAGIC = 0x4B44574C  # "LWDK"
HELLO, CAN, MSG, ACK = 1, 2, 3, 4
HEAD = struct.Struct("<IIQ")
FRAME = struct.Struct("<QQ")
_HELLO_MAX = 1 << 16  # a longer HELLO is not from a linkwise:// peer

# The handshake's probe: 8 known bytes at a stable address, which a peer reads to learn
# whether it may read this process's memory.
_PROBE = np.array([0x6C696E6B77697365], dtype=np.uint64)
_native.cma_allow_peers()


async def recv_exact(loop, sock, n: int) -> memoryview:
    buf = memoryview(np.empty(n, np.uint8)) if n else memoryview(b"")
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, buf[got:])
        if k == 0:
            raise CommClosedError("linkwise comm: the peer closed the connection")
        got += k
    return buf


async def recv_head(loop, sock) -> tuple:
    magic, kind, count = HEAD.unpack(await recv_exact(loop, sock, HEAD.size))
    if magic != MAGIC:
        raise CommClosedError("linkwise comm: the byte stream is corrupted (not a linkwise:// peer?)")
    return kind, count


def byte_view(frame) -> memoryview:
    """The frame as a flat view of bytes (socket calls count and slice a view by items, so a
    float64 frame sent as it is would go out wrong), copied only if not contiguous."""
    view = memoryview(frame)
    if view.nbytes == 0:
        return memoryview(b"")  # cast() refuses a shape with a zero in it, e.g. (0, 5)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def shutdown(sock: socket.socket) -> None:
    """Ends both directions (a pending send fails, a pending receive reads EOF); the fd stays
    open until nothing waits on it (closing it under a pending call would hide that call from
    the event loop for good)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def set_keepalive(sock: socket.socket) -> None:
    """TCP keepalive and user timeout from ``distributed.comm.timeouts.tcp``, as tcp:// sets
    them (through distributed's own function), so that a peer host that vanishes without a
    FIN or RST ends the comm instead of leaving it waiting."""
    try:
        set_tcp_timeout(types.SimpleNamespace(closed=lambda: False, socket=sock))
    except AssertionError:  # a timeout under 11 s, which that function refuses: none set
        pass


async def handshake(sock: socket.socket) -> dict:
    """Both sides say who they are, try to read the other's probe, and say whether they could.
    Returns what the comm needs: the peer's pid and live word, this side's live word, and
    whether frames may go by address each way. Bounded by Dask's connect timeout; a peer that
    is not a linkwise:// one raises CommClosedError."""
    timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), default="seconds")
    return await asyncio.wait_for(_exchange_hellos(sock), timeout)


async def _exchange_hellos(sock: socket.socket) -> dict:
    loop = asyncio.get_running_loop()
    # The live word holds a random token, not 1: once this comm is dropped its 8 bytes go back
    # to NumPy's allocator, and a later small array there is non-zero but not the token, so the
    # peer, reading the word after copying a message, never takes freed memory for "live".
    token = secrets.randbits(64) | 1
    live = np.array([token], np.uint64)
    hello = json.dumps({"host": host_identity(), "pid": os.getpid(), "probe": int(_PROBE.ctypes.data),
                        "value": int(_PROBE[0]), "live": int(live.ctypes.data), "token": token}).encode()
    await loop.sock_sendall(sock, HEAD.pack(MAGIC, HELLO, len(hello)) + hello)
    kind, n = await recv_head(loop, sock)
    if kind != HELLO or n > _HELLO_MAX:
        raise CommClosedError("linkwise comm: the peer's handshake is missing")
    peer = _parse_hello(bytes(await recv_exact(loop, sock, n)))
    can_read = peer["host"] == host_identity() and peer["pid"] != os.getpid() and _native.cma_probe(
        peer["pid"], peer["probe"], peer["value"])
    await loop.sock_sendall(sock, HEAD.pack(MAGIC, CAN, int(can_read)))
    kind, peer_can_read = await recv_head(loop, sock)
    if kind != CAN:
        raise CommClosedError("linkwise comm: the peer's handshake is incomplete")
    return {"peer_pid": peer["pid"], "peer_live": peer["live"], "peer_token": peer["token"], "live": live,
            "send_by_address": bool(peer_can_read), "read_by_address": can_read}


def _parse_hello(body: bytes) -> dict:
    """The peer's HELLO, its fields checked (a stray client must not raise anything but
    CommClosedError, nor make this side read memory at a garbage address)."""
    peer = None
    try:
        peer = json.loads(body)
        ok = (isinstance(peer, dict) and isinstance(peer.get("host"), str)
              and all(type(peer.get(k)) is int and 0 <= peer[k] < 1 << 64
                      for k in ("pid", "probe", "value", "live", "token"))
              and 0 < peer["pid"] < 1 << 31 and peer["token"] != 0)  # a pid the native probe takes
    except ValueError:
        ok = False
    if not ok:
        older = isinstance(peer, dict) and "live" in peer and "token" not in peer
        raise CommClosedError("linkwise comm: the peer's handshake is malformed" + (
            " (it has no live token: an older linkwise; use one version on every worker)" if older else ""))
    return peer

"""The rendezvous store's wire format and its server, which lives in rank 0's process.
The client, and the protocol as a whole, are described in :mod:`linkwise.store`.

Wire format (both ways): ``u32 length`` + payload, big-endian. A request payload is
``op:u8  key_len:u32  key  body`` where body is the value (SET), an f64 timeout in seconds,
negative for none (GET), an i64 amount (ADD), an i64 size and an f64 timeout (BARRIER: count
one arrival and wait for ``size``; BARRIER_WAIT: the same wait, without an arrival, for a
caller that waits in slices), a description of the caller (JOIN: the key is the rank),
nothing (SETTLED: the key is the rank; HELLO: the reply body is the server's token), or an
f64 wait in seconds (CHECK). A reply payload is ``status:u8  body``; status LEFT's body is
``rank|description`` of a rank that left during setup.

Ranks that leave during setup: a JOIN's connection is its process's (the client keeps it for
joins and SETTLED only), so it closes when that process dies or closes its store. If that
happens before the rank sent SETTLED (its init() done), the rank is recorded as left, and
every wait (GET, BARRIER, BARRIER_WAIT, CHECK) that is not satisfied answers LEFT at once, naming the
first rank that left: the ranks still setting up raise instead of waiting for the timeout.
A rank that settled and closes later is not a death (the engine watches peers from then
on). A later JOIN of the rank (a process started in its place) clears the record. A closing
server whose joined ranks have not all settled or left first waits for them to (up to
DRAIN seconds), answering their requests, so that they learn which rank left (its own
closing JOIN connection makes rank 0 one) instead of seeing the store vanish.

Untrusted input: anything may connect to the store's port (port scanners, health checks, an
HTTP probe). The server therefore drops a connection whose first request is not a HELLO (every
client sends one first), refuses request frames longer than MAX_REQUEST, and reads a frame
into a buffer that grows as bytes arrive, so a length read from the wire never sizes memory
that the peer did not send.
"""
from __future__ import annotations

import socket
import struct
import threading
from typing import Optional

from .config import MAX_TIMEOUT
from .errors import BootstrapError

_SET, _GET, _ADD, _BARRIER, _HELLO, _JOIN, _SETTLED, _CHECK = 1, 2, 3, 4, 5, 6, 7, 8
# A barrier's wait continued (Store.barrier waiting in slices): as _BARRIER, without arriving.
_BARRIER_WAIT = 9
_OK, _MISSING, _FAIL, _LEFT = 0, 1, 2, 3
_LEN = struct.Struct("!I")
_KEY = struct.Struct("!BI")
_F64 = struct.Struct("!d")
_I64 = struct.Struct("!q")
_BAR = struct.Struct("!qd")  # size, timeout
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Seconds a closing server waits for the joined ranks still setting up to settle or leave,
# and then for requests in progress to be answered.
DRAIN = 2.0
# The longest request frame the server reads (op, key and value together); a longer one ends
# its connection. linkwise's own values are small (a rank's card is a few hundred bytes of
# JSON, a CUDA IPC handle 64 bytes), so this is generous; Store.set refuses a longer value
# before sending it.
MAX_REQUEST = 64 << 20
_HELLO_FRAME = _KEY.size  # a HELLO's whole payload: op and an empty key
_CHUNK = 1 << 20  # a frame's buffer grows by at most this much per read


def clamp_wait(seconds: Optional[float]) -> Optional[float]:
    """``seconds`` (None: no limit) no longer than config.MAX_TIMEOUT, as config.seconds
    clamps timeouts: socket.settimeout and threading waits overflow a little above
    threading.TIMEOUT_MAX, and the quarter leaves room for the grace periods added."""
    return None if seconds is None else min(seconds, MAX_TIMEOUT)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    """``n`` bytes, or None if the stream ends first. The buffer grows by at most _CHUNK a
    read, so a huge ``n`` costs memory only as the bytes arrive."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, limit: Optional[int] = None) -> Optional[bytes]:
    """One frame's payload; None if the stream ends, or if its length exceeds ``limit``."""
    head = recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if limit is not None and n > limit:
        return None
    return recv_exact(sock, n) if n else b""


# What to change when rank 0 cannot listen, by where the port came from (LaunchEnv.port_source).
_PORT_HINTS = {
    "addr": "pass a free port in addr='host:port' (the same on every rank)",
    "LINKWISE_MASTER_PORT": "set LINKWISE_MASTER_PORT to a free port (under linkwise launch: pass "
                            "another --master-port, or none for a free one)",
    "MASTER_PORT": "the store takes MASTER_PORT + 1 (torch's own store has MASTER_PORT); choose another "
                   "MASTER_PORT, or set LINKWISE_MASTER_PORT to a free port",
    "derived": "set LINKWISE_MASTER_PORT to a free port (the same on every rank)",
}


def _listen_on(host: str, port: int) -> tuple[socket.socket, str]:
    """A listener for a store whose clients reach it at ``host``, and the address that rank 0's
    own client connects to. A loopback host is bound as it is. Any other host (an address or a
    host name, which may resolve to IPv4, IPv6 or both on the other ranks) gets one socket for
    IPv4 and IPv6 on every interface where the system allows that (dual stack); else an IPv6
    address gets an IPv6-only socket and anything else an IPv4 one."""
    if host in _LOOPBACK:
        bind = "127.0.0.1" if host == "localhost" else host
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        return socket.create_server((bind, port), family=family, backlog=256), bind
    if socket.has_dualstack_ipv6():
        sock = socket.create_server(("::", port), family=socket.AF_INET6, backlog=256, dualstack_ipv6=True)
        return sock, "::1" if ":" in host else "127.0.0.1"
    if ":" in host:  # create_server makes an AF_INET6 socket IPv6-only unless asked for both
        return socket.create_server(("::", port), family=socket.AF_INET6, backlog=256), "::1"
    return socket.create_server(("0.0.0.0", port), family=socket.AF_INET, backlog=256), "127.0.0.1"


class Server:
    """The store itself; lives in rank 0's process. Threading: one daemon thread per client
    connection; all share one dict guarded by one Condition (see linkwise.store)."""

    def __init__(self, host: str, port: int, token: bytes, spare_ports: int, port_source: str):
        last = None
        ports = [port] if port == 0 else list(range(port, min(port + spare_ports, 65535) + 1))
        for p in ports:
            try:
                self.listener, self.self_host = _listen_on(host, p)
                break
            except OSError as exc:
                last = str(exc)  # not exc: its traceback holds this frame, which holds it (a cycle)
        else:
            tried = f"{host}:{port}" + (f"..{ports[-1]}" if len(ports) > 1 else "")
            raise BootstrapError(
                f"rank 0 cannot listen on {tried} for the rendezvous store ({last}); another "
                f"job may hold the port: {_PORT_HINTS.get(port_source, _PORT_HINTS['derived'])}") from None
        self.token = token
        self.port = self.listener.getsockname()[1]
        self._data: dict[str, bytes] = {}
        # rank -> (who joined as it, the connection its JOIN came on) (JOIN)
        self._joined: dict[str, tuple[str, socket.socket]] = {}
        self._settled: set[str] = set()  # ranks whose setup is done (SETTLED)
        # rank -> who: ranks whose JOIN connection closed before they settled, in the order
        # they left (the first is the one the waiters name; later ones mostly follow from it)
        self._left: dict[str, str] = {}
        self._cond = threading.Condition()
        self._closing = False  # close() began: it waits for the ranks still setting up
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._busy = 0  # requests received and not yet answered (guarded by _cond)
        threading.Thread(target=self._accept_loop, name="linkwise-store-accept",
                         daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # listener shut down by close()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="linkwise-store-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            first = True
            while True:
                # The first request must be a HELLO (see the module docstring): anything else
                # is not a linkwise client, and its connection is dropped unanswered.
                req = recv_frame(conn, _HELLO_FRAME if first else MAX_REQUEST)
                if req is None or (first and req[:1] != bytes([_HELLO])):
                    return
                first = False
                with self._cond:
                    self._busy += 1
                try:
                    try:
                        reply = self._handle(req, conn)
                    except (ValueError, UnicodeDecodeError, struct.error, OverflowError) as exc:
                        reply = bytes([_FAIL]) + f"bad request: {exc}".encode()
                    send_frame(conn, reply)
                finally:
                    with self._cond:
                        self._busy -= 1
                        self._cond.notify_all()
        except OSError:
            return
        finally:
            with self._cond:
                self._conns.discard(conn)
                self._note_left(conn)
            conn.close()

    def _note_left(self, conn: socket.socket) -> None:
        """``conn`` closed (caller holds _cond): a rank that joined on it and had not settled
        left during setup; every waiter wakes (and answers LEFT)."""
        if self._closed:
            return
        for rank, (who, joined_on) in self._joined.items():
            if joined_on is conn and rank not in self._settled and rank not in self._left:
                self._left[rank] = who
                self._cond.notify_all()

    def _left_reply(self) -> bytes:
        """LEFT, naming the first rank that left during setup (caller holds _cond)."""
        rank, who = next(iter(self._left.items()))
        return bytes([_LEFT]) + f"{rank}|{who}".encode()

    def _all_settled_or_left(self) -> bool:
        """Every joined rank has settled or its JOIN connection has closed (caller holds _cond)."""
        return all(rank in self._settled or conn not in self._conns
                   for rank, (_, conn) in self._joined.items())

    def _handle(self, req: bytes, conn: socket.socket) -> bytes:
        op, klen = _KEY.unpack_from(req)
        key = req[_KEY.size:_KEY.size + klen].decode()
        body = req[_KEY.size + klen:]
        if op == _HELLO:
            return bytes([_OK]) + self.token
        with self._cond:
            if op == _SET:
                self._data[key] = body
                self._cond.notify_all()
                return bytes([_OK])
            if op == _ADD:
                (amount,) = _I64.unpack(body)
                value = int(self._data.get(key, b"0")) + amount
                self._data[key] = str(value).encode()
                self._cond.notify_all()
                return bytes([_OK]) + _I64.pack(value)
            if op == _JOIN:
                # Contract: a rank is joined by one process at a time. A join by another
                # process while the first one's JOIN connection is open is refused
                # (_MISSING), with the description of the first (see Store.join). A process
                # that died closed that connection: one started in its place joins, as
                # before joins were recorded. The same process may join again (a retry).
                who = body.decode(errors="replace")
                first = self._joined.get(key)
                if first is not None and first[0] != who and first[1] in self._conns:
                    return bytes([_MISSING]) + first[0].encode()
                self._joined[key] = (who, conn)
                # A process in the place of one that left sets up afresh (waiters that were
                # told of the leaving have raised already).
                self._left.pop(key, None)
                self._settled.discard(key)
                return bytes([_OK])
            if op == _SETTLED:
                self._settled.add(key)
                self._cond.notify_all()  # a closing server may wait for it
                return bytes([_OK])
            if op == _CHECK:
                (wait,) = _F64.unpack(body)
                self._cond.wait_for(lambda: self._left or self._closed, clamp_wait(max(0.0, wait)))
                if self._left:
                    return self._left_reply()
                if self._closed:
                    raise OSError("store closing")
                return bytes([_OK])
            if op == _GET:
                (timeout,) = _F64.unpack(body)
                ready = self._cond.wait_for(lambda: key in self._data or self._closed or self._left,
                                            None if timeout < 0 else clamp_wait(timeout))
                if key in self._data:
                    return bytes([_OK]) + self._data[key]
                if self._left:
                    return self._left_reply()
                if ready:  # woken by close()
                    raise OSError("store closing")
                return bytes([_MISSING])
            if op in (_BARRIER, _BARRIER_WAIT):
                size, timeout = _BAR.unpack(body)
                if op == _BARRIER:
                    arrived = int(self._data.get(key, b"0")) + 1
                    self._data[key] = str(arrived).encode()
                    self._cond.notify_all()
                    if arrived > size:
                        return bytes([_FAIL]) + (f"{arrived} callers for size {size}; barrier names "
                                                 f"are single-use and size must match on every rank"
                                                 ).encode()

                def count() -> int:
                    return int(self._data.get(key, b"0"))
                done = self._cond.wait_for(lambda: count() >= size or self._closed or self._left,
                                           None if timeout < 0 else clamp_wait(timeout))
                if count() >= size:
                    return bytes([_OK])
                if self._left:
                    return self._left_reply()
                if done:
                    raise OSError("store closing")
                return bytes([_MISSING]) + _I64.pack(count())
        return bytes([_FAIL]) + f"unknown store op {op}".encode()

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            # Ranks still setting up are answered a while longer (see the module docstring):
            # they learn who left (the closing rank 0 itself, once its own JOIN connection
            # closed) rather than only that the store went away.
            self._cond.wait_for(self._all_settled_or_left, DRAIN)
            self._closed = True
            self._cond.notify_all()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._cond:  # answer what was asked before the close (see linkwise.store)
            self._cond.wait_for(lambda: self._busy == 0, DRAIN)
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.listener.close()

"""A Dask comm backend: ``linkwise://host:port`` addresses for schedulers and workers.

    from linkwise import dask_comm  # noqa: F401 - registers the scheme (installed: entry point)
    cluster = LocalCluster(protocol="linkwise://", n_workers=4)

Each comm is one TCP connection driven by asyncio. Between processes of one host that may
read each other's memory (checked in the handshake), frames of at least CMA_MIN bytes do not
cross the socket: the writer sends their addresses, and the reader copies them straight out
of the writer's memory (process_vm_readv: one copy, no socket buffers; what Dask's tcp://
needs two kernel copies and many syscalls for). Across hosts, or where the kernel refuses
that access, every frame goes through the socket.

The records on the wire and the handshake are in _dask_wire.py.
Contract: write() returns only when the peer acknowledged the message's by-address frames,
so the caller's buffers stay alive and unchanged for as long as the reader may copy them. A
write given up before that (cancelled, or the comm closed) ends the comm and zeroes the live
word first; the reader reads that word after its copies and never delivers such a message.
Threading: one event loop per comm; a reader task owns the socket's receive side (it takes
acks even when nobody calls read()); messages and acks go out whole, under a write lock,
which the reader never waits for (see _owe_ack).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import weakref

import numpy as np
from distributed.comm import registry
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector
from distributed.comm.registry import Backend
from distributed.comm.utils import from_frames, to_frames
from distributed.utils import ensure_ip, get_ip, get_ipv6

from . import _native
from ._dask_wire import (ACK, FRAME, HEAD, MAGIC, MSG, byte_view, handshake, recv_exact, recv_head,
                         set_keepalive, shutdown)

logger = logging.getLogger(__name__)
SCHEME = "linkwise"
CMA_MIN = 512 << 10  # smaller frames are as fast inline as by address (which costs an ack), or faster
_OFFLOAD_MIN = 4 << 20  # by-address copies this large run in threads, off the event loop
_COPY_THREADS = min(4, os.cpu_count() or 1)  # threads one large frame's copy is split over
_JOIN_MAX = 64 << 10  # inline frames up to this much in all go out with the head in one send


class LinkwiseComm(Comm):
    """One connection. Created by the connector and the listener after the transport's own
    handshake (_dask_wire.handshake), before Dask's.

    Ownership of by-address frames: a write keeps its frames (`keep`, next to its ack future in
    _acks) until the peer acknowledges them or the comm fails. A write that is cancelled, or a
    comm closed while writes wait for acks, cannot call back what the peer may still copy: so
    the comm fails first, which zeroes this side's live word, and the peer reads that word
    after each copy and drops a message whose writer gave it up (_take_message): it takes
    only the random token agreed in the handshake as live, never other bytes that memory may
    hold once the comm is freed. The socket
    is shut down at once (a pending send or receive wakes) and closed once the reader and
    every write have left it."""

    def __init__(self, sock: socket.socket, local_addr: str, peer_addr: str, link: dict, deserialize: bool = True):
        super().__init__(deserialize=deserialize)
        self._sock = sock
        self._local_addr, self._peer_addr = local_addr, peer_addr
        self._peer_pid = link["peer_pid"]
        self._peer_live = link["peer_live"]  # the peer's live word (read after copying its frames)
        self._peer_token = link["peer_token"]  # what that word holds while the peer is live
        self._live = link["live"]  # ours: our token while our by-address frames may be delivered
        self._send_by_address = link["send_by_address"]  # the peer said it can read our memory
        self._read_by_address = link["read_by_address"]
        self._loop = asyncio.get_running_loop()
        self._write_lock = asyncio.Lock()
        self._acks: collections.deque = collections.deque()  # (future, frames) of writes awaiting their ack
        self._messages: asyncio.Queue = asyncio.Queue()
        self._unread = 0  # messages in _messages (not the None that marks the end)
        self._closed = False
        self._closed_here = False  # close() or abort() on this side: read() raises at once
        self._writing = 0  # writes inside the socket (the fd stays open while any is)
        self.frames_by_address = 0  # frames this side sent by address so far (tests, diagnostics)
        self._acks_owed = 0  # messages read whose by-address frames were copied, not yet acked
        # The reader holds the comm only weakly, so a comm dropped without close() is collected
        # (its finalizer shuts the socket down, and the reader then ends and closes it).
        ref = weakref.ref(self)
        self._reader = self._loop.create_task(_read_loop(ref, sock, self._loop))
        self._reader.add_done_callback(lambda _: (c := ref()) is not None and c._close_fd_when_idle())
        weakref.finalize(self, shutdown, sock)

    # -- receiving (the reader task: _read_loop) ---------------------------------------------
    def _take_ack(self, count: int) -> None:
        for _ in range(count):
            fut, _frames = self._acks.popleft()
            if not fut.done():
                fut.set_result(None)

    async def _take_message(self, count: int) -> list:
        table = await recv_exact(self._loop, self._sock, count * FRAME.size)
        specs = [FRAME.unpack_from(table, i * FRAME.size) for i in range(count)]
        # The inline frames come back to back: one receive for all, each frame a view of it.
        blob = await recv_exact(self._loop, self._sock, sum(n for n, addr in specs if not addr))
        # The by-address frames land back to back in one buffer too: Dask splits a frame over
        # 64 MiB into shards and joins them without a copy only where they are adjacent views
        # of one buffer (distributed.protocol.utils.merge_memoryviews), as tcp:// delivers them.
        copied = memoryview(np.empty(sum(n for n, addr in specs if addr), np.uint8))
        frames, by_address, at, at_copied = [], False, 0, 0
        for nbytes, addr in specs:
            if addr == 0:
                frames.append(blob[at:at + nbytes])
                at += nbytes
                continue
            by_address = True
            piece = copied[at_copied:at_copied + nbytes]
            out = np.frombuffer(piece, np.uint8)
            at_copied += nbytes
            if nbytes >= _OFFLOAD_MIN:
                # Off the event loop, in pieces on several threads: one core cannot both fault
                # in fresh pages and copy at memory speed (256 MiB went slower than tcp://).
                n = max(1, min(_COPY_THREADS, nbytes // _OFFLOAD_MIN))
                cuts = [nbytes * i // n for i in range(n + 1)]
                await asyncio.gather(*(asyncio.to_thread(_native.cma_read, self._peer_pid, addr + lo, out[lo:hi])
                                       for lo, hi in zip(cuts, cuts[1:])))
            else:
                _native.cma_read(self._peer_pid, addr, out)
            frames.append(piece)
        if by_address:
            live = np.zeros(1, np.uint64)
            _native.cma_read(self._peer_pid, self._peer_live, live)
            if live[0] != self._peer_token:  # given up (0), or the comm freed: the copy may be changed
                raise CommClosedError(f"linkwise comm to {self._peer_addr}: the peer gave up a message in flight")
            self._owe_ack()  # the writer may reuse those buffers now
        return frames

    def _owe_ack(self) -> None:
        """Acks leave between messages, never inside one, and the reader must not wait for the
        write lock (a write of ours may be blocked on the peer's socket while the peer's reader
        waits the same way: neither would read again): a write still going sends them when
        its message is out, else a task does."""
        self._acks_owed += 1
        if self._acks_owed == 1:
            self._ack_task = self._loop.create_task(self._send_acks())  # held: the loop keeps tasks weakly

    async def _send_acks(self) -> None:
        try:
            async with self._write_lock:
                await self._send_acks_locked()
        except (OSError, CommClosedError, asyncio.CancelledError):
            self._end()

    async def _send_acks_locked(self) -> None:
        while self._acks_owed and not self._closed:
            owed = self._acks_owed
            await self._loop.sock_sendall(self._sock, HEAD.pack(MAGIC, ACK, owed))
            self._acks_owed -= owed  # more may have been owed meanwhile: the loop sends them

    async def read(self, deserializers=None):
        # After the peer ended the connection, what it sent before is still read (as tcp://
        # reads the rest of its stream); after this side closed, nothing is (as tcp://).
        if self._closed_here or (self._closed and self._messages.empty()):
            raise CommClosedError(f"linkwise comm to {self._peer_addr} is closed")
        frames = await self._messages.get()  # cancelled here, nothing is lost
        if frames is None:  # the connection ended (see _fail)
            self._messages.put_nowait(None)
            raise CommClosedError(f"linkwise comm to {self._peer_addr} is closed")
        self._unread -= 1
        try:
            return await from_frames(frames, deserialize=self.deserialize, deserializers=deserializers,
                                     allow_offload=self.allow_offload)
        except BaseException:
            # Cancelled while a large message was deserialised in a thread, or the message
            # would not deserialise: it is lost, so the comm ends rather than go on a message
            # short (as tcp:// aborts).
            self.abort()
            raise

    # -- sending ----------------------------------------------------------------------------
    async def write(self, msg, serializers=None, on_error="message") -> int:
        if self._closed:
            raise CommClosedError(f"linkwise comm to {self._peer_addr} is closed")
        frames = await to_frames(msg, allow_offload=self.allow_offload, serializers=serializers, on_error=on_error,
                                 context={"sender": self.local_info, "recipient": self.remote_info,
                                          **self.handshake_options})
        table, inline, keep, nbytes = [], [], [], 0
        for frame in frames:
            body = byte_view(frame)
            nbytes += body.nbytes
            addr = np.frombuffer(body, np.uint8).ctypes.data if self._send_by_address and body.nbytes >= CMA_MIN else 0
            table.append(FRAME.pack(body.nbytes, addr))
            (keep if addr else inline).append(body)
        ack = self._loop.create_future() if keep else None
        self.frames_by_address += len(keep)
        self._writing += 1
        try:
            async with self._write_lock:
                if self._closed:
                    raise CommClosedError(f"linkwise comm to {self._peer_addr} is closed")
                if ack is not None:
                    self._acks.append((ack, keep))  # in stream order: the reader acknowledges in order
                head = [HEAD.pack(MAGIC, MSG, len(frames)), *table]
                if sum(b.nbytes for b in inline) <= _JOIN_MAX:  # small: one send, one copy
                    await self._loop.sock_sendall(self._sock, b"".join(head + inline))
                else:
                    await self._loop.sock_sendall(self._sock, b"".join(head))
                    for body in inline:
                        await self._loop.sock_sendall(self._sock, body)
                await self._send_acks_locked()
            if ack is not None:
                await ack  # the peer copied the by-address frames: they may go
        except OSError as exc:
            self._end()
            raise CommClosedError(f"linkwise comm to {self._peer_addr}: {exc}") from exc
        except BaseException:
            # Cancelled (or failed) with a message half sent or its frames not yet copied: the
            # stream cannot go on, and the caller may reuse the frames now, so the comm ends
            # (the peer drops such a message: see the class docstring).
            self._end()
            raise
        finally:
            self._writing -= 1
            self._close_fd_when_idle()
        return nbytes

    # -- lifetime ---------------------------------------------------------------------------
    def _fail(self, exc: CommClosedError) -> None:
        if not self._closed:
            self._closed = True
            self._live[0] = 0  # before the frames below are let go (the peer checks it after copying)
            shutdown(self._sock)
        while self._acks:  # a write waiting for its ack: the reader will never copy now
            fut, _frames = self._acks.popleft()
            if not fut.done():
                fut.set_exception(exc)
        self._messages.put_nowait(None)
        self._close_fd_when_idle()

    def _close_fd_when_idle(self) -> None:
        if self._closed and self._writing == 0 and self._reader.done() and self._sock.fileno() >= 0:
            self._sock.close()

    async def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        """Any thread (Dask's rpc.__del__ may call it from one without a loop): the comm's
        state belongs to its loop, so another thread hands the work to that loop, or, where
        the loop has stopped, only shuts the socket down."""
        self._closed_here = True
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._end()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._end)
        else:
            self._live[0] = 0  # as _fail does, before the peer could copy more
            shutdown(self._sock)

    def _end(self) -> None:
        """Ends the connection (a failed or given-up write, a lost ack: the stream cannot go
        on); messages already read from the peer stay readable."""
        self._fail(CommClosedError(f"linkwise comm to {self._peer_addr} was closed"))
        if not self._reader.done():
            self._reader.cancel()

    def closed(self) -> bool:
        """True once this side closed, or the connection ended and every message that came
        before the end was read: the reader task reads ahead, but a peer's close must not hide
        messages Dask has yet to handle (Server.handle_comm stops at closed(), as over tcp://,
        where the end is only seen by the read after the last message)."""
        return self._closed and (self._closed_here or self._unread == 0)

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def same_host(self) -> bool:
        return self._read_by_address or self._send_by_address or super().same_host


async def _read_loop(ref, sock: socket.socket, loop) -> None:
    """The reader task: acks and messages, until the connection ends or the comm is dropped.
    Holds the comm only while it handles a record (see LinkwiseComm.__init__)."""
    try:
        while True:
            kind, count = await recv_head(loop, sock)
            comm = ref()
            if comm is None:
                break
            if kind == ACK:
                comm._take_ack(count)
            elif kind == MSG:
                comm._messages.put_nowait(await comm._take_message(count))
                comm._unread += 1
            else:
                raise CommClosedError(f"linkwise comm: unexpected record kind {kind}")
            del comm
    except asyncio.CancelledError:
        exc = CommClosedError("linkwise comm was closed")
    except Exception as e:  # noqa: BLE001 - a socket error, or a copy from a writer that died
        exc = e if isinstance(e, CommClosedError) else CommClosedError(f"linkwise comm: {e}")
    else:
        exc = None
    comm = ref()
    if comm is not None and exc is not None:
        comm._fail(exc)
    elif comm is None:  # dropped without close(): nobody else will close the fd
        sock.close()


def _address(sock_addr) -> str:
    return f"{SCHEME}://" + unparse_host_port(sock_addr[0], sock_addr[1])


class LinkwiseConnector(Connector):
    async def connect(self, address: str, deserialize: bool = True, **connection_args) -> LinkwiseComm:
        host, port = parse_host_port(address)
        loop = asyncio.get_running_loop()
        error = None
        for family, _, _, _, target in await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, target)
            except OSError as exc:  # the next address the name has (IPv6 / IPv4)
                sock.close()
                error = exc
                continue
            except BaseException:  # cancelled (Dask's connect retries time out): no fd left behind
                sock.close()
                raise
            set_keepalive(sock)
            try:
                link = await handshake(sock)
            except BaseException:
                sock.close()
                raise
            return LinkwiseComm(sock, _address(sock.getsockname()), _address(sock.getpeername()), link, deserialize)
        raise error or OSError(f"linkwise comm: no address for {address}")


class LinkwiseListener(BaseListener):
    prefix = f"{SCHEME}://"  # the Worker builds its listening address from it

    def __init__(self, loc: str, handle_comm, deserialize: bool = True, allow_offload: bool = True,
                 **connection_args):
        super().__init__()
        self._host, self._port = parse_host_port(loc, default_port=0)
        self._handle_comm = handle_comm
        self._deserialize = deserialize
        self._allow_offload = allow_offload
        self._sock = None
        self._accepting = None
        self._handshaking: set = set()  # connections still in the transport's handshake
        self._tasks: set = set()  # one per connection, until its handler returns

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in (self._host or "") else socket.AF_INET
        self._sock = socket.create_server((self._host or "", self._port), family=family, backlog=1024)
        self._sock.setblocking(False)
        self._accepting = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                if self._sock.fileno() < 0:  # stop()
                    return
                # Out of file descriptors (EMFILE), or a connection reset before it was taken:
                # that one is lost, the listener is not (tcp:// logs and goes on too).
                logger.warning("linkwise listener %s: accept failed: %s", self.listen_address, exc)
                await asyncio.sleep(0.1)  # fds may take a while to free up: do not spin
                continue
            task = loop.create_task(self._serve(conn))  # the loop keeps tasks only weakly
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_keepalive(conn)
        self._handshaking.add(conn)
        try:
            link = await handshake(conn)
        except (OSError, CommClosedError, ValueError, asyncio.TimeoutError, asyncio.CancelledError):
            conn.close()  # a port probe, a peer of another kind, or stop() meanwhile
            return
        finally:
            self._handshaking.discard(conn)
        comm = LinkwiseComm(conn, _address(conn.getsockname()), _address(conn.getpeername()), link,
                            self._deserialize)
        comm.allow_offload = self._allow_offload
        try:
            await self.on_connection(comm)
        except CommClosedError:
            comm.abort()
            return
        try:
            result = self._handle_comm(comm)
            if asyncio.iscoroutine(result):
                await result
        except CommClosedError:  # the comm ended under its handler: nothing to report
            comm.abort()
        except Exception:  # noqa: BLE001 - log it, end that comm
            logger.exception("linkwise comm handler failed")
            comm.abort()

    def stop(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._sock is not None:
            self._sock.close()
        for conn in list(self._handshaking):  # their handshake reads EOF and gives up
            shutdown(conn)
        self.abort_handshaking_comms()

    @property
    def listen_address(self) -> str:
        return _address(self._sock.getsockname())

    @property
    def contact_address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        if host in ("0.0.0.0", ""):
            host = get_ip()
        elif host == "::":
            host = get_ipv6()
        return f"{SCHEME}://" + unparse_host_port(host, port)


class LinkwiseBackend(Backend):
    def get_connector(self) -> LinkwiseConnector:
        return LinkwiseConnector()

    def get_listener(self, loc, handle_comm, deserialize, **connection_args) -> LinkwiseListener:
        return LinkwiseListener(loc, handle_comm, deserialize, **connection_args)

    def get_address_host(self, loc: str) -> str:
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc: str) -> tuple:
        return parse_host_port(loc)

    def resolve_address(self, loc: str) -> str:
        host, port = parse_host_port(loc)
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc: str) -> str:
        host, _ = parse_host_port(loc)
        return unparse_host_port(get_ip(ensure_ip(host)), None)


registry.backends.setdefault(SCHEME, LinkwiseBackend())

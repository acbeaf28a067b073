"""A small TCP key-value store through which ranks rendezvous at setup.

Rank 0 creates ``Store(host, port, is_server=True, ...)``: it listens on ``port`` (on ``host``
when that is a loopback address, else on every interface, IPv4 and IPv6 alike where the system
allows one socket both, so a host name that resolves to IPv6 only on the other ranks is
reached too) from a daemon thread and also connects to itself as a client. Every other rank creates ``Store(host, port, is_server=False)``
and retries connecting until ``timeout``.

Spare ports: when the port was derived (MASTER_PORT+1, or hashed from a job id) rather than
chosen by the user, another process may already hold it (a listener, or an outgoing connection
that the kernel gave that local port). ``spare_ports=k`` then lets the server take the first
free port of ``port .. port+k``; clients try those ports in turn and keep the one whose server
answers a HELLO with the job's ``token``, so a foreign listener on one of them is skipped.

Wire format and server: :mod:`linkwise._store_server`. A client's first request on each
connection is a HELLO (the server drops a connection that starts otherwise), and a value is
at most MAX_REQUEST bytes (64 MiB; linkwise's own are a few hundred).

Joining: ``Store.join(rank, who)`` records that ``rank`` joined this store; a join of the same
rank by another process while the first one's store connection is open is refused
(BootstrapError naming the first), so a rank of another job that reached this job's store
(same port, same token: no LINKWISE_JOB_ID) or a duplicate rank is an error at once instead of
a rank silently taking another's place. The same process may join again, and once the first
has died (its connection closed) a process started in its place joins.

Leaving during setup: the connection a rank joined on is kept for joins and ``settled()``
only, open as long as its process and this object are, until ``settled()`` (init() calls it
once its world communicator is made) says the rank's setup is done (it then joins the pool).
A joined rank whose connection closes before that (it died, or its init() failed and closed
the store) makes every store wait that is not yet satisfied, on every rank, raise
:class:`RankLeftError` naming it at once, and so does :meth:`raise_if_left`, which waits that
are not store waits (accepting TCP links) call between slices. After ``settled()``, closing is
not leaving.

Threading: the server runs one daemon thread per client connection; all of them share one
dict guarded by one Condition, so any number of blocking GETs wait concurrently and a SET wakes
them. A client ``Store`` object may be used from any number of threads at once: each call
takes an idle connection to the server, or opens one more, so a call blocked in one thread
(say, a communicator's setup waiting for its peers) never holds up another thread's (a split
communicator's setup: the two once waited for each other until the timeout).

Failure: if the server goes away (rank 0 exited, closed the store, or was killed) every client
call in progress or later raises :class:`StoreClosedError` (a PeerError and a BootstrapError
naming rank 0), never hangs. Closing the server first answers every request it has already
received (for up to DRAIN seconds), so rank 0 may close right after a final barrier: every
participant's barrier request has then reached the server. Requests sent later get
StoreClosedError. While joined ranks are still setting up, a closing server first waits (up to
DRAIN seconds) for them to settle or leave, answering them: they raise RankLeftError naming
the rank that left (rank 0 itself when its own init() failed) rather than StoreClosedError.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Optional

from ._store_server import (_ADD, _BARRIER, _BARRIER_WAIT, _BAR, _CHECK, _F64, _FAIL, _GET, _HELLO, _I64, _JOIN, _KEY,
                            _LEFT, _LEN, _MISSING, _OK, _SET, _SETTLED, DRAIN, MAX_REQUEST, Server,
                            clamp_wait, recv_exact, recv_frame, send_frame)
from .errors import BootstrapError, PeerError, TimeoutError

__all__ = ["Store", "StoreClosedError", "RankLeftError", "DRAIN", "MAX_REQUEST"]

_GRACE = 10.0  # seconds a client waits beyond a server-side timeout before it gives up
_HELLO_WAIT = 2.0  # seconds a client waits for a candidate port's HELLO reply
_MAX_TOKEN = 256  # bytes of a store's token a client reads (job id | size | port | world)
WATCH_SLICE = 0.25  # seconds a watched wait (get, barrier, all_gather) waits between watch() calls


class StoreClosedError(PeerError, BootstrapError):
    """The rendezvous store (hosted by rank 0) closed its connection."""


class RankLeftError(PeerError, BootstrapError):
    """A rank died or left during setup: its store connection closed before its init() was
    done. ``peer`` is that rank, ``rank`` this one (-1 where this object joined as none)."""


class _Missing(Exception):
    """Internal: the server's wait timed out; ``args[0]`` is the reply body."""


def _world_gap(theirs: bytes, ours: bytes) -> Optional[int]:
    """Their world number less ours, where a store's token names this rank's job, size and
    port (_world.init's tokens: `job|size|port|world`; a long job id hashed); None where it names another job or size. A rank
    that closed a world and made the next one may reach rank 0 before rank 0 has closed the
    old one (gap < 0): joining that store failed once rank 0 closed it, and rank 0 then waited
    for the rank in the new world until the timeout. A later world (gap > 0: rank 0 retried a
    failed init) is this rank's to join, as before worlds were numbered."""
    t, o = theirs.split(b"|"), ours.split(b"|")
    if len(t) != 4 or len(o) != 4 or t[:3] != o[:3] or not t[3].isdigit() or not o[3].isdigit():
        return None
    return int(t[3]) - int(o[3])


class Store:
    """Client of the rendezvous store (and, with ``is_server=True``, its host).

    ``timeout`` bounds connecting and is the default for :meth:`get`, :meth:`barrier` and
    :meth:`all_gather`. With ``port=0`` and ``is_server=True`` the OS picks a port, readable
    as ``store.port``. Any number of threads may call one object at once (see the module docstring)."""

    def __init__(self, host: str, port: int, *, is_server: bool, timeout: float,
                 token: str = "", spare_ports: int = 0, port_source: str = "LINKWISE_MASTER_PORT",
                 check: Optional[Callable[[], None]] = None):
        # token: the same on every rank of one job and different between jobs (_world.init uses
        # the job id, size, base port and world number). A client skips a store whose token
        # differs: another job's (an error where no spare port is left) or this job's earlier
        # world, still open (it waits for the next one; _world_gap).
        # check: called every ~0.25 s while connecting and while all_gather waits for a value,
        # and before a request raises StoreClosedError or RankLeftError (_cause); it raises to
        # give up (init() under `linkwise launch`: a rank that left without joining).
        self.host, self.timeout, self.is_server = host, clamp_wait(float(timeout)), is_server
        self.check = check
        self._server: Optional[Server] = None
        self._lock = threading.Lock()  # guards the connection pool below
        self._idle: list[socket.socket] = []  # connections no call is using
        self._open: set[socket.socket] = set()  # every connection (close() shuts them all)
        self._closed = False
        # The connection this process joined on (see "Leaving during setup"): used by join()
        # and settled() only, never in _idle until settled() puts it there; guarded by _lock.
        self._held: Optional[socket.socket] = None
        self._rank = -1  # the rank joined as (-1: none)
        self._settled = False  # settled() was called: closing no longer means leaving setup
        self._token = token.encode()
        candidates, self.port = [port], port
        if is_server:
            self._server = Server(host, port, self._token, spare_ports, port_source)
            port = candidates[0] = self._server.port
            host = self._server.self_host
        elif spare_ports > 0 and port > 0:
            candidates = list(range(port, min(port + spare_ports, 65535) + 1))
        try:
            sock, self.port = self._connect(host, candidates)
        except BaseException:
            self.close()
            raise
        self._conn_host = host  # where more connections go (the port answered HELLO, if asked)
        self.joined_token = self._joined_token  # the token of the store joined (_world_gap >= 0)
        self._idle.append(sock)
        self._open.add(sock)

    def _connect(self, host: str, candidates: list[int]) -> tuple[socket.socket, int]:
        """Connect to the first candidate port whose server is this job's store (its HELLO
        token matches, a single port the user gave included). Retries until ``timeout``."""
        deadline = time.monotonic() + self.timeout
        delay, last = 0.01, None
        while True:
            for port in candidates:
                left = deadline - time.monotonic()
                if left <= 0 and port != candidates[0]:
                    break  # a round over filtered ports may be slow: keep to the deadline
                try:
                    sock = socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0)))
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError as exc:
                    last = str(exc)  # not exc: its traceback holds this frame, which holds it (a cycle
                    # that kept the communicator made by init() alive after close() until a gc pass)
                    continue
                theirs = self._their_token(sock)
                gap = _world_gap(theirs, self._token) if theirs is not None else None
                if theirs == self._token or (gap is not None and gap >= 0):
                    self._joined_token = theirs
                    sock.settimeout(None)
                    return sock, port
                sock.close()
                if theirs is None:
                    last = f"port {port} is held by something other than this job's store"
                elif gap is not None:  # an earlier world's, which rank 0 has not closed yet: wait
                    last = f"the store on port {port} is still this job's previous world's"
                else:  # a linkwise store, of another job or another size: never join it
                    last = (f"the store on port {port} is another job's or has another size (its job|size|port "
                            f"{theirs.decode(errors='replace')!r}, this rank's {self._token.decode(errors='replace')!r}); "
                            "check that every rank has the same size and LINKWISE_JOB_ID")
                    if len(candidates) == 1:  # the port is taken for good: this job's rank 0 cannot listen there
                        raise BootstrapError(f"could not join the rendezvous store at {host}:{port}: {last}")
            if self.check is not None:
                self.check()
            if time.monotonic() + delay > deadline:
                ports = f"{candidates[0]}" + (f"..{candidates[-1]}" if len(candidates) > 1 else "")
                raise BootstrapError(
                    f"could not reach the rendezvous store at {host}:{ports} within "
                    f"{self.timeout:g} s ({last}); check that rank 0 is running, that "
                    f"LINKWISE_MASTER_ADDR/LINKWISE_MASTER_PORT (or MASTER_ADDR/MASTER_PORT) "
                    f"point to it, and that no firewall blocks the port")
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _their_token(self, sock: socket.socket, wait: float = _HELLO_WAIT) -> Optional[bytes]:
        """Ask a freshly connected server for its token (HELLO), also on a port the user gave:
        a store of another job (or started with another size) there must not be joined. None
        for anything but a linkwise store, including a listener that does not answer within
        ``wait`` seconds (_HELLO_WAIT)."""
        try:
            sock.settimeout(wait)
            send_frame(sock, _KEY.pack(_HELLO, 0))
            head = recv_exact(sock, _LEN.size)
            n = _LEN.unpack(head)[0] if head is not None else -1
            if not 1 <= n <= 1 + _MAX_TOKEN:  # also keeps a foreign length from sizing a buffer
                return None
            reply = recv_exact(sock, n)
        except OSError:
            return None
        if reply is None or reply[:1] != bytes([_OK]):
            return None
        return reply[1:]

    def _request(self, op: int, key: str, body: bytes, wait: Optional[float],
                 what: str, held: bool = False) -> bytes:
        """Send one request and return the reply body; ``wait`` bounds the reply (None: none).
        ``held``: on the joined connection (self._held, made first if there is none), which
        stays out of the pool; while a request uses it, self._held is None, so that close()
        only shuts it down (as any connection in use) and this call drops it."""
        k = key.encode()
        sock = None
        if held:
            with self._lock:
                sock, self._held = self._held, None
        if sock is None:
            sock = self._take(what, key)
        try:
            sock.settimeout(clamp_wait(wait))
            send_frame(sock, _KEY.pack(op, len(k)) + k + body)
            reply = recv_frame(sock)
        except socket.timeout:
            self._drop(sock)  # its reply may still come: the stream is out of step
            raise TimeoutError(f"store {what} {key!r}: no reply from {self.host}:{self.port} "
                               f"within {wait:g} s") from None
        except OSError as exc:
            self._drop(sock)
            raise self._cause(self._gone(what, key, exc)) from None
        if reply is None:
            self._drop(sock)
            raise self._cause(self._gone(what, key, None))
        with self._lock:
            if self._closed:
                self._drop_locked(sock)
            elif held:
                self._held = sock
            else:
                self._idle.append(sock)
        if reply[0] == _LEFT:
            raise self._cause(self._left_error(reply[1:], what, key))
        if reply[0] == _FAIL:
            raise BootstrapError(f"store {what} {key!r}: {reply[1:].decode()}")
        if reply[0] == _MISSING:
            raise _Missing(reply[1:])
        return reply[1:]

    def _cause(self, err: PeerError) -> PeerError:
        """``err`` (the store gone, or a rank that left setup), unless ``check`` raises its own
        error first: under `linkwise launch` a rank that ended without calling init() makes
        the others' checks raise, and the first of them to close its store left setup, so the
        rest were told of that rank (or of rank 0) instead of the one that never came."""
        if self.check is not None:
            self.check()
        return err

    def _gone(self, what: str, key: str, exc: Optional[BaseException]) -> StoreClosedError:
        why = f" ({exc})" if exc else ""
        if self._rank >= 0 and not self._settled:
            return StoreClosedError(
                f"rank {self._rank}: rank 0 died or left during setup: the rendezvous store it hosts at "
                f"{self.host}:{self.port} closed the connection (store {what} {key!r}){why}; see rank 0's "
                f"output for the cause", rank=self._rank, peer=0, op=f"store {what}")
        return StoreClosedError(
            f"store {what} {key!r}: the rendezvous store at {self.host}:{self.port} closed the "
            f"connection{why}; rank 0 exited, failed or closed its world communicator (which hosts "
            f"the store that split communicators also set up through): see its output, and let "
            f"rank 0 close only after a final barrier",
            peer=0, op=f"store {what}")

    def _left_error(self, body: bytes, what: str, key: str) -> RankLeftError:
        """The server's LEFT reply (``rank|who``) as the error this rank raises."""
        rank, _, who = body.decode(errors="replace").partition("|")
        me = f"rank {self._rank}: " if self._rank >= 0 else ""
        peer = int(rank) if rank.isdigit() else -1
        return RankLeftError(
            f"{me}rank {rank} ({who}) died or left during setup: its connection to the rendezvous "
            f"store closed before its init() was done (this rank was in store {what} {key!r}); see "
            f"rank {rank}'s output for the cause", rank=self._rank, peer=peer, op=f"store {what}")

    def _take(self, what: str, key: str) -> socket.socket:
        """An idle connection, or a new one (no other call uses it until it is given back)."""
        with self._lock:
            if self._closed:
                raise BootstrapError(f"store {what} {key!r}: the store was closed")
            if self._idle:
                return self._idle.pop()
        try:
            wait = max(1.0, min(self.timeout, 10.0))
            sock = socket.create_connection((self._conn_host, self.port), timeout=wait)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise self._gone(what, key, exc) from None
        # Every connection starts with a HELLO (the server drops one that does not); a store
        # with another token on the port is no longer the one this object joined.
        if self._their_token(sock, max(_HELLO_WAIT, wait)) != self.joined_token:
            sock.close()
            raise self._gone(what, key, None)
        with self._lock:
            self._open.add(sock)
            if self._closed:  # closed meanwhile
                self._drop_locked(sock)
                raise BootstrapError(f"store {what} {key!r}: the store was closed")
        return sock

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._drop_locked(sock)

    def _drop_locked(self, sock: socket.socket) -> None:
        self._open.discard(sock)
        if sock in self._idle:
            self._idle.remove(sock)
        if sock is self._held:
            self._held = None
        sock.close()

    def set(self, key: str, value: bytes) -> None:
        """Set ``key`` to ``value`` and wake everyone waiting for it. ValueError for a value over
        MAX_REQUEST bytes (with the key; the server would drop the connection)."""
        if len(value) + len(key.encode()) + _KEY.size > MAX_REQUEST:
            raise ValueError(f"store set {key!r}: {len(value)} bytes is more than the store takes "
                             f"({MAX_REQUEST} bytes a request, key included)")
        self._request(_SET, key, bytes(value), self.timeout + _GRACE, "set")

    def get(self, key: str, timeout: Optional[float] = None,
            watch: Optional[Callable[[], None]] = None) -> bytes:
        """Block until ``key`` is set and return its value; TimeoutError after ``timeout``
        seconds (default: the store's timeout). ``watch``: see :meth:`_watched`."""
        t = self.timeout if timeout is None else float(timeout)
        try:
            return self._watched(t, watch, lambda wait, first: self._request(
                _GET, key, _F64.pack(wait), wait + _GRACE, "get"))
        except _Missing:
            raise TimeoutError(f"store get {key!r}: nobody set it within {t:g} s") from None

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer counter ``key`` (0 if unset); return the new value."""
        return _I64.unpack(self._request(_ADD, key, _I64.pack(int(amount)),
                                         self.timeout + _GRACE, "add"))[0]

    def barrier(self, name: str, size: int, timeout: Optional[float] = None,
                watch: Optional[Callable[[], None]] = None) -> None:
        """Return once all ``size`` participants have called ``barrier(name, size)``.
        Each name is for one use. ``watch``: see :meth:`_watched`."""
        t = self.timeout if timeout is None else float(timeout)
        key = f"__barrier/{name}"
        try:
            self._watched(t, watch, lambda wait, first: self._request(
                _BARRIER if first else _BARRIER_WAIT, key, _BAR.pack(int(size), wait), wait + _GRACE, "barrier"))
        except _Missing as m:
            (arrived,) = _I64.unpack(m.args[0])
            raise TimeoutError(f"barrier {name!r}: only {arrived} of {size} ranks arrived within "
                               f"{t:g} s; a rank is missing or stuck") from None

    @staticmethod
    def _watched(limit: float, watch: Optional[Callable[[], None]],
                 attempt: Callable[[float, bool], bytes]) -> bytes:
        """``attempt(wait, first)``, one request that waits up to ``wait`` seconds (_Missing when
        that ran out): without ``watch`` once, for the whole ``limit`` (one round trip, as
        before watches); with it, in slices of WATCH_SLICE seconds, calling ``watch()`` after
        each slice that ran out (it raises to give up: a split's setup, whose members the
        store no longer watches, asks the parent communicator's engine whether they live).
        A wait that is satisfied at once costs one round trip either way."""
        if watch is None:
            return attempt(limit, True)
        deadline = time.monotonic() + limit
        first = True
        while True:
            try:
                return attempt(max(0.0, min(WATCH_SLICE, deadline - time.monotonic())), first)
            except _Missing:
                first = False
                watch()
                if time.monotonic() >= deadline:  # the last reply's _Missing: the whole limit ran out
                    raise

    def join(self, rank: int, who: str) -> None:
        """Record that this process joined the store as ``rank``; ``who`` describes it (pid,
        host) in the error of a later one. Contract: one process per rank and store at a time; a
        join by another while the first one's store connection is open raises BootstrapError
        here, naming the first, and changes nothing. A process that died closed that
        connection, so one started in its place joins; the same ``who`` may join again. The
        connection joined on is kept for join() and settled() only, open as long as this
        object: until settled(), its closing is this rank leaving setup (the module docstring)."""
        try:
            self._request(_JOIN, str(int(rank)), who.encode(), self.timeout + _GRACE, "join", held=True)
            self._rank = int(rank)
        except _Missing as m:
            first = m.args[0].decode(errors="replace")
            raise BootstrapError(
                f"rank {rank}: another process already joined the rendezvous store at "
                f"{self.host}:{self.port} as rank {rank} ({first}; this is {who}): most likely "
                f"another job uses the same port with the same size and no LINKWISE_JOB_ID (set "
                f"LINKWISE_JOB_ID to a value of its own in each job, or give each job its own "
                f"port), or two processes were started with the same rank") from None

    def settled(self) -> None:
        """Tell the store that this rank's setup is done: from now on its connection closing
        is not a rank leaving setup (see the module docstring). Sent on the joined connection,
        so the server reads it before that connection's end. A store already gone is not an
        error here: the setup is done, and nobody is left to tell. The joined connection then
        serves as the pool's, and the pool's idle ones close: a settled rank keeps one
        connection to rank 0, as before joins were held (held and pooled, every rank kept two
        for the job's life, and rank 0's store a thread and a descriptor more per rank)."""
        self._settled = True
        if self._rank < 0:
            return
        try:
            self._request(_SETTLED, str(self._rank), b"", self.timeout + _GRACE, "settled", held=True)
        except BootstrapError:  # StoreClosedError, or this object closed meanwhile
            return
        with self._lock:
            if self._closed or self._held is None:
                return
            spare, self._idle = self._idle, [self._held]
            self._held = None
            for sock in spare:  # idle: no call uses them (calls in progress hold theirs)
                self._open.discard(sock)
                sock.close()

    def raise_if_left(self, wait: float = 0.0) -> None:
        """RankLeftError if a joined rank left during setup (waiting up to ``wait`` seconds for
        one to), StoreClosedError if the store is gone; else nothing. For waits that are not
        store waits, between their slices."""
        self._request(_CHECK, "", _F64.pack(float(wait)), float(wait) + _GRACE, "check")

    def all_gather(self, name: str, rank: int, size: int, value: bytes,
                   timeout: Optional[float] = None,
                   alive: Optional[Callable[[int], bool]] = None,
                   watch: Optional[Callable[[], None]] = None) -> list[bytes]:
        """Every rank contributes ``value``; returns all ``size`` values in rank order.
        ``alive(r)`` (a communicator's peer check): a rank whose value is missing and whose
        process is gone raises PeerError within ~0.25 s instead of the timeout; ``watch()`` is
        called there too (it raises to give up: see :meth:`_watched`). The store's
        ``check`` too is called while a value is missing (and, as for every request, before a
        StoreClosedError or RankLeftError is raised: the rank that closed its store may have
        done so for the reason that check gives)."""
        if not 0 <= rank < size:
            raise ValueError(f"all_gather {name!r}: rank {rank} is not in 0..{size - 1}")
        limit = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        self.all_gather_offer(name, rank, value)
        out = []
        for r in range(size):
            key = f"__ag/{name}/{r}"

            def poll(r=r) -> None:  # between slices of the wait for rank r's value
                if alive is not None and not alive(r):
                    raise PeerError(f"rank {rank}: rank {r} exited before it joined {name!r}",
                                    rank=rank, peer=r, op=name)
                if watch is not None:
                    watch()
                if self.check is not None:
                    self.check()
            polled = alive is not None or watch is not None or self.check is not None
            try:
                out.append(self.get(key, max(0.0, deadline - time.monotonic()), poll if polled else None))
            except TimeoutError:  # named with the whole wait, not what was left of it for this key
                raise TimeoutError(f"store get {key!r}: nobody set it within {limit:g} s") from None
        return out

    def all_gather_offer(self, name: str, rank: int, value: bytes) -> None:
        """Contribute ``value`` to all_gather ``name`` without waiting for the others' values
        (a rank that will not take part but must not keep the others waiting for it)."""
        self.set(f"__ag/{name}/{rank}", value)

    def close(self) -> None:
        """Close the connection and, on rank 0, the server (others then get StoreClosedError)."""
        with self._lock:
            self._closed = True
            busy = list(self._open)
        for sock in busy:  # wakes calls blocked in other threads (they raise)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._lock:
            for sock in list(self._idle) + ([self._held] if self._held is not None else []):
                self._drop_locked(sock)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

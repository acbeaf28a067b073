"""What ``linkwise launch`` and its ranks tell each other about joining the job, so that a rank
which ends without ever calling ``init()`` does not leave the others waiting in ``init()``
until LINKWISE_TIMEOUT.

Each rank inherits one end of a Unix socket pair: its descriptor number is in
LINKWISE_LAUNCH_FD and the launcher's pid in LINKWISE_LAUNCH_PID, which must be the socket's
peer (SO_PEERCRED), so that a descriptor of that number which is something else (closed and
reused by the program, or inherited from an outer launcher) is never written to.

* A rank's ``init()`` sends ``I`` (once a process) as it starts to join, before it connects
  to the rendezvous store.
* A rank that has exited, whose end no process holds any more (the launcher reads end of
  file: a process the rank left behind that holds it may still join), and that never sent
  ``I`` has left without joining: the launcher sends every other rank ``left K S\\n`` (K the
  rank, S its exit status as the launcher reports it) and, where a rank is joining, says so.
* A rank's ``init()`` that waits (to reach the store, or for a missing rank's card) reads these
  notices and raises BootstrapError naming the rank that left (Store's ``check``), within
  ~0.25 s of it. A rank that joined a world and then exits is no news: the others' worlds
  formed with it, and they wait in nothing of init() for it.

Threading: the launcher's side (:class:`RankLinks`) is used by its main thread only; the
rank's side by whichever thread calls init() (one at a time: its state is set once).
"""
from __future__ import annotations

import os
import socket
import struct
from typing import Optional

from .errors import BootstrapError

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class RankLinks:
    """The launcher's ends of its ranks' sockets."""

    def __init__(self, say) -> None:
        self._say = say
        self._socks: dict[int, socket.socket] = {}
        self._entered: set[int] = set()  # ranks that sent "I"
        self._eof: set[int] = set()  # ranks whose end nobody holds any more
        self._status: dict[int, int] = {}  # ranks that exited: their status
        self._told: set[int] = set()  # ranks whose leaving was told

    def new(self, rank: int) -> tuple[int, dict[str, str]]:
        """A socket pair for ``rank``: the descriptor the rank inherits (close it here once it
        is started) and the variables that name it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        self._socks[rank] = ours
        fd = theirs.detach()
        return fd, {"LINKWISE_LAUNCH_FD": str(fd), "LINKWISE_LAUNCH_PID": str(os.getpid())}

    def exited(self, rank: int, status: int) -> None:
        self._status[rank] = status
        self.poll()

    def poll(self) -> None:
        """Read what the ranks sent; tell the others of each rank that left without joining."""
        for k, sock in self._socks.items():
            while k not in self._eof:
                data = _read_ready(sock)
                if data is None:
                    break
                if not data:
                    self._eof.add(k)
                elif b"I" in data:
                    self._entered.add(k)
        for k in sorted((self._eof & self._status.keys()) - self._entered - self._told):
            self._tell(k)

    def _tell(self, k: int) -> None:
        self._told.add(k)
        status = self._status[k]
        notice = f"left {k} {status}\n".encode()
        for j, sock in self._socks.items():
            if j != k and j not in self._eof:
                try:
                    sock.send(notice)
                except OSError:  # a full buffer (nobody reads) or a rank that just closed it
                    pass
        joining = sorted(j for j in self._entered if j not in self._status)
        if status == 0 and joining:  # a non-zero status is reported as a failure anyway
            self._say(f"linkwise launch: rank {k} exited with status 0 without calling linkwise.init(), "
                      f"which rank(s) {', '.join(map(str, joining))} wait in; they are told to give up")

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()


# ---------------------------------------------------------------------------------- rank side
_link: Optional[socket.socket] = None
_opened = False
_left: dict[int, int] = {}  # rank -> exit status, as the launcher told
_partial = b""  # the start of a notice whose end has not been read yet


def _open() -> Optional[socket.socket]:
    """This process's end, checked (see the module docstring); None where there is none."""
    global _link, _opened
    if _opened:
        return _link
    _opened = True
    try:
        fd, pid = int(os.environ["LINKWISE_LAUNCH_FD"]), int(os.environ["LINKWISE_LAUNCH_PID"])
        fd = os.dup(fd)  # not inherited by what this process starts (the original may be)
    except (KeyError, ValueError, OSError):
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # not a socket
        os.close(fd)
        return None
    try:
        peer = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[0]
        if sock.family != socket.AF_UNIX or peer != pid:
            raise OSError("not the launcher's")
    except (OSError, AttributeError, struct.error):  # AttributeError: no SO_PEERCRED here
        sock.close()
        return None
    sock.setblocking(False)
    _link = sock
    return sock


def joining(rank: int) -> None:
    """init() of a `linkwise launch` rank starts to join: tell the launcher (once), and raise
    BootstrapError at once if a rank already left without joining."""
    sock = _open()
    if sock is None:
        return
    try:
        sock.send(b"I")
    except OSError:
        pass
    check(rank)


def check(rank: int) -> None:
    """Raise BootstrapError if the launcher said that a rank left without joining."""
    global _partial
    sock = _link
    while sock is not None:
        data = _read_ready(sock)
        if not data:  # None: nothing more for now; b"": the launcher is gone, it says nothing more
            break
        *lines, _partial = (_partial + data).split(b"\n")
        for line in lines:
            parts = line.decode(errors="replace").split()
            if len(parts) == 3 and parts[0] == "left" and parts[1].isdigit():
                _left.setdefault(int(parts[1]), int(parts[2]) if parts[2].lstrip("-").isdigit() else 0)
    others = sorted(k for k in _left if k != rank)
    if others:
        k = others[0]
        more = f" (and rank(s) {', '.join(map(str, others[1:]))})" if others[1:] else ""
        raise BootstrapError(
            f"rank {rank}: rank {k}{more} of this `linkwise launch` ended ({_describe(_left[k])}) without "
            f"calling linkwise.init(), so the job cannot form: every rank must call init()")


def _read_ready(sock: socket.socket) -> Optional[bytes]:
    """What a non-blocking socket has now: None if nothing yet, b"" at its end (or on an error,
    taken as the end), else the bytes."""
    try:
        return sock.recv(4096)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _describe(status: int) -> str:
    return f"exit status {status}" if status >= 0 else f"killed by signal {-status}"

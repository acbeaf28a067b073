"""Wiring a communicator's links at init: which peers share this host, shared-memory inboxes,
TCP sockets. Runs once per communicator, through the rendezvous store; nothing here is on the
data path.

Contract: on return every peer has exactly one link in the native engine. Shared-memory
inboxes are private segments (memfd) that peers open through the creator's /proc/<pid>/fd
while setup lasts; they never appear in /dev/shm, so nothing is left behind whatever happens
to the processes, and a container's small /dev/shm does not limit them.
"""
from __future__ import annotations

import json
import os
import secrets
import selectors
import socket
import struct
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from . import config, netif
from .errors import BootstrapError, PeerError

SHM_PREFIX = "linkwise-"
# A split's setup passes every function here a watch (_split_watch.MemberWatch): called between
# short slices of each wait, it raises PeerError when a member of the communicator being made
# died, since after init() the store no longer says so. None (init()): the store's own
# RankLeftError does.
Watch = Callable[[], None]


def shm_name(job_id: str, rank: int, comm_id: str = "") -> str:
    """Label of a rank's inbox (the memfd's name, seen in /proc/<pid>/maps)."""
    suffix = f"-{comm_id}" if comm_id else ""
    return f"/{SHM_PREFIX}{job_id}-{rank}{suffix}"


def host_identity() -> str:
    """Same string for processes that can share memory: host name, boot and IPC namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        ipc = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc = ""
    return f"{socket.gethostname()}|{boot}|{ipc}"


@dataclass
class PeerCard:
    rank: int
    host: str
    pid: int
    tcp: Optional[str] = None  # "ip:port" this rank listens on for TCP links
    cpus: str = ""  # hex bitmask of the CPUs this rank may run on ("" = unknown)
    transport: str = "auto"  # this rank's LINKWISE_TRANSPORT (ranks of one host must agree)
    error: str = ""  # this rank's first invalid LINKWISE_* setting (config.first_invalid)
    net_error: str = ""  # why this rank has no interface for TCP to other hosts ("" if it has)


def cpu_mask() -> int:
    """Bitmask of the CPUs this process may run on (its affinity; every CPU where that is unknown)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = range(os.cpu_count() or 1)
    return sum(1 << c for c in cpus)


def cpus_per_rank(cards: list[PeerCard], rank: int, ranks_here: int) -> float:
    """The CPUs this rank may count as its own: the distinct CPUs that the ranks on its host
    may use together, divided by ``ranks_here`` (at least the ranks on the host among
    ``cards``), and no more than the CPUs it may run on itself. Unbound ranks of one host
    share one mask (64 CPUs, 16 ranks: 4 each); ranks bound to disjoint slices (``linkwise
    launch --bind cpu``, ``mpirun --bind-to core``) keep their slice (4 each, not 4 / 16);
    ranks bound to overlapping CPUs share them. Below 1: more ranks than CPUs."""
    everything = (1 << (os.cpu_count() or 1)) - 1  # a card without a mask: any CPU of the host
    masks = [int(c.cpus, 16) if c.cpus else everything for c in cards if c.host == cards[rank].host]
    union = 0
    for m in masks:
        union |= m
    own = bin(int(cards[rank].cpus, 16) if cards[rank].cpus else everything).count("1")
    return min(float(own), bin(union).count("1") / max(1, ranks_here, len(masks)))


def own_card(rank: int) -> PeerCard:
    """This process's card (host, pid, CPU mask, and whether it has an interface for TCP to
    other hosts); the TCP address is filled in later."""
    error = config.first_invalid()
    return PeerCard(rank=rank, host=host_identity(), pid=os.getpid(), cpus=format(cpu_mask(), "x"),
                    transport="auto" if error else config.get("LINKWISE_TRANSPORT"), error=error,
                    net_error=interface_error())


def interface_error() -> str:
    """Why this rank could not choose an interface for TCP to other hosts (a
    LINKWISE_SOCKET_IFNAME that matches none, or no usable interface), else "". Checked before
    the cards are exchanged, so that every rank refuses it at once (refuse_bad_cards) instead of
    this rank alone when it opens its TCP listener, while the others wait for it."""
    try:
        with warnings.catch_warnings():  # the loopback-only warning is for when it is used
            warnings.simplefilter("ignore")
            netif.select_interface(config.get("LINKWISE_SOCKET_IFNAME") or None)
    except (BootstrapError, ValueError, OSError) as exc:
        return str(exc)
    return ""


def exchange_host_cards(store, tag: str, rank: int, size: int, watch: Optional[Watch] = None) -> list[PeerCard]:
    """Every rank's card, in rank order. ``watch``: see the module docstring."""
    return exchange_cards(store, f"{tag}/cards", rank, size, own_card(rank), watch)


def exchange_cards(store, tag: str, rank: int, size: int, card: PeerCard,
                   watch: Optional[Watch] = None) -> list[PeerCard]:
    raw = store.all_gather(tag, rank, size, json.dumps(card.__dict__).encode(), watch=watch)
    return [PeerCard(**json.loads(r)) for r in raw]


def refuse_bad_cards(store, tag: str, rank: int, size: int, cards: list[PeerCard], timeout: float,
                     watch: Optional[Watch] = None) -> None:
    """Raises on every rank when a card shows an invalid setting (ValueError on that rank,
    BootstrapError naming it on the others), a rank with peers on other hosts but no interface
    to reach them (BootstrapError everywhere, naming it), or ranks of one host that disagree on
    the transport. Rank 0 raises only once every rank has read the cards: its store closes as
    it does."""
    errors = [c.error for c in cards]  # in rank order
    # An interface matters only to a rank with a peer on another host (else TCP is loopback).
    net = [c.net_error if any(o.host != c.host for o in cards) else "" for c in cards]
    disagreement = transport_disagreement(cards)
    if not any(errors) and not any(net) and disagreement is None:
        return
    if size > 1:
        store.barrier(f"{tag}/refused-cards", size, timeout, watch)
    raise_for_refused_setting(rank, errors, "join")
    bad = next((r for r, e in enumerate(net) if e), None)
    if bad is not None:
        who = "" if bad == rank else f"rank {bad} has peers on other hosts but no interface for TCP to them: "
        raise BootstrapError(f"rank {rank}: {who}{net[bad]}")
    raise BootstrapError(f"rank {rank}: {disagreement}")


def raise_for_refused_setting(rank: int, errors: list[str], what: str) -> None:
    """errors: each rank's first invalid setting ("" if none), exchanged. The first rank with
    one raises ValueError; the others BootstrapError naming it (it could not `what`)."""
    bad = next((r for r, e in enumerate(errors) if e), None)
    if bad == rank:
        raise ValueError(f"rank {rank}: {errors[bad]}")
    if bad is not None:
        # LINKWISE_DEVICE (or device=) is each rank's own: the others are not told to copy it
        advice = (f"fix it on rank {bad}" if "LINKWISE_DEVICE" in errors[bad] or "device=" in errors[bad]
                  else "set it alike on every rank")
        raise BootstrapError(f"rank {rank}: rank {bad} could not {what}: {errors[bad]}; {advice}")


def transport_disagreement(cards: list[PeerCard]) -> Optional[str]:
    """Two ranks of one host that disagree on LINKWISE_TRANSPORT=tcp would each wait for a link
    of the other kind until the timeout. Every rank sees every card, so all find it."""
    for a in cards:
        for b in cards:
            if a.rank < b.rank and a.host == b.host and (a.transport == "tcp") != (b.transport == "tcp"):
                return (f"ranks {a.rank} and {b.rank} share a host but disagree on LINKWISE_TRANSPORT "
                        f"({a.transport!r} against {b.transport!r}); set it the same on every rank")
    return None


def choose_transports(cards: list[PeerCard], rank: int, forced: str) -> dict[int, str]:
    """'shm' for peers on this host (unless LINKWISE_TRANSPORT=tcp), else 'tcp'."""
    mine = cards[rank].host
    out = {}
    for c in cards:
        if c.rank == rank:
            continue
        same_host = c.host == mine
        if forced == "tcp" or not same_host:
            out[c.rank] = "tcp"
        else:
            out[c.rank] = "shm"
    if forced == "shm" and any(v == "tcp" for v in out.values()):
        far = sorted(r for r, v in out.items() if v == "tcp")
        raise BootstrapError(f"rank {rank}: LINKWISE_TRANSPORT=shm but ranks {far} are on other hosts")
    return out


def _handshake_bytes(job_id: str, rank: int) -> bytes:
    return struct.pack("!16si", job_id.encode()[:16].ljust(16, b"\0"), rank)


_HANDSHAKE = struct.calcsize("!16si")  # 20 bytes: job id (16, zero-padded) and rank
HANDSHAKE_WAIT = 30.0  # seconds an accepted connection has to send its handshake (peers send at once)
CHECK_EVERY = 0.2  # seconds between a waiting accept's checks for ranks that left setup
LEFT_WAIT = 0.5  # seconds a failed connect waits for the store to say the peer left setup


def accept_peers(listener: socket.socket, job_id: str, expected: list[int], deadline: float,
                 check: Optional[Callable[[], None]] = None) -> dict[int, socket.socket]:
    """Accept on ``listener`` until each rank of ``expected`` has connected and sent its
    handshake (job id and rank), or until ``deadline`` (time.monotonic()); returns
    {rank: socket} for those that did (a short result: the caller names the missing ranks).
    ``check`` (Store.raise_if_left; in a split, its watch) is called every CHECK_EVERY seconds
    of waiting; what it raises ends the wait (a rank that died during setup never connects).

    Contract: anything else that connects to the port (a port scanner, a health check, a
    process of another job) is closed and never stops or delays the peers: handshakes are read
    from every pending connection at once, a connection that closes before its 20 bytes, sends
    a wrong job id or rank, or stays silent for HANDSHAKE_WAIT seconds is dropped, and
    accepting goes on. No byte after the handshake is read (the engine gets the stream there)."""
    want = _handshake_bytes(job_id, 0)[:16]  # the job id as a peer sends it
    accepted: dict[int, socket.socket] = {}
    pending: dict[socket.socket, tuple[bytearray, float]] = {}  # conn -> (bytes so far, drop time)
    listener.setblocking(False)
    next_check = time.monotonic() + CHECK_EVERY if check is not None else float("inf")
    with selectors.DefaultSelector() as sel:
        sel.register(listener, selectors.EVENT_READ)
        try:
            while len(accepted) < len(expected):
                now = time.monotonic()
                if now >= deadline:
                    break
                if now >= next_check:
                    check()
                    next_check = time.monotonic() + CHECK_EVERY
                for conn, (_, drop_at) in list(pending.items()):
                    if now >= drop_at:  # silent too long: not a peer (peers send at once)
                        sel.unregister(conn)
                        del pending[conn]
                        conn.close()
                wake = min([deadline, next_check] + [t for _, t in pending.values()])
                for key, _ in sel.select(min(max(0.0, wake - now), 5.0)):  # epoll takes int ms
                    if key.fileobj is listener:
                        try:
                            conn, _ = listener.accept()
                        except (BlockingIOError, InterruptedError):
                            continue
                        conn.setblocking(False)
                        pending[conn] = (bytearray(), time.monotonic() + HANDSHAKE_WAIT)
                        sel.register(conn, selectors.EVENT_READ)
                        continue
                    conn = key.fileobj
                    data, drop_at = pending[conn]
                    try:
                        chunk = conn.recv(_HANDSHAKE - len(data))
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        chunk = b""
                    data += chunk
                    if chunk and len(data) < _HANDSHAKE:
                        continue
                    sel.unregister(conn)
                    del pending[conn]
                    job, peer = struct.unpack("!16si", data) if len(data) == _HANDSHAKE else (b"", -1)
                    if job != want or peer not in expected or peer in accepted:
                        conn.close()  # closed early, or not of this job: keep accepting
                        continue
                    accepted[peer] = conn
        finally:
            for conn in pending:
                conn.close()
    return accepted


def _connect_peer(rank: int, peer: int, host: str, port: int, timeout: float) -> socket.socket:
    """A connection to ``peer``'s TCP listener at host:port, or BootstrapError saying so."""
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:  # ConnectionRefusedError, socket.timeout, no route to host
        why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
        raise BootstrapError(
            f"rank {rank}: cannot connect to rank {peer} at {host}:{port} ({why}); rank {peer} "
            f"published that address from the interface it chose: check LINKWISE_SOCKET_IFNAME "
            f"on rank {peer} (it must name an interface this host can reach) and that no "
            f"firewall blocks TCP between the hosts") from None


def name_who_left(store, watch: Optional[Watch], wait: float = LEFT_WAIT) -> None:
    """After a failure that a peer's death explains (a refused connect, an inbox gone with its
    process): raises the error naming that peer if one is known to have died within ``wait``
    seconds, else returns (the caller raises its own). In init() the store knows
    (RankLeftError); in a split ``watch`` asks the parent's engine."""
    if watch is None:
        store.raise_if_left(wait)
        return
    deadline = time.monotonic() + wait
    while True:
        watch()
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def connect_tcp(native, store, tag: str, rank: int, size: int, job_id: str,
                tcp_peers: list[int], cards_host: list[PeerCard], timeout: float,
                watch: Optional[Watch] = None) -> None:
    """Full mesh among tcp_peers: a rank accepts from higher ranks and connects to lower ones."""
    all_remote_same_host = all(cards_host[p].host == cards_host[rank].host for p in tcp_peers)
    if all_remote_same_host:
        address = "127.0.0.1"
    else:
        address = netif.select_interface(config.get("LINKWISE_SOCKET_IFNAME") or None).address
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 0))
    listener.listen(max(8, size))
    port = listener.getsockname()[1]
    store.set(f"{tag}/tcp/{rank}", f"{address}:{port}".encode())

    higher = [p for p in tcp_peers if p > rank]
    lower = [p for p in tcp_peers if p < rank]
    accepted: dict[int, socket.socket] = {}
    errors: list[BaseException] = []
    deadline = time.monotonic() + timeout

    def accept_all() -> None:
        try:
            accepted.update(accept_peers(listener, job_id, higher, deadline, check=watch or store.raise_if_left))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    thread = threading.Thread(target=accept_all, name="linkwise-tcp-accept", daemon=True)
    thread.start()
    try:
        for peer in lower:
            host, _, p = store.get(f"{tag}/tcp/{peer}", watch=watch).decode().rpartition(":")
            try:
                sock = _connect_peer(rank, peer, host, int(p), timeout)
            except BootstrapError:
                name_who_left(store, watch)  # refused since the peer died: name it
                raise
            sock.sendall(_handshake_bytes(job_id, rank))
            sock.setblocking(False)
            native.adopt_tcp(peer, sock.detach())
        thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if errors and isinstance(errors[0], PeerError):  # a rank left setup (RankLeftError, StoreClosedError, watch)
            raise errors[0]
        if errors or thread.is_alive() or len(accepted) < len(higher):
            raise BootstrapError(f"rank {rank}: TCP links from ranks {sorted(set(higher) - set(accepted))} "
                                 f"did not arrive ({errors[0] if errors else 'timed out'}); check "
                                 "LINKWISE_SOCKET_IFNAME and firewalls")
        for peer, conn in accepted.items():
            conn.setblocking(False)
            native.adopt_tcp(peer, conn.detach())
    finally:
        listener.close()


def setup_links(native, store, tag: str, rank: int, size: int, job_id: str, timeout: float,
                cards: list[PeerCard], comm_id: str = "", watch: Optional[Watch] = None) -> dict[int, str]:
    """Connects every peer (``cards`` from :func:`exchange_host_cards` with the same tag, passed
    by :func:`refuse_bad_cards`); returns {peer: 'shm' | 'tcp'}. ``watch``: see the module
    docstring."""
    forced = config.get("LINKWISE_TRANSPORT")
    kinds = choose_transports(cards, rank, forced)
    shm_peers = [p for p, k in kinds.items() if k == "shm"]
    tcp_peers = [p for p, k in kinds.items() if k == "tcp"]
    if shm_peers:
        # A private segment (memfd): peers open it through /proc/<pid>/fd, so it never
        # appears in /dev/shm and cannot be left behind, whatever happens to the processes.
        native.create_shm_inbox(shm_name(job_id, rank, comm_id), config.get("LINKWISE_SHM_RING_SIZE"))
        try:
            store.set(f"{tag}/shm-name/{rank}", native.shm_inbox_name().encode())
            store.barrier(f"{tag}/shm-created", size, timeout, watch)
            for p in shm_peers:
                inbox = store.get(f"{tag}/shm-name/{p}", timeout, watch).decode()
                try:
                    native.connect_shm(p, inbox, cards[p].pid)
                except Exception:
                    name_who_left(store, watch)  # its inbox went with a peer that died: name it
                    raise
            store.barrier(f"{tag}/shm-connected", size, timeout, watch)
        finally:
            native.unlink_shm()
    else:
        # Every rank takes part in the barriers, with or without shared-memory peers.
        store.barrier(f"{tag}/shm-created", size, timeout, watch)
        store.barrier(f"{tag}/shm-connected", size, timeout, watch)
    if tcp_peers:
        connect_tcp(native, store, tag, rank, size, job_id, tcp_peers, cards, timeout, watch)
    store.barrier(f"{tag}/ready", size, timeout, watch)
    if config.get("LINKWISE_DEBUG"):
        import sys
        shown = ", ".join(f"{p}:{k}" for p, k in sorted(kinds.items())) or "none"
        print(f"linkwise: rank {rank}/{size} ({tag}) job {job_id}: links {shown}", file=sys.stderr, flush=True)
    return kinds


def new_job_id() -> str:
    return secrets.token_hex(6)

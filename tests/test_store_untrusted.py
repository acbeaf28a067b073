"""The rendezvous store facing what is not a linkwise client, and the edges of its inputs:
an HTTP probe or a huge length on its port (rank 0 allocated the length read from the wire:
GiBs for "GET "), a second process joining as a rank already joined, a host name that other
ranks resolve to IPv6 only (the server listened on IPv4 only), and timeouts too long for a
socket (OverflowError)."""
from __future__ import annotations

import socket
import struct
import time

import pytest

from linkwise.bootstrap import Store
from linkwise.errors import BootstrapError


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) // 1024


def _closed_by_server(sock: socket.socket, within: float = 3.0) -> bool:
    """True once the server closes ``sock`` (EOF) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        while True:
            if not sock.recv(4096):
                return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def _dropped_and_the_store_goes_on(talk) -> None:
    """A raw connection that says talk(sock) to a store is closed by it, without the store
    allocating much, and the store still serves its own clients."""
    with Store("127.0.0.1", 0, is_server=True, timeout=5, token="t") as store:
        before = _rss_mib()
        with socket.create_connection(("127.0.0.1", store.port)) as sock:
            talk(sock)
            assert _closed_by_server(sock)
        assert _rss_mib() - before < 64
        store.set("k", b"v")
        assert store.get("k", 1) == b"v"


def test_an_http_probe_is_dropped_without_allocating_its_length():
    _dropped_and_the_store_goes_on(  # "GET " reads as 1.2 GB
        lambda probe: probe.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))


def test_a_huge_frame_after_hello_is_dropped_and_the_store_goes_on():
    def talk(client):
        client.sendall(struct.pack("!IBI", 5, 5, 0))  # HELLO
        client.settimeout(3)
        (n,) = struct.unpack("!I", client.recv(4))
        assert client.recv(n) == b"\x00t"
        client.sendall(struct.pack("!I", 0xFFFFFFF0) + b"x" * 16)
    _dropped_and_the_store_goes_on(talk)


def test_a_value_over_the_request_cap_is_refused_by_the_client():
    from linkwise.store import MAX_REQUEST
    with Store("127.0.0.1", 0, is_server=True, timeout=5, token="t") as store:
        with pytest.raises(ValueError, match="more than the store takes"):
            store.set("big", bytes(MAX_REQUEST))
        store.set("k", b"v")  # the connection is intact
        assert store.get("k", 1) == b"v"


def test_a_second_join_of_one_rank_is_refused_naming_the_first():
    with Store("127.0.0.1", 0, is_server=True, timeout=5, token="t") as store:
        store.join(0, "pid 1 on a")
        with Store("127.0.0.1", store.port, is_server=False, timeout=5, token="t") as one, \
                Store("127.0.0.1", store.port, is_server=False, timeout=5, token="t") as other:
            one.join(1, "pid 2 on b")
            with pytest.raises(BootstrapError, match=r"already joined .* as rank 1 \(pid 2 on b;.*LINKWISE_JOB_ID"):
                other.join(1, "pid 3 on c")
            other.set("k", b"v")  # a refused join changes nothing else
            assert one.get("k", 1) == b"v"


def test_a_rank_whose_process_died_can_be_joined_again():
    """The join of a process that died (its store connection closed) no longer holds the
    rank: a process started in its place was refused at once while rank 0 waited for it
    until the timeout. The same process joining again (a retry) is taken too."""
    with Store("127.0.0.1", 0, is_server=True, timeout=5, token="t") as store:
        store.join(0, "pid 1 on a")
        store.join(0, "pid 1 on a")  # a retry by the same process
        gone = Store("127.0.0.1", store.port, is_server=False, timeout=5, token="t")
        gone.join(1, "pid 2 on b")
        gone.close()  # what the kernel does to the sockets of a process that died
        deadline = time.monotonic() + 5
        with Store("127.0.0.1", store.port, is_server=False, timeout=5, token="t") as fresh:
            while True:  # the server notices the closed connection a moment later
                try:
                    fresh.join(1, "pid 3 on b")
                    break
                except BootstrapError:
                    assert time.monotonic() < deadline, "the dead process's join still holds rank 1"
                    time.sleep(0.05)
            fresh.set("k", b"v")
            assert store.get("k", 1) == b"v"


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return socket.has_dualstack_ipv6()
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback or no dual-stack sockets here")
def test_a_host_name_master_is_reached_over_ipv4_and_ipv6():
    # A host name is not resolved by the server; other ranks may resolve it to IPv6 only.
    with Store("rank0.invalid", 0, is_server=True, timeout=5, token="t") as store:
        for client_host in ("::1", "127.0.0.1"):
            with Store(client_host, store.port, is_server=False, timeout=3, token="t") as client:
                client.set(client_host, b"here")
                assert store.get(client_host, 1) == b"here"


def test_timeouts_beyond_what_a_socket_takes_are_clamped():
    with Store("127.0.0.1", 0, is_server=True, timeout=1e10, token="t") as store:
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert store.get("k", timeout=1e12) == b"v"
        store.barrier("b", 1)
        t0 = time.monotonic()
        assert store.all_gather("g", 0, 1, b"x") == [b"x"]
        assert time.monotonic() - t0 < 5

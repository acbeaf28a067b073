"""Wiring TCP links at init against what goes wrong on a network: a stray connection to a
rank's listener (it ended the accept thread, or blocked it for the whole timeout), a peer
address that cannot be reached (a bare ConnectionRefusedError), and a rank whose
LINKWISE_SOCKET_IFNAME matches no interface (it failed alone; the others waited the timeout)."""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from multirank import free_port, run_ranks


def _patch_published_address(on_publish):
    """Calls on_publish(store, value) when this rank publishes its TCP listener's address,
    and publishes what it returns."""
    from linkwise import store as store_module
    plain_set = store_module.Store.set

    def set_(self, key, value):
        if "/setup/tcp/" in key:
            value = on_publish(value)
        plain_set(self, key, value)
    store_module.Store.set = set_


def _stray_on_rank_0(rank, n, mode):
    """The moment rank 0's listener is published, something connects to it and either closes
    at once or stays silent; the peers must still connect, well within the timeout."""
    import linkwise
    if rank == 0:
        held = []

        def stray(value):
            host, _, port = value.decode().rpartition(":")
            s = socket.create_connection((host, int(port)))
            s.close() if mode == "close" else held.append(s)
            return value
        _patch_published_address(stray)
    t0 = time.monotonic()
    comm = linkwise.init()
    seconds = time.monotonic() - t0
    x = np.ones(2)
    comm.all_reduce(x)
    comm.close()
    return float(x[0]), seconds < 5


@pytest.mark.parametrize("mode", ["close", "silent"])
def test_a_stray_connection_to_a_listener_does_not_stop_the_links(mode):
    out = run_ranks(3, _stray_on_rank_0, mode, init=False, timeout=60,
                    env={"LINKWISE_TRANSPORT": "tcp", "LINKWISE_TIMEOUT": "10"})
    assert out == [(3.0, True)] * 3


def _rank_0_unreachable(rank, n, dead_port):
    import linkwise
    if rank == 0:
        _patch_published_address(lambda value: f"127.0.0.1:{dead_port}".encode())
    try:
        linkwise.init()
        return "initialized"
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        return f"{type(exc).__name__}: {exc}"


def test_an_unreachable_peer_address_is_a_bootstrap_error_naming_it():
    dead_port = free_port()  # free a moment ago: nothing listens there
    out = run_ranks(2, _rank_0_unreachable, dead_port, init=False, timeout=60, expect_fail=True,
                    env={"LINKWISE_TRANSPORT": "tcp", "LINKWISE_TIMEOUT": "3"})
    kind, message = out[1]
    assert kind == "ok" and message.startswith("BootstrapError: rank 1: cannot connect to rank 0 at "
                                               f"127.0.0.1:{dead_port}"), out
    assert "LINKWISE_SOCKET_IFNAME" in message and "firewall" in message, out


def _bad_ifname_on_rank_1(rank, n, hosts):
    """Ranks on fake hosts (hosts[rank]); rank 1's LINKWISE_SOCKET_IFNAME matches nothing."""
    import linkwise
    from linkwise import _setup
    real = _setup.host_identity
    _setup.host_identity = lambda: f"{real()}|fake-host-{hosts[rank]}"
    if rank == 1:
        os.environ["LINKWISE_SOCKET_IFNAME"] = "=no-such-if9"
    t0 = time.monotonic()
    try:
        comm = linkwise.init()
    except linkwise.BootstrapError as exc:
        return "refused", str(exc), time.monotonic() - t0
    x = np.ones(2)
    comm.all_reduce(x)
    comm.close()
    return "ok", float(x[0]), time.monotonic() - t0


def test_an_ifname_matching_no_interface_fails_every_rank_at_once():
    out = run_ranks(3, _bad_ifname_on_rank_1, [0, 1, 2], init=False, timeout=90,
                    env={"LINKWISE_TRANSPORT": "tcp", "LINKWISE_TIMEOUT": "30"})
    for rank, (kind, message, seconds) in enumerate(out):
        assert kind == "refused" and "LINKWISE_SOCKET_IFNAME='=no-such-if9'" in message, out
        if rank != 1:
            assert "rank 1 has peers on other hosts but no interface" in message, out
        assert seconds < 10, out


def test_an_ifname_matching_no_interface_is_unused_on_one_host():
    # All ranks on one host talk over loopback: the setting is not used, as before.
    out = run_ranks(2, _bad_ifname_on_rank_1, [0, 0, 0], init=False, timeout=60,
                    env={"LINKWISE_TRANSPORT": "tcp", "LINKWISE_TIMEOUT": "10"})
    assert [o[:2] for o in out] == [("ok", 2.0)] * 2

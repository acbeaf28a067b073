"""A rank that dies (SIGKILL) during init(): the others raise at once, naming it and saying
it died or left during setup, whatever setup step they are in (store waits, accepting or
dialing TCP links, the shared-memory inbox exchange), also when the dead rank is rank 0,
which hosts the store. Before, a dead rank other than 0 cost the others LINKWISE_TIMEOUT and
a bare timeout; rank 0's death was seen at once only by ranks inside a store call, as the
store closing (ranks accepting TCP links waited the timeout). A rank whose setup is done
closing its store is not one that left. The victim kills itself at a chosen point by
wrapping one setup function in its own (forked) process, so the moment is exact."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from linkwise.bootstrap import Store
from linkwise.errors import BootstrapError, TimeoutError
from linkwise.store import RankLeftError
from multirank import run_ranks

SETUP_TIMEOUT = "60"  # LINKWISE_TIMEOUT: far longer than any survivor may take
PROMPT = 3.0  # seconds within which every survivor must have raised


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def die_linking(point: str) -> None:
    """SIGKILL this process at a TCP-link point of its next setup (init's or a split's, which
    share _setup): "dial-N" about to connect its link to rank N, "accept" accepting its links."""
    from linkwise import _setup
    if point == "accept":
        _setup.accept_peers = lambda *a, **k: _die()
        return
    target = int(point[len("dial-"):])
    plain_connect = _setup._connect_peer

    def connect(rank, peer, host, port, timeout):
        if peer == target:
            _die()
        return plain_connect(rank, peer, host, port, timeout)
    _setup._connect_peer = connect


def _die_at(point: str) -> None:
    """Makes this process SIGKILL itself at ``point`` of its setup."""
    from linkwise import _setup
    from linkwise import store as store_module
    if point == "cards":  # joined the store, before the cards are exchanged
        _setup.exchange_host_cards = lambda *a, **k: _die()
    elif point == "after-cards":  # every rank has joined: none is still looking for the store
        plain_exchange = _setup.exchange_host_cards

        def exchange(*args, **kwargs):
            plain_exchange(*args, **kwargs)
            _die()
        _setup.exchange_host_cards = exchange
    elif point == "shm-created":  # published its inbox and passed the first barrier
        plain = store_module.Store.barrier

        def barrier(self, name, *args, **kwargs):
            plain(self, name, *args, **kwargs)
            if name.endswith("/shm-created"):
                _die()
        store_module.Store.barrier = barrier
    elif point.startswith("dial-") or point == "accept":
        die_linking(point)
    else:
        raise AssertionError(point)


def _init_with_a_death(rank, n, victim, point):
    import linkwise
    if rank == victim:
        _die_at(point)
    t0 = time.monotonic()
    try:
        comm = linkwise.init()
    except linkwise.LinkwiseError as exc:
        return (type(exc).__name__, isinstance(exc, BootstrapError), getattr(exc, "peer", None), str(exc),
                time.monotonic() - t0)
    comm.close()
    return "initialized"


@pytest.mark.parametrize("victim, point, transport", [
    (2, "cards", "auto"),          # survivors wait for its card in the store
    (0, "after-cards", "auto"),    # the store's host: the survivors' store connection drops
    (1, "shm-created", "auto"),    # survivors open its inbox or wait at the next barrier
    (1, "dial-0", "tcp"),          # rank 2 dials it (refused), rank 0 accepts from it
    (2, "dial-1", "tcp"),          # rank 1 waits to accept its link (no store wait there)
    (0, "accept", "tcp"),          # rank 0 dies while the others connect to it
])
def test_a_rank_killed_during_setup_is_named_by_every_survivor_at_once(victim, point, transport):
    out = run_ranks(3, _init_with_a_death, victim, point, init=False, timeout=30, expect_fail=True,
                    env={"LINKWISE_TIMEOUT": SETUP_TIMEOUT, "LINKWISE_TRANSPORT": transport})
    assert out[victim][0] == "died", out
    for rank in set(range(3)) - {victim}:
        kind, value = out[rank]
        assert kind == "ok" and value != "initialized", (rank, out)
        name, is_bootstrap, peer, message, seconds = value
        assert is_bootstrap and peer == victim, (rank, out)
        assert name == ("StoreClosedError" if victim == 0 else "RankLeftError"), (rank, out)
        assert re.search(fr"rank {victim} (\(pid \d+ on .*\) )?died or left during setup", message), (rank, out)
        assert seconds < PROMPT, (rank, out)


def _bad_setting_late_on_rank_1(rank, n):
    """Rank 1's init() fails after the cards (a refused setting found only then, as an
    exception in its own setup would): it closes its store and lives on. The others name it
    at once; rank 0, whose own close then follows, names rank 1 too, not the closed store."""
    import linkwise
    from linkwise import _setup
    if rank == 1:
        def failing(*a, **k):
            raise ValueError("rank 1: a setting refused late")
        _setup.setup_links = failing
    t0 = time.monotonic()
    try:
        linkwise.init()
        return "initialized"
    except (ValueError, linkwise.LinkwiseError) as exc:
        seconds = time.monotonic() - t0
        time.sleep(1.0 if rank == 1 else 0.0)  # alive while the others raise
        return type(exc).__name__, getattr(exc, "peer", None), seconds


def test_a_rank_whose_init_fails_and_lives_on_is_named_as_left():
    out = run_ranks(3, _bad_setting_late_on_rank_1, init=False, timeout=30,
                    env={"LINKWISE_TIMEOUT": SETUP_TIMEOUT, "LINKWISE_TRANSPORT": "tcp"})
    assert out[1][0] == "ValueError", out
    for rank in (0, 2):
        assert out[rank][:2] == ("RankLeftError", 1) and out[rank][2] < PROMPT, out


def _three(timeout: float = 10.0):
    server = Store("127.0.0.1", 0, is_server=True, timeout=timeout, token="t")
    clients = [Store("127.0.0.1", server.port, is_server=False, timeout=timeout, token="t") for _ in range(2)]
    for rank, store in enumerate([server] + clients):
        store.join(rank, f"pid {100 + rank} on h")
    return server, clients


def _get_in_thread(store: Store, key: str, timeout: float) -> tuple[list, threading.Thread]:
    caught: list = []

    def wait():
        t0 = time.monotonic()
        try:
            store.get(key, timeout)
            caught.append(("got", time.monotonic() - t0))
        except Exception as exc:  # noqa: BLE001 - checked by the caller
            caught.append((exc, time.monotonic() - t0))
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return caught, t


def test_a_joined_rank_closing_before_it_settled_wakes_every_waiter():
    server, (one, two) = _three()
    try:
        caught, waiter = _get_in_thread(server, "never", 20)
        time.sleep(0.2)
        two.close()  # as the kernel does for a process that died
        waiter.join(5)
        exc, seconds = caught[0]
        assert isinstance(exc, RankLeftError) and isinstance(exc, BootstrapError), caught
        assert exc.peer == 2 and exc.rank == 0 and "pid 102 on h" in str(exc) and seconds < 2, caught
        with pytest.raises(RankLeftError, match="rank 2 .* died or left during setup"):
            one.barrier("later", 3, 20)  # later waits fail at once too
        with pytest.raises(RankLeftError):
            one.raise_if_left()
    finally:
        one.close()
        server.close()


def test_a_settled_rank_closing_is_not_leaving():
    server, (one, two) = _three()
    try:
        for store in (server, one, two):
            store.settled()
        two.close()  # done with setup, then gone: the engine's business, not the store's
        time.sleep(0.2)
        one.raise_if_left(0.2)
        with pytest.raises(TimeoutError):
            server.get("never", 0.3)
    finally:
        one.close()
        server.close()


def test_a_closing_host_with_ranks_still_setting_up_names_itself_to_them():
    """Rank 0 closes (its init() failed) while rank 1 waits: rank 1 hears that rank 0 left,
    before the store goes away; once every rank has left, the server closes without its
    linger (DRAIN)."""
    server, (one, two) = _three()
    caught, waiter = _get_in_thread(one, "never", 20)
    time.sleep(0.2)
    t0 = time.monotonic()
    closer = threading.Thread(target=server.close, daemon=True)
    closer.start()
    waiter.join(5)
    exc, _ = caught[0]
    assert isinstance(exc, RankLeftError) and exc.peer == 0, caught
    one.close()
    two.close()
    closer.join(5)
    assert not closer.is_alive() and time.monotonic() - t0 < 1.5
    with pytest.raises(BootstrapError):
        Store("127.0.0.1", server.port, is_server=False, timeout=0.3, token="t")


def _store_connections(comm):
    """This rank's store connections once every rank's init() returned, and on rank 0 how
    many its store serves; then a split, which still goes through the store."""
    comm.barrier()  # every rank has settled
    server = comm._store._server
    deadline = time.monotonic() + 3.0
    while server is not None and len(server._conns) > comm.size and time.monotonic() < deadline:
        time.sleep(0.02)  # the server's threads see the closed ones end
    counts = (len(comm._store._open), None if server is None else len(server._conns))
    sub = comm.split(0)
    sub.barrier()
    sub.close()
    return counts


def test_a_settled_rank_keeps_one_store_connection():
    """The joined connection is held apart during setup; once settled it is the pool's, and the
    pool's others close. Before, every rank kept two connections for the job's life and rank
    0's store a connection thread and a descriptor more per rank (1000 ranks: 1000 more)."""
    out = run_ranks(3, _store_connections, timeout=30, env={"LINKWISE_TRANSPORT": "tcp"})
    assert out == [(1, 3), (1, None), (1, None)], out
    server, (one, two) = _three()
    try:
        one.set("k", b"v")  # the pool has a connection of its own besides the joined one
        before = len(one._open)
        one.settled()
        assert (before, len(one._open)) == (2, 1) and one.get("k") == b"v"
    finally:
        for store in (two, one, server):
            store.close()

"""A member that dies (SIGKILL) while the others are inside comm.split(): they raise PeerError
naming it (as the parent numbers it) within a fraction of a second, whatever wait of the
split's setup each is in (the card exchange, the store barriers, opening shared-memory
inboxes, accepting or dialing TCP links), instead of after LINKWISE_TIMEOUT. Before, every
rank had settled in the store by then, so only the split's first exchange and the
shared-memory executor's steps noticed a death; the rest waited out the timeout. Members of
another colour finish their own split. As in test_setup_deaths, the victim kills itself at a
chosen point by wrapping one setup function in its own (forked) process; the split itself is
the code under test."""
from __future__ import annotations

import time

import pytest

from linkwise.errors import PeerError
from multirank import run_ranks
from test_setup_deaths import _die, die_linking

SPLIT_TIMEOUT = "60"  # LINKWISE_TIMEOUT: far longer than any survivor may take
PROMPT = 3.0  # seconds within which every survivor must have raised


def _die_at(point: str) -> None:
    """Makes this process SIGKILL itself at ``point`` of the next split's setup."""
    from linkwise import _setup
    from linkwise import store as store_module
    if point == "entry":  # before the split's first exchange
        from linkwise.comm import Communicator
        Communicator.split = lambda *a, **k: _die()
    elif point == "cards":  # joined the split's first exchange, dies before the new one's cards
        _setup.exchange_host_cards = lambda *a, **k: _die()
    elif point in ("shm-created", "ready"):  # after the inbox barrier / before the last barrier
        plain = store_module.Store.barrier

        def barrier(self, name, *args, **kwargs):
            if point == "ready" and name.endswith("/ready"):
                _die()
            plain(self, name, *args, **kwargs)
            if point == "shm-created" and name.endswith("/shm-created"):
                _die()
        store_module.Store.barrier = barrier
    elif point.startswith("dial-") or point == "accept":  # dial-N: rank N of the new one
        die_linking(point)
    elif point == "attach":  # links made: the shared-memory executor's first step
        from linkwise import _shm_exec
        _shm_exec.attach = lambda *a, **k: _die()
    else:
        raise AssertionError(point)


def _split_with_a_death(comm, victim, point, colors):
    comm.barrier()  # every rank's init() is done: the store no longer watches any of them
    if comm.rank == victim:
        _die_at(point)
    t0 = time.monotonic()
    try:
        sub = comm.split(colors[comm.rank])
    except Exception as exc:  # noqa: BLE001 - the kind is what is tested
        outcome = (type(exc).__name__, isinstance(exc, PeerError), getattr(exc, "peer", None), str(exc))
    else:
        total = sub.all_reduce(__import__("numpy").array([comm.rank + 1.0]))  # the new one works
        outcome = ("split", sub.size, float(total[0]))
        sub.close()
    seconds = time.monotonic() - t0
    # Alive while the others look: rank 0 hosts the store (they must meet the death, not the
    # store's end), and a survivor that left first could be the member another one names.
    time.sleep(1.5 if comm.rank == 0 else 1.0)
    return outcome, seconds


def _assert_named(out, rank, victim, new_rank):
    kind, ((name, is_peer_error, peer, message), seconds) = out[rank][0], out[rank][1]
    assert kind == "ok" and name == "PeerError" and is_peer_error and peer == victim, (rank, out)
    assert f"rank {victim} died or left during split" in message, (rank, out)
    assert f"it was to be rank {new_rank} of the new communicator" in message, (rank, out)
    assert seconds < PROMPT, (rank, out)


@pytest.mark.parametrize("victim, point, transport", [
    (2, "cards", "auto"),        # survivors wait for its card of the new communicator
    (1, "shm-created", "auto"),  # survivors open its inbox, or wait at the next barrier
    (2, "ready", "auto"),        # links made: survivors wait at the last barrier
    (1, "dial-0", "tcp"),        # rank 2 dials it (refused), rank 0 accepts from it
    (2, "dial-1", "tcp"),        # rank 1 waits to accept its link (no store wait there)
    (2, "accept", "tcp"),        # it dies while the others dial it
    (1, "attach", "auto"),       # survivors wait in the executor's first step (it watched already)
    (0, "cards", "tcp"),         # the store's host: the others' store connection drops
])
def test_a_member_killed_during_split_is_named_by_every_survivor_at_once(victim, point, transport):
    out = run_ranks(3, _split_with_a_death, victim, point, [0, 0, 0], timeout=30, expect_fail=True,
                    env={"LINKWISE_TIMEOUT": SPLIT_TIMEOUT, "LINKWISE_TRANSPORT": transport})
    assert out[victim][0] == "died", out
    for rank in set(range(3)) - {victim}:
        if victim == 0:  # the store went with it: StoreClosedError (or, seen first, the watch's PeerError)
            assert out[rank][0] == "ok", out
            (name, is_peer_error, peer, _), seconds = out[rank][1]
            assert name in ("StoreClosedError", "PeerError") and is_peer_error and peer == 0, out
            assert seconds < PROMPT, out
        else:
            _assert_named(out, rank, victim, victim)


def test_a_member_killed_before_the_split_over_tcp_is_named_at_once():
    """The split's first exchange asked the engine whether a TCP peer lived without reading its
    link, which alone shows the peer's end: the survivors waited out the timeout."""
    out = run_ranks(3, _split_with_a_death, 2, "entry", [0, 0, 0], timeout=30, expect_fail=True,
                    env={"LINKWISE_TIMEOUT": SPLIT_TIMEOUT, "LINKWISE_TRANSPORT": "tcp"})
    assert out[2][0] == "died", out
    for rank in (0, 1):
        assert out[rank][0] == "ok", out
        (name, is_peer_error, peer, _), seconds = out[rank][1]
        assert (name, is_peer_error, peer) == ("PeerError", True, 2) and seconds < PROMPT, out


@pytest.mark.parametrize("point, transport", [("cards", "auto"), ("shm-created", "auto"), ("attach", "auto"),
                                              ("accept", "tcp")])
def test_a_death_in_one_colour_leaves_the_other_colour_split(point, transport):
    """Colours {0, 2} and {1, 3}; rank 3 (rank 1 of its colour) dies in the new one's setup:
    rank 1 names it, ranks 0 and 2 get their communicator and reduce over it. In the executor's
    steps ("attach") the new communicator's own check named it rank 1 (its number there): the
    split names it as the communicator it was called on numbers it, as everywhere else."""
    out = run_ranks(4, _split_with_a_death, 3, point, [0, 1, 0, 1], timeout=30, expect_fail=True,
                    env={"LINKWISE_TIMEOUT": SPLIT_TIMEOUT, "LINKWISE_TRANSPORT": transport})
    assert out[3][0] == "died", out
    _assert_named(out, 1, 3, 1)
    for rank in (0, 2):
        assert out[rank][0] == "ok" and out[rank][1][0] == ("split", 2, 4.0), out


def test_a_watched_store_wait_counts_one_arrival_and_gives_up_when_told():
    """Store.barrier / get with a watch wait in slices: a barrier's later slices do not count the
    caller again (BARRIER_WAIT), and the watch's error ends a wait at its next slice."""
    import threading
    from linkwise.store import Store
    server = Store("127.0.0.1", 0, is_server=True, timeout=10, token="t")
    other = Store("127.0.0.1", server.port, is_server=False, timeout=10, token="t")
    try:
        looks = []
        late = threading.Timer(0.7, lambda: other.barrier("b", 2))
        late.start()
        server.barrier("b", 2, 10, watch=lambda: looks.append(1))  # slices of 0.25 s until it came
        late.join()
        assert len(looks) >= 2, looks

        def dead():
            raise PeerError("a member died", peer=5)
        for wait in (lambda: server.barrier("never", 2, 10, watch=dead),
                     lambda: server.get("never", 10, watch=dead)):
            t0 = time.monotonic()
            with pytest.raises(PeerError, match="a member died"):
                wait()
            assert time.monotonic() - t0 < 1.0
        other.set("k", b"v")
        assert server.get("k", 10, watch=dead) == b"v"  # satisfied at once: the watch is not asked
    finally:
        other.close()
        server.close()


def _late_survivor_sees_both_gone(comm, victim, early, transport):
    """The victim dies before the split's last barrier; survivor ``early`` gives up on it and
    exits at once; rank 0 reaches that barrier only once ``early`` too is gone."""
    if comm.rank == victim:
        _die_at("ready")
    elif comm.rank == 0:
        from linkwise import store as store_module
        plain = store_module.Store.barrier

        def barrier(self, name, *args, **kwargs):
            if name.endswith("/ready"):
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:  # until the early survivor has left
                    comm._native.poll()
                    if not comm._native.peer_alive(early):
                        break
                    time.sleep(0.02)
            plain(self, name, *args, **kwargs)
        store_module.Store.barrier = barrier
    comm.barrier()
    try:
        comm.split(0)
    except PeerError as exc:
        outcome = ("PeerError", exc.peer, str(exc))
    else:
        outcome = ("split",)
    return outcome, comm._native.peer_alive(early) if comm.rank == 0 else None


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_survivor_that_gave_up_and_left_first_is_not_named(transport):
    """Rank 2 dies in the split's setup; rank 1 raises PeerError naming it and exits; rank 0,
    in a later wait of the same setup, then finds both ranks 1 and 2 gone. It names rank 2,
    the one that died: before, it named rank 1 (the first gone in its order), a survivor that
    had only given up because of rank 2."""
    out = run_ranks(3, _late_survivor_sees_both_gone, 2, 1, transport, timeout=30, expect_fail=True,
                    env={"LINKWISE_TIMEOUT": SPLIT_TIMEOUT, "LINKWISE_TRANSPORT": transport})
    assert out[2][0] == "died", out
    assert out[1][0] == "ok" and out[1][1][0][:2] == ("PeerError", 2), out
    assert out[0][0] == "ok", out
    (kind, peer, message), early_alive = out[0][1]
    assert early_alive is False, out  # rank 0 did look only once rank 1 had left
    assert (kind, peer) == ("PeerError", 2), out
    assert "rank 2 died or left during split" in message and "rank 1 gave up because of it" in message, out

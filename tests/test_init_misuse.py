"""init() misused: a second world of the same job while the first is open, and ranks of one
host that disagree on LINKWISE_TRANSPORT. Both used to end in confusion: the second init's
clients joined the first world's open store, and the transport disagreement waited for the
whole timeout with messages about links, not about the setting."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from multirank import run_ranks


def _init_twice(rank, n):
    import linkwise
    first = linkwise.init()
    try:
        linkwise.init()
        second = "joined"
    except linkwise.BootstrapError as exc:
        second = "refused" if "init() was called again" in str(exc) else str(exc)
    x = np.ones(4, np.float32)
    first.all_reduce(x)  # the first world is untouched
    first.close()
    again = linkwise.init()  # once it is closed, a new world of the job may be made
    y = np.ones(2, np.float32)
    again.all_reduce(y)
    again.close()
    return second, float(x[0]), float(y[0])


def test_a_second_world_while_the_first_is_open_is_refused():
    assert run_ranks(2, _init_twice, init=False, timeout=60) == [("refused", 2.0, 2.0)] * 2


def _disagree(rank, n):
    import linkwise
    os.environ["LINKWISE_TRANSPORT"] = "tcp" if rank == 1 else "auto"
    t0 = time.monotonic()
    try:
        linkwise.init()
        return "initialized"
    except linkwise.BootstrapError as exc:
        return str(exc), time.monotonic() - t0


def test_ranks_that_disagree_on_the_transport_all_raise_at_once():
    out = run_ranks(3, _disagree, init=False, env={"LINKWISE_TIMEOUT": "30"}, timeout=60)
    for message, seconds in out:
        assert "disagree on LINKWISE_TRANSPORT" in message and "ranks 0 and 1" in message, message
        assert seconds < 10, seconds


def _bad_setting_on_one_rank(rank, n, name, value, who):
    import linkwise
    if rank == who:
        os.environ[name] = value
    t0 = time.monotonic()
    try:
        linkwise.init()
        return "initialized", 0.0
    except (ValueError, linkwise.BootstrapError) as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0


@pytest.mark.parametrize("name,value,who", [("LINKWISE_SPIN_US", "inf", 1), ("LINKWISE_TIMEOUT", "0", 0),
                                            ("LINKWISE_TRANSPORT", "udp", 2)])
def test_an_invalid_setting_on_one_rank_fails_every_rank_at_once(name, value, who):
    # Before, the rank with the bad value raised on its own (before or just after the card
    # exchange) and the others waited for it there until the timeout (30 s here).
    out = run_ranks(3, _bad_setting_on_one_rank, name, value, who, init=False,
                    env={"LINKWISE_TIMEOUT": "30"}, timeout=90)
    for rank, (message, seconds) in enumerate(out):
        if rank == who:
            assert message.startswith("ValueError") and f"{name}={value!r}" in message, out
        else:
            assert message.startswith("BootstrapError") and f"rank {who} could not join" in message, out
            assert name in message, out
        assert seconds < 10, out


def _next_world_before_rank_0_closed(rank, n):
    """The other ranks close their world and make the next one while rank 0 still has the
    first one (and its store) open: they must wait for the next store, not join the old one
    (which failed them when rank 0 closed it, and left rank 0 waiting in the next world)."""
    import linkwise
    first = linkwise.init()
    first.barrier()
    if rank == 0:
        time.sleep(1.5)
    first.close()
    again = linkwise.init()
    y = np.ones(2, np.float32)
    again.all_reduce(y)
    again.barrier()
    again.close()
    return float(y[0])


def test_the_next_world_waits_for_rank_0_to_close_the_previous_one():
    out = run_ranks(3, _next_world_before_rank_0_closed, init=False, env={"LINKWISE_TIMEOUT": "20"}, timeout=60)
    assert out == [3.0] * 3


def _dies_in_executor_setup(rank, size):
    """Rank 1 dies between the steps of the shared-memory executor's set-up, which init()
    now runs: the others raise PeerError naming it at once (a plain store barrier waited the
    whole timeout)."""
    import time

    import linkwise
    from linkwise import _shm_exec
    if rank == 1:
        first_step = _shm_exec._step

        def dying_step(comm, name):
            if name.endswith("/mapped"):
                os._exit(3)
            return first_step(comm, name)
        _shm_exec._step = dying_step
    t0 = time.monotonic()
    try:
        linkwise.init()
        return "returned", time.monotonic() - t0
    except linkwise.PeerError as exc:
        seconds = time.monotonic() - t0
        return (type(exc).__name__, exc.peer), seconds


def test_a_rank_dying_in_the_executor_setup_is_named_at_once():
    out = run_ranks(3, _dies_in_executor_setup, init=False, env={"LINKWISE_TIMEOUT": "30"}, timeout=90,
                    expect_fail=True)
    assert out[1][0] == "died", out
    # Named by the store (RankLeftError: its connection closed before its setup was done) or
    # by the engine (PeerError). Rank 2 names rank 1 too, not rank 0, whose failed init closed
    # the store it hosts: a closing store first tells the ranks still setting up who left.
    named = (("RankLeftError", 1), ("PeerError", 1))
    for rank in (0, 2):
        assert out[rank][0] == "ok" and out[rank][1][0] in named and out[rank][1][1] < 10, out


def _bad_setting_at_split(comm):
    import linkwise
    if comm.rank == 1:
        os.environ["LINKWISE_COLL_THREADS"] = "many"
    t0 = time.monotonic()
    try:
        comm.split(0)
        outcome = "split"
    except (ValueError, linkwise.BootstrapError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    os.environ.pop("LINKWISE_COLL_THREADS", None)
    x = np.ones(3, np.float32)
    comm.all_reduce(x)  # the parent communicator is untouched
    return outcome, seconds, float(x[0])


def test_an_invalid_setting_on_one_rank_fails_a_split_on_every_rank():
    out = run_ranks(3, _bad_setting_at_split, env={"LINKWISE_TIMEOUT": "30"}, timeout=90)
    for rank, (outcome, seconds, total) in enumerate(out):
        expected = "ValueError: rank 1: LINKWISE_COLL_THREADS" if rank == 1 else "BootstrapError"
        assert outcome.startswith(expected) and seconds < 10 and total == 3.0, out


def test_init_is_still_importable_from_linkwise_comm():
    """init() moved to linkwise._world; code that imported it from linkwise.comm still works."""
    import linkwise
    from linkwise.comm import init
    assert init is linkwise.init
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        from linkwise import comm
        comm.nothing_here


def test_a_per_rank_device_setting_is_not_to_be_set_alike():
    """The others' error told them to set LINKWISE_DEVICE "alike on every rank": it is each
    rank's own."""
    from linkwise._setup import raise_for_refused_setting
    from linkwise.errors import BootstrapError
    device = "LINKWISE_DEVICE=7 is out of range: 1 CUDA device is visible"
    with pytest.raises(BootstrapError, match="fix it on rank 1$"):
        raise_for_refused_setting(0, ["", device], "make the GPU plane")
    with pytest.raises(ValueError, match="rank 1: LINKWISE_DEVICE=7"):
        raise_for_refused_setting(1, ["", device], "make the GPU plane")
    with pytest.raises(BootstrapError, match="set it alike on every rank$"):
        raise_for_refused_setting(0, ["", "LINKWISE_CHUNK_SIZE='x' is not a size"], "set up")

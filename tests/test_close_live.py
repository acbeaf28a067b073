"""A rank that closes its communicator and goes on living: its peers raise PeerError naming
it as soon as they wait on it, over shared memory as over TCP. Over shared memory they used
to learn of it only when its process exited, or at the timeout (the links stayed open and
the executor watched the process only)."""
import os
import time

import numpy as np
import pytest

from multirank import run_ranks

TIMEOUT = 30  # what a peer would wait without the fix; every assertion below is far under it


def _wait_for_peers(tmp, comm_size, me):
    """The closed rank stays alive until the others are done (files, not the communicator)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(tmp, f"done-{r}")) for r in range(comm_size) if r != me):
            return
        time.sleep(0.05)


def _closes_then_lives(comm, tmp, op):
    import linkwise
    comm.all_reduce(np.ones(64, np.float32))  # sets up the links and (shared memory) the executor
    if comm.rank == 1:
        time.sleep(0.3)  # the others are waiting on this rank by now
        comm.close()
        _wait_for_peers(tmp, comm.size, 1)
        return "closed"
    t0 = time.monotonic()
    try:
        if op == "recv":
            comm.recv(np.empty(4), 1, tag=5)
        elif op == "all_reduce":
            comm.all_reduce(np.ones(1000, np.float32))
        elif op == "all_reduce_large":
            comm.all_reduce(np.ones(1 << 20, np.float32))
        else:
            comm.broadcast(np.zeros(1000), root=1)
        what = "returned"
    except linkwise.PeerError as exc:
        assert exc.rank == comm.rank, exc.rank  # the caller's rank (was -1 from the native layer)
        what = ("PeerError", exc.peer)
    except Exception as exc:  # noqa: BLE001 - the kind is what is tested
        what = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - t0
    try:  # and every later call, naming the same rank
        comm.all_reduce(np.ones(8, np.float32))
        later = "returned"
    except linkwise.PeerError as exc:
        later = ("PeerError", exc.peer)
    except Exception as exc:  # noqa: BLE001
        later = (type(exc).__name__, str(exc))
    open(os.path.join(tmp, f"done-{comm.rank}"), "w").close()
    return what, later, elapsed


@pytest.mark.parametrize("op", ["recv", "all_reduce", "all_reduce_large", "broadcast"])
def test_peers_of_a_closed_rank_raise_peer_error_at_once(op, transport_env, tmp_path):
    env = dict(transport_env, LINKWISE_TIMEOUT=str(TIMEOUT))
    out = run_ranks(3, _closes_then_lives, str(tmp_path), op, env=env, timeout=2 * TIMEOUT + 30)
    assert out[1] == "closed"
    for rank in (0, 2):
        what, later, elapsed = out[rank]
        assert what == later == ("PeerError", 1), (rank, what, later)
        assert elapsed < 10, (rank, elapsed)  # was: until rank 1 exited, or the timeout


def _closes_with_a_call_pending(comm, tmp):
    """Rank 1 closes with async all_reduces its peers have not joined yet: its requests say
    the communicator was closed, and the peers' next call raises PeerError naming rank 1 with
    what happened (it said 'a collective failed on rank 1')."""
    import linkwise
    comm.all_reduce(np.ones(64, np.float32))
    if comm.rank == 1:
        reqs = [comm.all_reduce(np.ones(1000, np.float32), async_op=True) for _ in range(2)]
        time.sleep(0.3)
        comm.close()
        errors = []
        for req in reqs:
            with pytest.raises(linkwise.CommAbortedError) as info:
                req.wait(timeout=TIMEOUT)
            errors.append(str(info.value))
        _wait_for_peers(tmp, comm.size, 1)
        return errors
    time.sleep(1.0)  # rank 1 has closed
    t0 = time.monotonic()
    with pytest.raises(linkwise.PeerError) as info:
        comm.all_reduce(np.ones(1000, np.float32))
    elapsed = time.monotonic() - t0
    open(os.path.join(tmp, f"done-{comm.rank}"), "w").close()
    return info.value.peer, str(info.value), elapsed


def test_close_with_async_collectives_pending_names_the_close(tmp_path):
    env = {"LINKWISE_TIMEOUT": str(TIMEOUT)}
    out = run_ranks(3, _closes_with_a_call_pending, str(tmp_path), env=env, timeout=2 * TIMEOUT + 30)
    assert all("closed" in e for e in out[1]), out[1]
    for rank in (0, 2):
        peer, message, elapsed = out[rank]
        assert peer == 1 and "closed its communicator" in message, (rank, message)
        assert elapsed < 10, (rank, elapsed)


def _close_from_another_thread(comm, tmp):
    """Rank 0 closes while another of its threads waits in an all_reduce its peer has not
    joined: that call raises CommAbortedError at once (it waited for the peer, then the
    timeout), and the peer's all_reduce raises PeerError naming rank 0."""
    import threading

    import linkwise
    comm.barrier()
    if comm.rank == 0:
        got = {}

        def work():
            t0 = time.monotonic()
            try:
                comm.all_reduce(np.ones(10))
                got["what"] = "returned"
            except linkwise.CommAbortedError:
                got["what"] = "CommAbortedError"
            got["seconds"] = time.monotonic() - t0
        thread = threading.Thread(target=work)
        thread.start()
        time.sleep(0.5)
        comm.close()
        thread.join(TIMEOUT)
        open(os.path.join(tmp, "done-0"), "w").close()
        _wait_for_peers(tmp, comm.size, 0)
        return got["what"], got["seconds"] < 5
    _wait_for_peers(tmp, comm.size, 1)  # rank 0 has closed
    with pytest.raises(linkwise.PeerError) as info:
        comm.all_reduce(np.ones(10))
    open(os.path.join(tmp, "done-1"), "w").close()
    return info.value.peer


def test_close_from_another_thread_stops_a_waiting_collective(tmp_path):
    out = run_ranks(2, _close_from_another_thread, str(tmp_path), env={"LINKWISE_TIMEOUT": str(TIMEOUT)},
                    timeout=2 * TIMEOUT + 30)
    assert out == [("CommAbortedError", True), 0], out

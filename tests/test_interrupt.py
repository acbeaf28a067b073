"""Ctrl-C (SIGINT) while a call waits must interrupt it within a fraction of a second, as it
would interrupt Python code, instead of being held until the call's timeout (300 s by
default): blocking receives, request waits, collectives in the shared-memory executor and
over messages, and async collectives' waits. The exception is the one the signal handler
raised (KeyboardInterrupt by default, any other for a handler of the user's). A receive that
was interrupted before any data moved is withdrawn: the communicator goes on. A collective that
was interrupted stops the communicator's collectives, as any failed collective does.
"""
import signal
import threading
import time

import numpy as np
import pytest

from multirank import run_ranks

PROMPT = 1.5  # seconds from the signal to the exception (the waits check every ~0.1 s)


class Alarm(Exception):
    pass


def _interrupt_soon(how):
    """Sends this process SIGINT (or, for "handler", SIGALRM to a handler that raises Alarm)
    in 0.4 s; returns when it will be sent."""
    import os
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if how == "handler":
        def alarm(signum, frame):
            raise Alarm("from the user's handler")
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.4)
    else:
        threading.Timer(0.4, os.kill, (os.getpid(), signal.SIGINT)).start()
    return time.monotonic() + 0.4


def _outcome(call, at):
    try:
        call()
        return "returned", 0.0
    except (KeyboardInterrupt, Alarm) as exc:
        return type(exc).__name__, time.monotonic() - at


def _p2p(comm, form, how):
    """Rank 1 waits for a message rank 0 sends only 2.5 s later; rank 1 is interrupted, then
    receives it (the interrupted receive was withdrawn, so the message is not lost)."""
    x = np.zeros(1000, np.float32)
    if comm.rank == 0:
        time.sleep(2.5)
        comm.send(np.arange(1000, dtype=np.float32), 1)
        return None
    at = _interrupt_soon(how)
    if form == "recv":
        got = _outcome(lambda: comm.recv(x, 0), at)
    else:
        req = comm.irecv(x, 0)
        got = _outcome(req.wait, at)
    comm.recv(x, 0)
    return got, bool(np.array_equal(x, np.arange(1000, dtype=np.float32)))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("form,how", [("recv", "sigint"), ("irecv", "sigint"), ("recv", "handler")])
def test_an_interrupted_receive_raises_and_is_withdrawn(form, how, transport):
    env = {"LINKWISE_TIMEOUT": "30", "LINKWISE_TRANSPORT": transport}
    out = run_ranks(2, _p2p, form, how, env=env, timeout=60)
    (kind, seconds), data_ok = out[1]
    assert kind == ("Alarm" if how == "handler" else "KeyboardInterrupt"), out
    assert seconds < PROMPT, out
    assert data_ok, out


def _collective(comm, path):
    """Rank 1 enters an all_reduce that rank 0 joins only 2.5 s later; rank 1 is interrupted.
    Then rank 0's later calls raise (the collectives stopped); its call of rank 1's
    all_reduce may complete first where rank 1 had sent its part already (over messages:
    the abort notice follows it), and then with the right sum. After an interrupted async
    wait nothing is checked: only the wait was interrupted, and the collective, left running
    as after the wait's timeout, may still complete with rank 0's call."""
    import linkwise
    if path != "setup":
        comm.all_reduce(np.ones(4, np.float32))
    x = np.ones(300_000 if path == "large" else 8, np.float32)
    got = None
    if comm.rank == 1:
        at = _interrupt_soon("sigint")
        if path == "async":
            req = comm.all_reduce(x, async_op=True)
            got = _outcome(req.wait, at)
        else:
            got = _outcome(lambda: comm.all_reduce(x), at)
    else:
        time.sleep(2.5)
    later = []
    for call in ([lambda: comm.all_reduce(x)] if comm.rank == 0 else []) + [lambda: comm.all_reduce(np.ones(4, np.float32))]:
        try:
            call()
            later.append("ok" if np.all(x == 2.0) else "WRONG")
        except (linkwise.CommAbortedError, linkwise.PeerError) as exc:
            later.append(type(exc).__name__)
    return got, later


@pytest.mark.parametrize("path,env", [("executor", {}), ("large", {}), ("large", {"LINKWISE_COLL_THREADS": "2"}),
                                      ("async", {}),
                                      ("messages", {"LINKWISE_ALGO": "ring"}),
                                      ("tcp", {"LINKWISE_TRANSPORT": "tcp"})])
def test_an_interrupted_collective_raises_and_stops_the_collectives(path, env):
    out = run_ranks(2, _collective, path, env={"LINKWISE_TIMEOUT": "30", **env}, timeout=90)
    kind, seconds = out[1][0]
    assert kind == "KeyboardInterrupt", out
    assert seconds < PROMPT, out
    if path != "async":
        assert out[0][1][0] in ("ok", "CommAbortedError", "PeerError"), out  # rank 1's abandoned call
        assert out[0][1][1] in ("CommAbortedError", "PeerError"), out
        assert out[1][1] == [out[1][1][0]] and out[1][1][0] in ("CommAbortedError", "PeerError"), out

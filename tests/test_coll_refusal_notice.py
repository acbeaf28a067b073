"""A collective whose arguments one rank refuses (an argument error, before any data moves)
must not leave the ranks that entered it waiting for that rank until the timeout: they raise
within a fraction of a second, whatever path the call took (the shared-memory executor, its
setup on the first call, or messages over shared memory or TCP). Before, they waited until
the refusing rank's next collective met their pending one, or, with none, for the whole
timeout (300 s by default).

Here the refusing rank sleeps 1.5 s after its refusal before its next call, and the others
must have raised within 1.2 s of entering theirs (the executor's check takes ~0.1 s).
"""
import time

import numpy as np
import pytest

from multirank import run_ranks

SLEEP = 1.5  # the refusing rank's pause before its next call
PROMPT = 1.2  # the others raise within this (they used to wait past SLEEP)


def _refuse_on_rank_0(comm, case, attach, read_first):
    """Rank 0 refuses `case` (an out of one element too many); the others call it rightly.
    attach: run an all_reduce first, so the executor is set up (where it is used at all).
    read_first: ranks 1 and 2 exchange a message before their call, so the refusal notice
    may already be read when they post their receives. Returns (outcome, seconds in the
    call, the next all_reduce's outcome)."""
    import linkwise
    if attach:
        comm.all_reduce(np.ones(4, np.float32))
    n = 1000
    bad = comm.rank == 0
    out_elems = {"broadcast": n, "all_reduce": n, "scatter": n, "all_gather": n * comm.size}[case] + bad
    out = np.zeros(out_elems, np.float32)
    x = np.full(n * comm.size if case == "scatter" else n, 1.0 + comm.rank, np.float32)
    if read_first and not bad:
        time.sleep(0.3)  # rank 0's notice is on its way
        peer = 3 - comm.rank
        comm.sendrecv(np.ones(2, np.float32), peer, np.zeros(2, np.float32), peer)
    t0 = time.monotonic()
    try:
        if case == "broadcast":
            comm.broadcast(x, root=0, out=out)
        elif case == "scatter":
            comm.scatter(x, root=0, out=out)
        elif case == "all_reduce":
            comm.all_reduce(x, out=out)
        else:
            comm.all_gather(x, out=out)
        first = "ok"
    except (ValueError, linkwise.CommAbortedError, linkwise.PeerError) as exc:
        first = type(exc).__name__
    seconds = time.monotonic() - t0
    if bad:
        time.sleep(SLEEP)
    try:
        y = np.ones(4, np.float32)
        comm.all_reduce(y)
        later = float(y[0])
    except (ValueError, linkwise.CommAbortedError, linkwise.PeerError, linkwise.TimeoutError) as exc:
        later = type(exc).__name__
    return first, seconds, later


PATHS = {
    "executor": ({}, True),
    "executor setup": ({}, False),
    "messages over shm": ({"LINKWISE_ALGO": "ring"}, True),
    "messages over tcp": ({"LINKWISE_TRANSPORT": "tcp"}, True),
}


# The setup step is the same for every collective: broadcast covers it.
CALLS = [(path, case) for path in PATHS for case in ("broadcast", "all_reduce", "scatter", "all_gather")
         if path != "executor setup" or case == "broadcast"]


@pytest.mark.parametrize("path,case", CALLS)
def test_the_others_raise_at_once_when_one_rank_refuses(path, case):
    env, attach = PATHS[path]
    out = run_ranks(3, _refuse_on_rank_0, case, attach, False, env={"LINKWISE_TIMEOUT": "30", **env}, timeout=90)
    assert out[0][0] == "ValueError", out
    for first, seconds, _ in out[1:]:
        # ValueError where a rank saw the refusal itself, else the notice of a rank that did
        assert first in ("ValueError", "CommAbortedError", "PeerError"), out
        assert seconds < PROMPT, out
    for _, _, later in out:
        assert isinstance(later, str), out  # never a sum: the ranks are out of step


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_refusal_read_before_the_receive_is_posted(transport):
    env = {"LINKWISE_TIMEOUT": "30", "LINKWISE_ALGO": "ring", "LINKWISE_TRANSPORT": transport}
    out = run_ranks(3, _refuse_on_rank_0, "broadcast", True, True, env=env, timeout=90)
    assert out[0][0] == "ValueError", out
    for first, seconds, _ in out[1:]:
        assert first in ("ValueError", "CommAbortedError", "PeerError"), out
        assert seconds < PROMPT, out


def _refused_everywhere_then_sums(comm, refusals):
    """Every rank refuses `refusals` calls (each sends refusal notices, which nobody's
    receives match), then all_reduce and broadcast must still pair up."""
    for i in range(refusals):
        try:
            comm.broadcast(np.ones(8, np.float32), root=i % comm.size, out=np.zeros(9, np.float32))
        except ValueError:
            pass
    y = np.full(5000, comm.rank + 1.0, np.float32)
    comm.all_reduce(y)
    b = np.full(3, 7.0 if comm.rank == 1 else 0.0, np.float32)
    comm.broadcast(b, root=1)
    return float(y[0]), b.tolist()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_refusals_on_every_rank_leave_the_calls_in_step(transport):
    env = {"LINKWISE_TIMEOUT": "30", "LINKWISE_TRANSPORT": transport}
    # 70 refusals: more than the 64 a peer's engine keeps (the oldest are dropped)
    out = run_ranks(3, _refused_everywhere_then_sums, 70, env=env, timeout=90)
    assert out == [(6.0, [7.0, 7.0, 7.0])] * 3, out


# The rank that passes None: one the others wait for (the root of a broadcast; a non-root
# of a reduce or gather, whose root waits for it; any of the rest).
NONE_CASES = {"all_reduce op": 0, "reduce_scatter op": 0, "reduce root": 1, "broadcast root": 0,
              "gather root": 1, "all_gather x": 0}


def _none_on_one_rank(comm, case):
    """One rank passes None for an argument of a call the latency path serves (the executor
    attached by a first all_reduce); the others call it rightly. Before, nanobind refused the
    None in the native entry's signature (a TypeError listing its overloads), the call was
    not numbered as refused, and the others waited for that rank's next collective."""
    import linkwise
    comm.all_reduce(np.ones(4, np.float32))
    n, bad = comm.size, comm.rank == NONE_CASES[case]
    x = np.ones(8, np.float32)
    calls = {"all_reduce op": lambda: comm.all_reduce(x, op=None if bad else "sum"),
             "reduce_scatter op": lambda: comm.reduce_scatter(np.ones(8 * n, np.float32), op=None if bad else "sum"),
             "reduce root": lambda: comm.reduce(x, root=None if bad else 0),
             "broadcast root": lambda: comm.broadcast(x, root=None if bad else 0),
             "gather root": lambda: comm.gather(x, root=None if bad else 0),
             "all_gather x": lambda: comm.all_gather(None if bad else x)}
    t0 = time.monotonic()
    try:
        calls[case]()
        first = "ok"
    except (ValueError, TypeError, linkwise.CommAbortedError, linkwise.PeerError) as exc:
        first = type(exc).__name__ + ("" if "incompatible function arguments" not in str(exc) else " (nanobind's)")
    seconds = time.monotonic() - t0
    if bad:
        time.sleep(NONE_SLEEP)
    return first, seconds


NONE_SLEEP, NONE_PROMPT = 4.0, 2.5  # wider than SLEEP / PROMPT: six cases of three ranks


@pytest.mark.parametrize("case", NONE_CASES)
def test_a_none_argument_on_the_latency_path_is_refused_as_any_bad_one(case):
    bad = NONE_CASES[case]
    out = run_ranks(3, _none_on_one_rank, case, env={"LINKWISE_TIMEOUT": "30"}, timeout=90)
    assert out[bad][0] in ("ValueError", "TypeError"), out  # the general path's own message
    waiting = [0] if case in ("reduce root", "gather root") else [r for r in range(3) if r != bad]
    for first, seconds in (out[r] for r in waiting):  # a reduce's other non-root may return
        assert first in ("ValueError", "TypeError", "CommAbortedError", "PeerError"), out
        assert seconds < NONE_PROMPT, out

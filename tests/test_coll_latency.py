"""The small all_reduce's two steps (ShmColl::all_reduce_start / all_reduce_finish): the call
starts with the GIL held and completes at once when the peers are already there, else it
releases the GIL and waits. Checked against the NumPy reference with a peer that is late
(the waiting path) and on time (the immediate path), in place and out=, and that another
Python thread of the waiting rank runs while it waits (the GIL is released)."""
import threading
import time

import numpy as np

from coll_ref import check_equal, data, reduce_ref
from multirank import run_ranks

CASES = [("float32", "sum", 1), ("float32", "max", 7), ("int64", "sum", 3), ("float64", "avg", 5),
         ("int32", "prod", 1000)]


def _body(comm, late_rank):
    n = comm.size
    for dt, op, count in CASES:
        ins = [data(r, count, dt, op, salt=5) for r in range(n)]
        want = reduce_ref(ins, op, dt)
        for in_place in (True, False):
            if comm.rank == late_rank:
                time.sleep(0.05)  # the others post first and wait without the GIL
            x = ins[comm.rank].copy()
            if in_place:
                comm.all_reduce(x, op=op)
                got = x
            else:
                got = np.full(count, 9, x.dtype)
                assert comm.all_reduce(x, op=op, out=got) is got
                check_equal(x, ins[comm.rank], "x untouched by all_reduce(out=)")
            check_equal(got, want, f"all_reduce {dt} {op} {count} in_place={in_place}",
                        avg_float=op == "avg")
    # Another thread of a waiting rank keeps running: the wait does not hold the GIL.
    ticks = [0]
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=tick)
    t.start()
    try:
        base = ticks[0]
        time.sleep(0.1)  # the other thread alone: its ticks in 0.1 s
        rate = ticks[0] - base
        comm.barrier()
        if comm.rank == late_rank:
            time.sleep(0.4)
        before = ticks[0]
        x = np.full(2, comm.rank + 1.0, np.float32)
        comm.all_reduce(x)
        during = ticks[0] - before
    finally:
        stop.set()
        t.join()
    check_equal(x, np.full(2, n * (n + 1) / 2, np.float32), "all_reduce after the late rank")
    return (during, rate) if comm.rank != late_rank else None


def _check_ran(got):
    # A waiting rank that kept the GIL would let the thread run for a switch interval or two
    # (~5-10 ms) of the ~0.4 s wait; releasing it gives the thread most of the wait.
    for during, rate in got:
        assert during > rate, f"the other thread ticked {during} times in a ~0.4 s wait, {rate} in 0.1 s alone"


def test_late_peer_two_ranks():
    _check_ran(run_ranks(2, _body, 1, timeout=120)[:1])


def test_late_peer_three_ranks():
    _check_ran(run_ranks(3, _body, 0, timeout=120)[1:])

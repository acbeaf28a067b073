"""Paths chosen by size: a large two-rank broadcast goes point-to-point as one message; the
out-of-place all_reduce latency path; the one-shot limit of the shared-memory all_reduce; all
against NumPy references."""
import os

import numpy as np
import pytest

from coll_ref import DTYPES, check_all_reduce_matrix, check_equal, data, np_dtype, reduce_ref
from multirank import run_ranks


def _large_pair_broadcast(comm):
    n = (9 << 20) // 4 + 3  # above LARGE_PAIR_BCAST, odd
    for root in (0, 1):
        ref = (np.arange(n, dtype=np.float32) * (root + 2)) % 1013
        x = ref.copy() if comm.rank == root else np.zeros(n, np.float32)
        comm.broadcast(x, root=root)
        np.testing.assert_array_equal(x, ref)
        out = np.full(n, -1, np.float32)
        src = ref if comm.rank == root else np.zeros(n, np.float32)
        comm.broadcast(src, root=root, out=out)
        np.testing.assert_array_equal(out, ref)
    return "ok"


def test_large_two_rank_broadcast(transport_env):
    assert run_ranks(2, _large_pair_broadcast, env=transport_env) == ["ok", "ok"]


def _out_of_place_all_reduce(comm):
    rng = np.random.default_rng(comm.rank)
    for dtype in (np.float32, np.int64, np.float64):
        for n in (1, 7, 1000, 300_001):
            x = (rng.integers(-50, 50, n)).astype(dtype)
            keep = x.copy()
            out = np.zeros(n, dtype)
            comm.all_reduce(x, out=out)
            everyone = [np.empty(n, dtype) for _ in range(comm.size)]
            for r in range(comm.size):
                buf = x.copy() if r == comm.rank else everyone[r]
                comm.broadcast(buf, root=r)
                everyone[r] = buf
            np.testing.assert_array_equal(out, np.sum(everyone, axis=0, dtype=dtype))
            np.testing.assert_array_equal(x, keep)  # the input is left alone
    with pytest.raises(ValueError, match="out must"):
        comm.all_reduce(np.ones(10, np.float32), out=np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="out must"):
        comm.all_reduce(np.ones(10, np.float32), out=np.zeros(10, np.float64))
    with pytest.raises(ValueError, match="out must be a float32 array of 10 elements, got int32"):
        comm.all_reduce(np.ones(10, np.float32), out=np.zeros(10, np.int32))  # same bytes, other dtype
    with pytest.raises(ValueError, match="out must"):
        comm.all_reduce(np.ones(10, np.float32), out=np.zeros(5, np.float64))
    # The latency path checks out's buffer natively: same errors, raised before any rank waits.
    ro = np.zeros(10, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(np.ones(10, np.float32), out=ro)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(np.ones(10, np.float32), out=np.zeros((10, 2), np.float32)[:, 0])
    out = np.zeros(10, np.float32)  # and the communicator still works afterwards
    comm.all_reduce(np.full(10, comm.rank + 1, np.float32), out=out)
    np.testing.assert_array_equal(out, np.full(10, comm.size * (comm.size + 1) / 2, np.float32))
    return "ok"


@pytest.mark.parametrize("nranks", [2, 3])
def test_out_of_place_all_reduce(nranks):
    assert run_ranks(nranks, _out_of_place_all_reduce) == ["ok"] * nranks


def _barrier_waits_for_the_last(comm, mixed_forms):
    import time
    if mixed_forms and comm.rank == 0:  # rank 0 alone uses the async form (allowed)
        comm.all_reduce(np.ones(4, np.float32), async_op=True).wait()
    elif mixed_forms:
        comm.all_reduce(np.ones(4, np.float32))
    waits = []
    for late in range(comm.size):  # each rank in turn arrives 0.2 s after the others
        if comm.rank == late:
            time.sleep(0.2)
        t0 = time.monotonic()
        if mixed_forms and comm.rank == 0 and late % 2:
            comm.barrier(async_op=True).wait()
        else:
            comm.barrier()
        waits.append(time.monotonic() - t0)
    return waits


@pytest.mark.parametrize("mixed_forms", [False, True])
@pytest.mark.parametrize("nranks", [2, 3])
def test_barrier_waits_for_the_last_rank(nranks, mixed_forms, transport_env):
    waits = run_ranks(nranks, _barrier_waits_for_the_last, mixed_forms, env=transport_env)
    for rank, row in enumerate(waits):
        for late, waited in enumerate(row):
            if rank != late:
                assert waited > 0.15, (rank, late, waited)


def _timeout_set_after_init(comm):
    import time

    import linkwise
    x = np.ones(4, np.float32)
    comm.all_reduce(x)  # attaches the shared-memory executor: later calls take the latency path
    if comm.rank == 1:
        time.sleep(4)  # never joins the next all_reduce
        return "idle"
    comm.timeout = 0.5  # set after init: the latency path must honour it, not the init value
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
    except linkwise.TimeoutError:
        return time.monotonic() - t0
    return "no timeout"


def test_latency_path_honours_a_timeout_set_after_init():
    out = run_ranks(2, _timeout_set_after_init, expect_fail=True, timeout=60)
    kind, waited = out[0]
    assert kind == "ok" and isinstance(waited, float) and waited < 3.0, out


def _one_shot_boundary(comm):
    # LINKWISE_COLL_ONE_SHOT_MAX, read as the executor is set up (when the communicator is
    # made): 256 on rank 0, 32K elsewhere; rank 0's limit wins everywhere.
    sizes = lambda dt, op: [0, 1, 7, 255 // np.dtype(np_dtype(dt)).itemsize + 1, 2049, 9001]
    checked = check_all_reduce_matrix(comm, DTYPES, sizes)
    # Async calls above the limit run two-shot on the worker thread.
    x = data(comm.rank, 3001, "float32", "sum")
    want = reduce_ref([data(r, 3001, "float32", "sum") for r in range(comm.size)], "sum", "float32")
    comm.all_reduce(x, async_op=True).wait()
    check_equal(x, want, "async float32 sum 3001")
    return checked, comm._shm.one_shot_max


@pytest.mark.parametrize("nranks", [3, 5])
def test_one_shot_limit_agreed_and_two_shot_below_32k(nranks):
    """Small all_reduces above the agreed one-shot limit take the two-shot, for every dtype and
    op, in place and out=, and asynchronously."""
    limits = ["256"] + ["32K"] * (nranks - 1)
    got = run_ranks(nranks, _one_shot_boundary, env={"LINKWISE_COLL_ONE_SHOT_MAX": limits}, timeout=240)
    assert all(limit == 256 and checked > 0 for checked, limit in got), got


def _off_on_some_ranks(comm, var, value):
    """Rank 0 alone sets var to a value that means the default (LINKWISE_CHECK=0, an empty
    LINKWISE_ALGO): every path must be the unset one's. barrier() looked only at whether the
    variable was set and went over messages on rank 0, through the executor on rank 1: both
    waited for the timeout."""
    if comm.rank == 0:
        os.environ[var] = value
    try:
        results = []
        for _ in range(2):
            comm.barrier()
            comm.barrier(async_op=True).wait()
            x = np.arange(5, dtype=np.float32) + comm.rank
            comm.all_reduce(x)
            results.append(x.tolist())
            y = np.arange(3.0) if comm.rank == 1 else np.zeros(3)
            comm.broadcast(y, root=1)
            results.append(y.tolist())
        return results
    finally:
        os.environ.pop(var, None)


@pytest.mark.parametrize("var,value", [("LINKWISE_CHECK", "0"), ("LINKWISE_CHECK", "off"), ("LINKWISE_ALGO", "")])
def test_a_variable_set_to_its_default_on_one_rank_changes_no_path(var, value):
    out = run_ranks(2, _off_on_some_ranks, var, value, env={"LINKWISE_TIMEOUT": "5"}, timeout=60)
    want = [[2.0 * i + 1 for i in range(5)], [0.0, 1.0, 2.0]] * 2
    assert out == [want, want]

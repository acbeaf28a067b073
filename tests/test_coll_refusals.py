"""Arguments that must be refused, and refusals that must not leave ranks out of step: object
arrays (their bytes are pointers; a receiver crashed), non-native byte order in reductions
(reduced as native before: garbage sums), a refusal on one rank under LINKWISE_CHECK and in
split() (the others waited for the timeout, or split paired with another call), and close()
with an async collective pending in the shared-memory executor (it completed after close).
Also an all_reduce out that partly overlaps x, which gave wrong sums over shared memory and
is now read from a staged copy of x."""
import time

import numpy as np
import pytest

from multirank import run_ranks


def _object_arrays(comm):
    out = []
    for call in (lambda x: comm.broadcast(x, root=0), lambda x: comm.all_gather(x),
                 lambda x: comm.all_to_all(x), lambda x: comm.send(x, 1 - comm.rank)):
        try:
            call(np.array(["a", "b"], dtype=object))
            out.append("accepted")
        except TypeError as exc:
            out.append("objects" in str(exc))
    x = np.ones(4, np.float32)
    comm.all_reduce(x)  # still in step
    return out, float(x[0])


def test_object_arrays_are_refused(transport_env):
    out = run_ranks(2, _object_arrays, env=transport_env)
    assert out == [([True] * 4, 2.0)] * 2, out


def _big_endian(comm):
    x = np.array([1.5, 200.0, 3.0], dtype=">f4")
    try:
        comm.all_reduce(x)
        first = "accepted"
    except TypeError as exc:
        first = "byte order" in str(exc)
    y = np.array([1, 2], dtype=">i4")
    comm.broadcast(y, root=1)  # bytes moved as they are: fine
    z = np.ones(3, np.float32)
    comm.all_reduce(z)
    return first, y.tolist(), float(z[0])


def test_non_native_byte_order_is_refused_in_reductions():
    assert run_ranks(3, _big_endian) == [(True, [1, 2], 3.0)] * 3


def _partial_overlap(comm, n, async_op):
    """out is x shifted by one element: every rank's inputs must be read as they were before
    the call (the shared-memory executor reads a staged copy of x; the message-based
    algorithms copy x into out first)."""
    buf = np.arange(n + 1, dtype=np.float32) * (comm.rank + 1)
    want = np.arange(n, dtype=np.float32) * sum(range(1, comm.size + 1))
    req = comm.all_reduce(buf[:n], out=buf[1:], async_op=async_op)
    if async_op:
        req.wait()
    x = np.ones(n, np.float32)
    comm.all_reduce(x, out=x[:])  # the same memory through another view: in place
    return int(np.count_nonzero(buf[1:] != want)), float(x.sum()) == comm.size * n


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("n", [5, 30_000, 300_000])
def test_all_reduce_out_partly_overlapping_x(n, async_op, transport_env):
    assert run_ranks(3, _partial_overlap, n, async_op, env=transport_env) == [(0, True)] * 3


def _one_rank_refuses_under_check(comm):
    import linkwise
    x = np.ones(2, np.int32)
    t0 = time.monotonic()
    try:
        comm.gather(x, root=0, out=np.empty(2 * comm.size - 1, np.int32) if comm.rank == 0 else None)
        first = "ok"
    except ValueError as exc:
        first = "refused" if comm.rank == 0 else ("disagree" in str(exc))
    except linkwise.TimeoutError:
        first = "timeout"
    seconds = time.monotonic() - t0
    y = np.ones(3, np.float32)
    comm.all_reduce(y)
    return first, seconds < 5, float(y[0])


def test_a_refusal_on_one_rank_raises_everywhere_under_check():
    out = run_ranks(3, _one_rank_refuses_under_check, env={"LINKWISE_CHECK": "1", "LINKWISE_TIMEOUT": "20"},
                    timeout=60)
    assert out == [("refused", True, 3.0), (True, True, 3.0), (True, True, 3.0)], out


def _split_refused_on_one_rank(comm, bad):
    t0 = time.monotonic()
    try:
        comm.split(bad if comm.rank == 0 else 0)
        first = "ok"
    except ValueError as exc:
        first = "refused" in str(exc)
    sub = comm.split(0, key=comm.size - comm.rank)  # the next split pairs with the next one
    return first, time.monotonic() - t0 < 5, sub.rank, sub.size


@pytest.mark.parametrize("bad", [-1, "red", True])
def test_split_refused_on_one_rank_raises_everywhere(bad):
    out = run_ranks(3, _split_refused_on_one_rank, bad, env={"LINKWISE_TIMEOUT": "20"}, timeout=60)
    assert out == [(True, True, 2, 3), (True, True, 1, 3), (True, True, 0, 3)], out


def _close_with_pending(comm):
    import linkwise
    sub = comm.split(0)
    sub.all_reduce(np.ones(2, np.float32))  # the executor is attached
    if comm.rank == 0:
        req = sub.all_reduce(np.ones(2, np.float32), async_op=True)
        sub.close()
        try:
            req.wait(timeout=10)
            result = "completed"
        except linkwise.CommAbortedError:
            result = "aborted"
    else:
        time.sleep(1.0)
        try:
            sub.all_reduce(np.ones(2, np.float32))
            result = "completed"
        except (linkwise.CommAbortedError, linkwise.PeerError):
            result = "aborted"
        sub.close()
    comm.barrier()
    return result


def test_close_fails_an_async_collective_pending_in_shared_memory():
    assert run_ranks(3, _close_with_pending, timeout=60) == ["aborted"] * 3


def _refused_after_numbering(comm, case):
    """Rank 1 alone passes what only the native layer used to refuse, after the call had
    taken its number: the others waited for the timeout (20 s here), then its own next call
    did too. Now every rank raises at once."""
    t0 = time.monotonic()
    try:
        if case == "readonly_out":
            x, out = np.ones(8, np.float32), np.empty(8, np.float32)
            out.flags.writeable = comm.rank != 1
            comm.all_reduce(x, out=out)
        else:  # a scatter larger than the executor's 32 KiB, objects at the root
            n = 30000  # float64 blocks of 240 KB: messages
            if comm.rank == 1:
                comm.scatter(np.array([None] * (n * comm.size), dtype=object), root=1)
            else:
                comm.scatter(None, root=1, out=np.empty(n, np.float64))
        what = "returned"
    except (ValueError, TypeError) as exc:
        what = type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - the peers' error kind is what is tested
        what = type(exc).__name__
    first = time.monotonic() - t0
    try:  # stays alive and calls again: its peers must not learn of the refusal by its exit
        comm.all_reduce(np.ones(2, np.float32))
    except Exception:  # noqa: BLE001 - the collectives stop after a refusal; how fast is tested
        pass
    return what, first, time.monotonic() - t0 - first


@pytest.mark.parametrize("case", ["readonly_out", "object_scatter"])
def test_one_ranks_late_refusal_is_told_at_once(case):
    env = {"LINKWISE_TIMEOUT": "20"}
    if case == "readonly_out":
        env["LINKWISE_ALGO"] = "ring"  # the message path: the executor refused in time already
    out = run_ranks(3, _refused_after_numbering, case, env=env)
    assert out[1][0] in ("ValueError", "TypeError"), out
    assert all(first < 5 and then < 5 for _, first, then in out), out  # not the 20 s timeout


def _byte_order_with_dtype(comm):
    try:
        comm.all_reduce(np.ones(4, ">f4"), dtype="float32")
        return "accepted"
    except TypeError as exc:
        return "byte order" in str(exc)


def test_dtype_argument_does_not_skip_the_byte_order_check():
    assert run_ranks(2, _byte_order_with_dtype) == [True, True]


def _bf16_outs(comm):
    import ml_dtypes
    x = np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16)
    rs = comm.reduce_scatter(x, out=np.empty(4 // comm.size, "V2"))
    u = np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    ar = comm.all_reduce(u, out=np.empty(4, ml_dtypes.bfloat16), dtype="bfloat16")
    return rs.view(ml_dtypes.bfloat16).astype(np.float32).tolist(), ar.astype(np.float32).tolist()


def test_bfloat16_forms_match_as_out():
    pytest.importorskip("ml_dtypes")
    out = run_ranks(2, _bf16_outs)
    assert out == [([0.0, 2.0], [0.0, 2.0, 4.0, 6.0]), ([4.0, 6.0], [0.0, 2.0, 4.0, 6.0])], out


def _split_after_a_death(comm):
    if comm.rank == 2:
        return "left"  # its process exits without joining the split
    t0 = time.monotonic()
    try:
        comm.split(0)
        what = "returned"
    except Exception as exc:  # noqa: BLE001 - the kind is what is tested
        what = type(exc).__name__, getattr(exc, "peer", None)
    took = time.monotonic() - t0
    if comm.rank == 0:
        time.sleep(1.0)  # it hosts the store: rank 1 must meet the death, not the store's end
    return what, took


def test_split_with_a_dead_peer_raises_peer_error_at_once():
    """It waited for the whole timeout, then raised a TimeoutError naming a store key."""
    out = run_ranks(3, _split_after_a_death, env={"LINKWISE_TIMEOUT": "20"}, expect_fail=True)
    for rank in (0, 1):
        kind, value = out[rank]
        assert kind == "ok" and value[0] == ("PeerError", 2) and value[1] < 5, out

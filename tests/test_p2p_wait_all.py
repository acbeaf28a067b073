"""linkwise.wait_all: waits for a list of requests (MPI_Waitall), natively for sends and receives
only, through each request's wait() otherwise; a failed request does not cut the other waits
short, and the first failure in list order is raised once all have ended."""
import time

import numpy as np
import pytest

from multirank import run_ranks


def _exchange_windows(comm, n):
    """Every rank sends a window of n arrays to every other rank and receives theirs."""
    import linkwise
    me, size = comm.rank, comm.size
    got = {p: [np.zeros(i + 1, np.int64) for i in range(n)] for p in range(size) if p != me}
    reqs, expect = [], []
    for p in range(size):
        if p == me:
            continue
        for i in range(n):
            reqs.append(comm.irecv(got[p][i], p, tag=i))
            expect.append((i + 1) * 8)
    sent = [np.arange(i + 1, dtype=np.int64) + 1000 * me for i in range(n)]
    for p in range(size):
        if p != me:
            for i in range(n):
                reqs.append(comm.isend(sent[i], p, tag=i))
                expect.append((i + 1) * 8)
    out = linkwise.wait_all(reqs)
    assert out == expect
    assert all(r.done for r in reqs)
    for p, arrays in got.items():
        for i, a in enumerate(arrays):
            assert np.array_equal(a, np.arange(i + 1) + 1000 * p), (p, i)
    return len(out)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("size", [2, 3])
def test_wait_all_of_sends_and_receives(size, transport):
    n = 17
    out = run_ranks(size, _exchange_windows, n, env={"LINKWISE_TRANSPORT": transport})
    assert out == [2 * n * (size - 1)] * size


def _mixed_and_empty(comm, _):
    import linkwise
    assert linkwise.wait_all([]) == []
    assert linkwise.wait_all(iter([])) == []
    x = np.arange(5, dtype=np.float64) + comm.rank
    peer = 1 - comm.rank
    y = np.zeros(3, np.int32)
    reqs = [comm.all_reduce(x, async_op=True), comm.irecv(y, peer), comm.isend(np.full(3, comm.rank, np.int32), peer)]
    summed, nrecv, nsent = linkwise.wait_all(reqs)  # not all send / receive: the general path
    assert np.array_equal(summed, 2 * np.arange(5) + 1)
    assert (nrecv, nsent) == (12, 12)
    assert np.array_equal(y, np.full(3, peer))
    pending = comm.irecv(y, peer)
    with pytest.raises(TypeError, match="not a linkwise request"):
        linkwise.wait_all([pending, "not a request"])
    comm.send(np.full(3, 7, np.int32), peer)  # the refused wait_all left the receive posted
    assert pending.wait() == 12 and np.array_equal(y, np.full(3, 7))
    return True


def test_wait_all_of_mixed_requests_and_of_none():
    assert run_ranks(2, _mixed_and_empty, None) == [True, True]


def _one_fails_the_others_finish(comm, native):
    """Rank 0 waits for [a receive rank 1 never matches (short timeout), a receive rank 1 sends
    late]: the first one's TimeoutError is raised only after the second one has landed."""
    import linkwise
    if comm.rank == 1:
        if not native:
            comm.all_reduce(np.zeros(0))
        comm.recv(np.zeros(1, np.uint8), 0, tag=9)  # rank 0 has posted both receives
        time.sleep(0.6)
        comm.send(np.full(4, 5.0), 0, tag=2)
        comm.recv(np.zeros(1, np.uint8), 0, tag=10)
        return None
    never = np.zeros(4)
    late = np.zeros(4)
    reqs = [comm.irecv(never, 1, tag=1, timeout=0.2), comm.irecv(late, 1, tag=2)]
    if not native:
        reqs.append(comm.all_reduce(np.zeros(0), async_op=True))  # so wait_all takes the general path
    t0 = time.monotonic()  # before the send: rank 1's 0.6 s start once it lands
    comm.send(np.zeros(1, np.uint8), 1, tag=9)
    with pytest.raises(linkwise.TimeoutError):
        linkwise.wait_all(reqs)
    waited = time.monotonic() - t0
    assert reqs[1].done and np.array_equal(late, np.full(4, 5.0))
    comm.send(np.zeros(1, np.uint8), 1, tag=10)
    return waited


@pytest.mark.parametrize("native", [True, False], ids=["native", "general"])
def test_a_failed_request_does_not_cut_the_other_waits_short(native):
    waited = run_ranks(2, _one_fails_the_others_finish, native)[0]
    assert waited >= 0.5, waited


def _shared_deadline(comm, _):
    import linkwise
    if comm.rank == 1:
        comm.recv(np.zeros(1, np.uint8), 0, tag=3)
        return None
    reqs = [comm.irecv(np.zeros(2), 1, tag=t) for t in (1, 2, 4)]
    t0 = time.monotonic()
    with pytest.raises(linkwise.TimeoutError):
        linkwise.wait_all(reqs, timeout=0.3)
    waited = time.monotonic() - t0
    with pytest.raises(ValueError):
        linkwise.wait_all(reqs, timeout=float("nan"))
    comm.send(np.zeros(1, np.uint8), 1, tag=3)
    return waited


def test_wait_all_timeout_is_one_deadline_for_all():
    waited = run_ranks(2, _shared_deadline, None)[0]
    assert 0.25 <= waited < 0.75, waited  # one after another: 0.9 s


def _budget_spent_on_a_collective(comm):
    """The general wait_all (an async collective in the list) gives the last requests no time
    once its budget is spent: a request already done still returns its result (it raised
    ValueError 'timeout 0' when zero timeouts were refused), an unfinished one TimeoutError."""
    import linkwise
    if comm.rank == 0:
        buf = np.zeros(4)
        rr = comm.irecv(buf, 1, tag=3, timeout=0.5)
        cr = comm.all_reduce(np.ones(4), async_op=True)  # rank 1 joins 1 s late: the budget is spent
        res = linkwise.wait_all([cr, rr])
        assert res[1] == 32 and buf.tolist() == [0.0, 1.0, 2.0, 3.0], res
        assert res[0].tolist() == [2.0] * 4
        never = comm.irecv(np.zeros(1), 1, tag=4, timeout=0.3)
        cr2 = comm.all_reduce(np.ones(2), async_op=True)
        with pytest.raises(linkwise.TimeoutError):
            linkwise.wait_all([cr2, never])  # the receive never comes: withdrawn
        assert cr2.wait().tolist() == [2.0, 2.0]
    else:
        comm.send(np.arange(4.0), 0, tag=3)
        time.sleep(1.0)
        comm.all_reduce(np.ones(4))
        time.sleep(0.5)
        comm.all_reduce(np.ones(2))
    comm.barrier()
    return "ok"


def test_general_wait_all_after_its_budget_is_spent():
    assert run_ranks(2, _budget_spent_on_a_collective, timeout=60) == ["ok", "ok"]



def _timeout_messages(comm, _):
    """On rank 0, wait_all(timeout=0.3) of [a receive rank 1 answers 0.1 s late, one it never
    answers], natively and in the general loop (an async collective first): the TimeoutError
    of the second names 0.3 s. Then without timeout=: the request's own (0.2 s)."""
    import linkwise
    if comm.rank == 1:
        for general in (False, True):
            if general:
                comm.all_reduce(np.ones(1))
            comm.recv(np.zeros(1, np.uint8), 0, tag=8)
            time.sleep(0.1)
            comm.send(np.zeros(2), 0, tag=5)
        comm.all_reduce(np.ones(0))
        comm.recv(np.zeros(1, np.uint8), 0, tag=9)
        return None
    said = []
    for general in (False, True):
        reqs = [comm.irecv(np.zeros(2), 1, tag=5), comm.irecv(np.zeros(2), 1, tag=1)]
        if general:
            reqs.insert(0, comm.all_reduce(np.ones(1), async_op=True))
        comm.send(np.zeros(1, np.uint8), 1, tag=8)
        with pytest.raises(linkwise.TimeoutError) as info:
            linkwise.wait_all(reqs, timeout=0.3)
        assert reqs[-2].done
        said.append(str(info.value))
    never = comm.irecv(np.zeros(1), 1, tag=3, timeout=0.2)
    with pytest.raises(linkwise.TimeoutError) as info:
        linkwise.wait_all([comm.all_reduce(np.ones(0), async_op=True), never])
    said.append(str(info.value))
    comm.send(np.zeros(1, np.uint8), 1, tag=9)
    return said


def test_wait_all_timeouts_name_the_callers_timeout():
    """Before, the error named what was left of the budget when the request's wait began
    ("did not complete within 0.199979 s" for timeout=0.3)."""
    said = run_ranks(2, _timeout_messages, None)[0]
    assert [" within 0.3 s;" in s for s in said[:2]] == [True, True], said
    assert " within 0.2 s;" in said[2], said


class _FakeGpuEngine:
    """A GPU engine's event calls for GpuRequest without a GPU: event 1 is reached after 0.1 s,
    event 2 never (its waits return False after the time they are given)."""

    def event_wait(self, ev, seconds):
        time.sleep(0.1 if ev == 1 else seconds)
        return ev == 1

    def event_query(self, ev):
        return False

    def event_destroy(self, ev):
        pass

    def check(self):
        pass


def test_wait_all_of_gpu_requests_names_the_callers_timeout():
    """GpuRequest's wait in wait_all named what was left (0.2 s of 0.3), and with none left
    "wait_all's timeout" without a number."""
    import linkwise
    from linkwise._request import GpuRequest
    engine = _FakeGpuEngine()
    with pytest.raises(linkwise.TimeoutError, match=r"within 0\.3 s;"):
        linkwise.wait_all([GpuRequest(engine, 1, 5.0, "a"), GpuRequest(engine, 2, 5.0, "b")], timeout=0.3)
    with pytest.raises(linkwise.TimeoutError, match=r"within 0\.05 s;"):  # spent by the first one
        linkwise.wait_all([GpuRequest(engine, 1, 5.0, "a"), GpuRequest(engine, 2, 5.0, "b")], timeout=0.05)

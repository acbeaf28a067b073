"""Point-to-point over shared memory and forced TCP, 1-5 ranks, checked byte for byte."""
import asyncio
import time

import numpy as np
import pytest

from multirank import run_ranks

SIZES = [0, 1, 7, 1000, 70_000, 3_000_001]  # 70 KB and 3 MB pass the single-copy threshold
DTYPES = [np.uint8, np.int32, np.float64, np.float16]


def _ring_exchange(comm):
    """Every rank sends to the next and receives from the previous, many sizes and dtypes."""
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    count = 0
    for dtype in DTYPES:
        for n in SIZES:
            x = (np.arange(n) * (comm.rank + 1) % 251).astype(dtype)
            y = np.full(n, 7, dtype=dtype)
            r = comm.irecv(y, prv, tag=n % 5)
            s = comm.isend(x, nxt, tag=n % 5)
            s.wait()
            got = r.wait()
            expect = (np.arange(n) * (prv + 1) % 251).astype(dtype)
            assert got == expect.nbytes, (got, expect.nbytes)
            np.testing.assert_array_equal(y, expect)
            count += 1
    return count


@pytest.mark.parametrize("nranks", [1, 2, 3, 5])
def test_ring_exchange_all_sizes(nranks, transport_env, shm_clean):
    assert run_ranks(nranks, _ring_exchange, env=transport_env) == [len(DTYPES) * len(SIZES)] * nranks


def _blocking_pingpong(comm):
    peer = 1 - comm.rank
    for n in SIZES:
        x = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
        y = np.empty(n, np.uint8)
        if comm.rank == 0:
            comm.send(x, peer, tag=3)
            assert comm.recv(y, peer, tag=3) == n
        else:
            comm.recv(y, peer, tag=3)
            comm.send(y, peer, tag=3)
        if comm.rank == 0:
            np.testing.assert_array_equal(x, y)
    return comm.link(peer)


def test_blocking_pingpong_and_link_choice(transport_env, shm_clean):
    links = run_ranks(2, _blocking_pingpong, env=transport_env)
    want = "shared memory" if transport_env["LINKWISE_TRANSPORT"] == "shm" else "TCP"
    assert all(link.startswith(want) for link in links), links


def _ordering(comm):
    """Per (peer, tag) order is kept even when the receiver drains tags in another order."""
    if comm.rank == 0:
        for i in range(40):
            comm.send(np.array([i], np.int64), 1, tag=i % 2)
            comm.send(np.full(20_000, i, np.int64), 1, tag=2)  # large: single-copy or stream
        return None
    got = {0: [], 1: [], 2: []}
    v = np.empty(1, np.int64)
    big = np.empty(20_000, np.int64)
    for tag in (1, 0):
        for _ in range(20):
            comm.recv(v, 0, tag=tag)
            got[tag].append(int(v[0]))
    for _ in range(40):
        comm.recv(big, 0, tag=2)
        assert (big == big[0]).all()
        got[2].append(int(big[0]))
    return got


def test_order_per_tag(transport_env):
    got = run_ranks(2, _ordering, env=transport_env)[1]
    assert got[0] == list(range(0, 40, 2))
    assert got[1] == list(range(1, 40, 2))
    assert got[2] == list(range(40))


def _both_send_first(comm):
    """Both ranks send a large message before receiving: must not deadlock."""
    peer = 1 - comm.rank
    x = np.full(5_000_000, comm.rank, np.uint8)
    y = np.empty_like(x)
    comm.send(x, peer, timeout=20)
    comm.recv(y, peer, timeout=20)
    return int(y[0]), int(y[-1])


def test_both_send_large_first(transport_env):
    assert run_ranks(2, _both_send_first, env=transport_env) == [(1, 1), (0, 0)]


def _size_and_type_errors(comm):
    peer = 1 - comm.rank
    if comm.rank == 0:
        comm.send(np.arange(10, dtype=np.int32), peer, tag=1)
        comm.send(np.arange(4, dtype=np.float64), peer, tag=2)
        comm.send(np.arange(3, dtype=np.int32), peer, tag=3)
        return None
    small = np.zeros(5, np.int32)
    with pytest.raises(ValueError, match="does not fit"):
        comm.recv(small, peer, tag=1)
    big = np.zeros(10, np.int32)
    assert comm.recv(big, peer, tag=1) == 40  # the message was kept
    assert big.tolist() == list(range(10))
    with pytest.raises(TypeError, match="float64"):
        comm.recv(np.zeros(4, np.int64), peer, tag=2)
    f = np.zeros(4, np.float64)
    comm.recv(f, peer, tag=2)
    assert f.tolist() == [0.0, 1.0, 2.0, 3.0]
    larger = np.full(8, -1, np.int32)
    assert comm.recv(larger, peer, tag=3) == 12  # a shorter message into a larger buffer
    assert larger.tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    return "ok"


def test_receive_too_small_raises_and_keeps_message(transport_env):
    assert run_ranks(2, _size_and_type_errors, env=transport_env)[1] == "ok"


def _byte_orders(comm):
    """Big-endian int32 into little-endian int32 used to land byte-swapped without an error;
    the same byte order on both sides still moves, and raw bytes take either."""
    x = np.arange(1, 6, dtype=">i4")
    if comm.rank == 0:
        for _ in range(3):
            comm.send(x, 1, tag=5)
        return None
    with pytest.raises(TypeError, match="int32 in the other byte order"):
        comm.recv(np.zeros(5, "<i4"), 0, tag=5)
    same = np.zeros(5, ">i4")
    comm.recv(same, 0, tag=5)
    raw = np.zeros(20, np.uint8)
    comm.recv(raw, 0, tag=5)
    return same.tolist(), raw.view(">i4").tolist()


def test_byte_order_is_part_of_the_dtype(transport_env):
    assert run_ranks(2, _byte_orders, env=transport_env)[1] == ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])


def _record_layouts(comm):
    """Records of one size but another layout (int32, float32 against float32, int32) moved
    without an error before, their bits reinterpreted; so did a 256-byte record into a
    512-byte one (only the size's low byte was compared). The same layout under other field
    names still moves, and so do records without fields (void, bytes) of the same size."""
    a = np.dtype([("a", "i4"), ("b", "f4")])
    b = np.dtype([("a", "f4"), ("b", "i4")])
    renamed = np.dtype([("u", "i4"), ("v", "f4")])
    x = np.zeros(3, a)
    x["a"], x["b"] = [1, 2, 3], [0.5, 1.5, 2.5]
    if comm.rank == 0:
        for _ in range(3):
            comm.send(x, 1, tag=6)
        comm.send(np.zeros(2, "V256"), 1, tag=7)
        comm.send(np.zeros(2, "V256"), 1, tag=7)
        return None
    with pytest.raises(TypeError, match=r"8-byte records \(layout \d+\) data .* holds 8-byte records \(layout"):
        comm.recv(np.zeros(3, b), 0, tag=6)
    same = np.zeros(3, renamed)
    comm.recv(same, 0, tag=6)
    plain = np.zeros(3, "V8")
    comm.recv(plain, 0, tag=6)
    with pytest.raises(TypeError, match="256-byte records data .* holds 512-byte records"):
        comm.recv(np.zeros(1, "V512"), 0, tag=7)
    comm.recv(np.zeros(2, "S256"), 0, tag=7)
    return same["u"].tolist(), same["v"].tolist(), plain.tobytes() == x.tobytes()


def test_record_layouts_are_part_of_the_dtype(transport_env):
    assert run_ranks(2, _record_layouts, env=transport_env)[1] == ([1, 2, 3], [0.5, 1.5, 2.5], True)


def _argument_errors(comm):
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="out of range"):
        comm.send(x, comm.size)
    with pytest.raises(ValueError, match="out of range"):
        comm.recv(x, -1)
    with pytest.raises(ValueError, match="tag"):
        comm.send(x, 0, tag=-1)
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.recv(np.zeros((4, 4), np.float32)[:, 1], 0)
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        comm.recv(ro, 0)
    with pytest.raises(ValueError, match="read-only"):
        comm.recv(b"abcd", 0)
    with pytest.raises(TypeError, match="buffer protocol"):
        comm.send(object(), 0)
    import linkwise
    t0 = time.monotonic()
    with pytest.raises(linkwise.TimeoutError, match=r"did not complete within 0\.3 s;"):
        comm.recv(x, (comm.rank + 1) % comm.size, tag=99, timeout=0.3)
    assert time.monotonic() - t0 < 5
    # neither rank may exit while the other still waits out its timeout (that is a PeerError)
    peer = (comm.rank + 1) % comm.size
    comm.send(np.zeros(1), peer, tag=100)
    comm.recv(np.zeros(1), peer, tag=100)
    # NumPy integers serve as ranks and tags in every form (as for roots); bool and float do not
    got = np.zeros(2, np.int64)
    r = comm.irecv(got, np.int64(peer), tag=np.uint8(7))
    comm.send(np.full(2, comm.rank, np.int64), np.int32(peer), tag=np.int64(7))
    r.wait()
    assert got.tolist() == [peer, peer]
    comm.isend(np.full(2, comm.rank + 10, np.int64), np.int16(peer), np.int64(8)).wait()
    comm.recv(got, np.intp(peer), tag=np.int32(8))
    assert got.tolist() == [peer + 10] * 2
    got2 = np.zeros(2, np.int64)
    comm.sendrecv(np.full(2, comm.rank + 20, np.int64), np.int64(peer), got2, np.int64(peer),
                  send_tag=np.int64(9), recv_tag=np.int64(9))
    assert got2.tolist() == [peer + 20] * 2
    for bad in (True, 1.0, "1"):
        with pytest.raises(ValueError, match="rank must be an integer"):
            comm.send(x, bad)
    with pytest.raises(ValueError, match="tag"):
        comm.irecv(x, peer, tag=True)
    # self send/recv, also with odd Python buffers
    comm.send(bytearray(b"hello"), comm.rank, tag=5)
    out = bytearray(5)
    comm.recv(out, comm.rank, tag=5)
    assert bytes(out) == b"hello"
    return "ok"


def test_argument_errors_and_timeout():
    assert run_ranks(2, _argument_errors) == ["ok", "ok"]


def _wait_on_streaming_message(comm):
    """A receive's wait(timeout) gives up near its time even while a large message streams in
    over TCP without pause (before: one progress pass read the whole body under the engine's
    lock, 0.3 s late on a 128 MB message)."""
    import linkwise
    n = 256 << 20
    if comm.rank == 1:
        big = np.ones(n, np.uint8)
        comm.send(np.zeros(1), 0, tag=2)  # the big one follows at once
        try:
            comm.send(big, 0, tag=3)
        except linkwise.PeerError:  # rank 0 gave up in the middle of the transfer
            return "aborted"
        return "sent"
    buf = np.zeros(n, np.uint8)
    req = comm.irecv(buf, 1, tag=3)
    comm.recv(np.zeros(1), 1, tag=2)
    t0 = time.monotonic()
    with pytest.raises(linkwise.TimeoutError):
        req.wait(timeout=0.05)
    return time.monotonic() - t0


def test_wait_timeout_while_a_large_tcp_message_streams():
    late, sender = run_ranks(2, _wait_on_streaming_message, env={"LINKWISE_TRANSPORT": "tcp"})
    assert sender in ("aborted", "sent")
    assert 0.05 <= late < 0.25, late


def _async(comm):
    peer = 1 - comm.rank

    async def main():
        xs = [np.full(n, comm.rank + 1, np.int64) for n in (1, 100, 300_000)]
        ys = [np.zeros_like(x) for x in xs]
        sends = [comm.asend(x, peer, tag=i) for i, x in enumerate(xs)]
        recvs = [comm.arecv(y, peer, tag=i) for i, y in enumerate(ys)]
        results = await asyncio.gather(*sends, *recvs)
        assert all((y == peer + 1).all() for y in ys)
        return results[len(xs):]

    got = asyncio.run(main())
    # request polling: test() turns True without wait()
    y = np.zeros(3, np.int32)
    r = comm.irecv(y, peer, tag=50)
    comm.send(np.array([1, 2, 3], np.int32), peer, tag=50)
    deadline = time.monotonic() + 10
    while not r.test():
        assert time.monotonic() < deadline
    assert y.tolist() == [1, 2, 3]
    return got


def test_async_and_test(transport_env):
    res = run_ranks(2, _async, env=transport_env)
    assert res == [[8, 800, 2_400_000]] * 2


def _requests(comm):
    """isend / irecv return the native request: a linkwise.Request with the communicator's
    timeout (or the call's), whose wait() and await give the bytes moved; a wait without a
    timeout uses the request's (here 0.2 s, on a receive nobody sends to)."""
    import linkwise
    peer = 1 - comm.rank
    x, y = np.full(5, comm.rank, np.int16), np.zeros(5, np.int16)
    r, s = comm.irecv(y, peer, tag=3), comm.isend(x, peer, tag=3)
    assert isinstance(r, linkwise.Request) and isinstance(s, linkwise.Request)
    assert r.timeout == comm.timeout and s.timeout == comm.timeout
    assert s.wait() == 10 and r.wait() == 10 and y.tolist() == [peer] * 5 and r.done and r.nbytes == 10

    async def awaited():
        z = np.zeros(5, np.int16)
        got = await asyncio.gather(comm.isend(x, peer, tag=4), comm.irecv(z, peer, tag=4))
        return got, z.tolist()

    assert asyncio.run(awaited()) == ([10, 10], [peer] * 5)
    short = comm.irecv(np.zeros(1), peer, tag=5, timeout=0.2)
    assert short.timeout == 0.2
    t0 = time.monotonic()
    with pytest.raises(linkwise.TimeoutError):
        short.wait()
    assert time.monotonic() - t0 < 5
    # Awaited (polled: no progress thread drives an irecv), timed out, withdrawn: the next
    # message on that tag goes to the next receive, not into the abandoned buffer.
    abandoned, later = np.zeros(2), np.zeros(2)
    with pytest.raises(linkwise.TimeoutError, match="within 0.2 s"):
        asyncio.run(asyncio.wait_for(_awaited(comm.irecv(abandoned, peer, tag=6, timeout=0.2)), 10))
    comm.barrier()
    comm.isend(np.full(2, 9.0), peer, tag=6).wait()
    comm.recv(later, peer, tag=6)
    assert later.tolist() == [9.0, 9.0] and abandoned.tolist() == [0.0, 0.0]
    return True


async def _awaited(request):
    return await request


def test_requests_are_native_with_their_timeout():
    run_ranks(2, _requests)


def _awaited_receive_that_timed_out(comm):
    """An awaited receive that times out must not stay posted: a later message goes to the
    later receive, never into the abandoned buffer (before: it landed in the first one)."""
    import linkwise
    if comm.rank == 1:
        comm.barrier()  # after rank 0's receive timed out
        comm.send(np.full(4, 42.0), 0, tag=7)
        return "sent"
    abandoned, later = np.zeros(4), np.zeros(4)
    try:
        asyncio.run(comm.arecv(abandoned, 1, tag=7, timeout=0.3))
        return "the receive did not time out"
    except linkwise.TimeoutError as exc:
        assert "within 0.3 s;" in str(exc), exc
    comm.barrier()
    comm.recv(later, 1, tag=7)
    return later.tolist(), abandoned.tolist()


def test_awaited_receive_that_timed_out_is_cancelled(transport_env):
    out = run_ranks(2, _awaited_receive_that_timed_out, env=transport_env)
    assert out == [([42.0] * 4, [0.0] * 4), "sent"]


def _rewait_withdrawn(comm):
    """A request withdrawn by a wait that timed out raises TimeoutError again on a later wait
    or test (the communicator is fine), not CommAbortedError."""
    import linkwise
    if comm.rank == 1:
        comm.barrier()
        return "idle"
    req = comm.irecv(np.zeros(4), 1, tag=11)
    kinds = []
    for call in (lambda: req.wait(timeout=0.2), req.wait, req.test):
        try:
            call()
            kinds.append("ok")
        except linkwise.TimeoutError:
            kinds.append("TimeoutError")
    comm.barrier()
    return kinds


def test_withdrawn_request_raises_timeout_again():
    assert run_ranks(2, _rewait_withdrawn) == [["TimeoutError"] * 3, "idle"]


def _cancelled_receive(comm, form):
    """A receive whose asyncio task is cancelled (task.cancel(), an outer wait_for) is withdrawn
    as a timed-out one is: the later message goes to the later receive."""
    if comm.rank == 1:
        comm.barrier()
        comm.send(np.full(4, 42.0), 0, tag=9)
        return "sent"

    async def main(buf):
        recv = comm.arecv(buf, 1, tag=9)
        if form == "wait_for":
            try:
                await asyncio.wait_for(recv, 0.3)
            except asyncio.TimeoutError:
                return "cancelled"
        task = asyncio.ensure_future(recv)
        await asyncio.sleep(0.2)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "not cancelled"

    abandoned, later = np.zeros(4), np.zeros(4)
    state = asyncio.run(main(abandoned))
    comm.barrier()
    comm.recv(later, 1, tag=9)
    return state, later.tolist(), abandoned.tolist()


@pytest.mark.parametrize("form", ["wait_for", "cancel"])
def test_cancelled_awaited_receive_is_withdrawn(form):
    out = run_ranks(2, _cancelled_receive, form)
    assert out == [("cancelled", [42.0] * 4, [0.0] * 4), "sent"]


def _torch_tensors(comm):
    import torch
    peer = 1 - comm.rank
    x = torch.arange(1000, dtype=torch.float32) * (comm.rank + 1)
    y = torch.zeros(1000, dtype=torch.float32)
    r = comm.irecv(y, peer)
    comm.send(x, peer)
    r.wait()
    assert torch.equal(y, torch.arange(1000, dtype=torch.float32) * (peer + 1))
    return "ok"


def test_dlpack_tensors():
    pytest.importorskip("torch")
    assert run_ranks(2, _torch_tensors) == ["ok", "ok"]


def _oversubscribed_pingpong(comm):
    """8 ranks on 2 cores: pairs ping-pong; sleeping waits let everyone progress."""
    peer = comm.rank ^ 1
    x = np.zeros(8, np.uint8)
    t0 = time.monotonic()
    for _ in range(300):
        if comm.rank % 2 == 0:
            comm.send(x, peer)
            comm.recv(x, peer)
        else:
            comm.recv(x, peer)
            comm.send(x, peer)
    return time.monotonic() - t0


def test_eight_ranks_on_two_cores_pingpong():
    times = run_ranks(8, _oversubscribed_pingpong, timeout=60)
    assert max(times) < 30, times


def _large_messages_copied_by_both(comm, sender_idle):
    """Messages of 256 KiB and more are copied in pieces (a quarter of the message, 128-512
    KiB) by the receiver and, while it waits for the ack, the sender: every piece must land in
    the right place of the right message, short last pieces included."""
    peer = 1 - comm.rank
    # 2 pieces; 3 (short last); 4 of 175000 + 1 byte; five of 512 KiB + a short sixth
    sizes = [256 << 10, 300_007, 700_001, (5 << 19) + 7]
    count = 12

    def message(i):
        return np.random.default_rng(i).integers(0, 255, sizes[i % len(sizes)], dtype=np.uint8)
    if comm.rank == 0:
        msgs = [message(i) for i in range(count)]
        reqs = [comm.isend(m, peer, tag=7) for m in msgs]
        if sender_idle:
            time.sleep(0.5)  # not in a linkwise call: the receiver copies everything itself
        for r in reqs:
            r.wait()
        return None
    out = []
    for i in range(count):
        want = message(i)
        y = np.empty(want.size, np.uint8)
        assert comm.recv(y, peer, tag=7) == want.size
        out.append(bool((y == want).all()))
    return out


@pytest.mark.parametrize("sender_idle", [False, True])
def test_large_messages_copied_by_both_sides(sender_idle):
    assert run_ranks(2, _large_messages_copied_by_both, sender_idle)[1] == [True] * 12

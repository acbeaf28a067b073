"""Collectives beyond the reference matrix: async and coroutine forms, split communicators,
LINKWISE_CHECK, a rank killed mid-collective, argument errors, and the half-precision kernels."""
import asyncio
import time

import ml_dtypes
import numpy as np
import pytest
from coll_ref import check_equal, data, reduce_ref
from multirank import collective_until_peer_error, run_ranks

import linkwise


def _async_body(comm):
    n, r = comm.size, comm.rank
    ins = [data(q, 3000, "float32", "sum") for q in range(n)]
    want = reduce_ref(ins, "sum", "float32")
    # several in flight at once, finished out of order
    xs = [ins[r].copy() for _ in range(3)]
    reqs = [comm.all_reduce(x, async_op=True) for x in xs]
    g = comm.all_gather(ins[r][:10], async_op=True)
    b = comm.broadcast(ins[r].copy(), root=n - 1, async_op=True)
    for req in reversed(reqs):
        assert req.wait() is not None
    for x in xs:
        check_equal(x, want, "async all_reduce")
    check_equal(g.wait(), np.concatenate([i[:10] for i in ins]), "async all_gather")
    check_equal(b.wait(), ins[n - 1], "async broadcast")
    comm.barrier(async_op=True).wait()

    async def coros():
        x = ins[r].copy()
        got = await comm.aall_reduce(x, op="max")
        check_equal(got, reduce_ref(ins, "max", "float32"), "aall_reduce")
        got = await comm.abroadcast(ins[r].copy(), root=0)
        check_equal(got, ins[0], "abroadcast")
        red = await comm.areduce(ins[r].copy(), root=n - 1)
        if r == n - 1:
            check_equal(red, want, "areduce")
        check_equal(await comm.aall_gather(ins[r]), np.concatenate(ins), "aall_gather")
        rs = await comm.areduce_scatter(np.concatenate([ins[r]] * n))
        check_equal(rs, want, "areduce_scatter")
        a2a = await comm.aall_to_all(np.full(n, r, np.int32))
        check_equal(a2a, np.arange(n, dtype=np.int32), "aall_to_all")
        gat = await comm.agather(np.array([r], np.int64), root=0)
        if r == 0:
            check_equal(gat, np.arange(n, dtype=np.int64), "agather")
        sc = await comm.ascatter(np.arange(n, dtype=np.int64) * 10 if r == 1 else None, root=1,
                                 out=np.empty(1, np.int64))
        check_equal(sc, np.array([r * 10], np.int64), "ascatter")
        # two coroutines at once on one loop
        a, c = ins[r].copy(), ins[r].copy()
        await asyncio.gather(comm.aall_reduce(a), comm.aall_reduce(c, op="min"))
        check_equal(a, want, "gathered coroutine sum")
        check_equal(c, reduce_ref(ins, "min", "float32"), "gathered coroutine min")
        await comm.abarrier()
        return True
    return asyncio.run(coros())


def test_async_and_coroutines(transport_env):
    assert run_ranks(3, _async_body, env=transport_env, timeout=60) == [True] * 3


def _async_first_then_message(comm, which):
    """Rank 0's first collective is async, and it then sends rank 1 the message rank 1 waits
    for before its own all_reduce. Over shared memory the async call set up the executor,
    which waited for rank 1: rank 0 never sent, rank 1 never came (both timed out), where TCP
    went on. On the world and on a fresh sub-communicator; as a request and as a coroutine."""
    import asyncio
    c = comm if which != "split" else comm.split(0)
    x = np.full(4, c.rank + 1.0, np.float32)
    if c.rank == 0:
        if which == "await":
            async def both():
                task = asyncio.ensure_future(c.aall_reduce(x))
                await asyncio.sleep(0)
                await c.asend(np.array([42]), 1)
                return await task
            asyncio.run(both())
        else:
            req = c.all_reduce(x, async_op=True)
            c.send(np.array([42]), 1)
            req.wait()
    else:
        got = np.zeros(1, np.int64)
        c.recv(got, 0)
        assert got[0] == 42
        c.all_reduce(x)
    if c is not comm:
        c.close()
    return x.tolist()


@pytest.mark.parametrize("which", ["world", "split", "await"])
def test_an_async_first_collective_does_not_wait_for_the_peers(which, transport_env):
    env = dict(transport_env, LINKWISE_TIMEOUT="10")
    assert run_ranks(2, _async_first_then_message, which, env=env, timeout=60) == [[3.0] * 4] * 2


def _split_body(comm):
    n, r = comm.size, comm.rank
    color = None if r == n - 1 else r % 2
    sub = comm.split(color, key=-r)  # reversed order inside each group
    if color is None:
        assert sub is None
        comm.barrier()
        return None
    members = sorted([q for q in range(n - 1) if q % 2 == color], reverse=True)
    assert sub.size == len(members) and sub.rank == members.index(r)
    x = np.array([r, 1], np.int64)
    sub.all_reduce(x)
    assert x.tolist() == [sum(members), len(members)]
    got = sub.all_gather(np.array([r], np.int32))
    assert got.tolist() == members
    # a second level of splitting, and the parent still works alongside
    sub2 = sub.split(0)
    y = np.ones(1000, np.float32)
    sub2.all_reduce(y)
    assert (y == len(members)).all()
    comm.barrier()
    sub2.close()
    sub.close()
    return sub.size


def test_split(shm_clean):
    assert run_ranks(5, _split_body, timeout=60) == [2, 2, 2, 2, None]


def _deep_splits(comm):
    """Each level's id holds its parent's and its colour, and went into the shared-memory
    segments' memfd names, which memfd_create refuses past 249 bytes: with colours near 2**63
    the tenth level raised LinkwiseError (memfd_create: Invalid argument) on every rank."""
    sub, made = comm, []
    for level in range(14):
        sub = sub.split((1 << 63) - 1 - level, key=sub.rank)
        made.append(sub)
        x = np.full(5, comm.rank + level, np.int64)
        sub.all_reduce(x)  # sets up the executor's segment as well as the links' inboxes
        assert x.tolist() == [sum(range(comm.size)) + level * comm.size] * 5
    for s in reversed(made):
        s.close()
    return len(sub.comm_id)


def test_deep_splits_with_large_colours(shm_clean):
    lengths = run_ranks(2, _deep_splits, timeout=90)
    assert lengths[0] == lengths[1] > 249


def _world_closed_first(comm):
    """Ranks other than 0 close the world right after the split: their sub-communicator's
    first collective (the shared-memory set-up goes through the store) and a split of it
    still work. Closing the world closed the store connection it shares with them
    (BootstrapError 'the store was closed', over shared memory)."""
    sub = comm.split(0)
    if comm.rank != 0:
        comm.close()
    x = np.full(1000, comm.rank + 1, np.float32)
    sub.all_reduce(x)
    sub2 = sub.split(comm.rank % 2)
    y = np.ones(8, np.int64)
    sub2.all_reduce(y)
    got = (float(x[0]), int(y[0]))
    sub2.barrier()
    sub.barrier()  # rank 0 closes the store's host last
    sub2.close()
    sub.close()
    if comm.rank == 0:
        comm.close()
    return got


def test_sub_communicators_outlive_a_closed_world(transport_env):
    out = run_ranks(3, _world_closed_first, env=transport_env, timeout=60)
    assert out == [(6.0, 2), (6.0, 1), (6.0, 2)]


def _mismatch_body(comm, what):
    r = comm.rank
    try:
        if what == "size":
            comm.all_reduce(np.ones(10 + (r == 1), np.float32))
        elif what == "dtype":
            comm.all_reduce(np.ones(10, np.float32 if r else np.float64))
        elif what == "op":
            comm.all_reduce(np.ones(10, np.float32), op="max" if r == 2 else "sum")
        elif what == "root":
            comm.broadcast(np.ones(10, np.float32), root=r % 2)
        elif what == "kind":
            (comm.barrier() if r == 0 else comm.all_reduce(np.ones(4)))
    except ValueError as exc:
        assert "disagree" in str(exc)
        # the communicator is still usable afterwards
        x = np.ones(3, np.float32)
        comm.all_reduce(x)
        assert (x == comm.size).all()
        return "raised"
    return "no error"


@pytest.mark.parametrize("what", ["size", "dtype", "op", "root", "kind"])
def test_check_mismatch_raises_everywhere(what):
    got = run_ranks(3, _mismatch_body, what, env={"LINKWISE_CHECK": "1"}, timeout=60)
    assert got == ["raised"] * 3


def _die_body(comm, coll):
    # Survivors stay alive a while: none may need another survivor to exit before it learns
    # (abort notices, p2p/engine.h).
    return collective_until_peer_error(comm, coll, np.ones(1 << 18, np.float32), linger=1.5)


@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "broadcast"])
def test_rank_killed_mid_collective(transport_env, coll):
    out = run_ranks(3, _die_body, coll, env=transport_env, expect_fail=True, timeout=60)
    assert out[2][0] == "died"
    # every survivor names the dead rank, not a survivor that gave up before it
    assert out[:2] == [("ok", 2), ("ok", 2)], out[:2]


def _one_dead_one_late_body(comm, coll, n):
    """Rank 2 dies; rank 1 comes to the collective only after 6 s; rank 0 waits in it (a
    shared-memory round every rank must reach). Rank 0 must raise PeerError naming rank 2 at
    the next slow check, not wait for rank 1 (before: until rank 1 came, or the timeout)."""
    import os
    import signal
    import time
    from linkwise.errors import PeerError
    comm.barrier()
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if comm.rank == 1:
        time.sleep(6.0)
    t0 = time.monotonic()
    x = np.ones(n, np.float32)
    try:
        comm.all_to_all(x) if coll == "all_to_all" else comm.all_reduce(x)
    except PeerError as exc:
        return exc.peer, time.monotonic() - t0
    return "no error", time.monotonic() - t0


@pytest.mark.parametrize("coll,n", [("all_reduce", 4), ("all_reduce", 100_000), ("all_to_all", 30)],
                         ids=["one-shot", "two-shot", "exchange"])
def test_a_dead_peer_fails_a_round_waiting_on_a_late_one(coll, n):
    out = run_ranks(3, _one_dead_one_late_body, coll, n, expect_fail=True, timeout=60)
    assert out[2][0] == "died"
    peer, waited = out[0][1]
    assert peer == 2 and waited < 3.0, out[0]


def _half_sent_body(comm, nbytes):
    """Rank 0 has a large eager message half-written to rank 1 (which does not read for a
    while) when its collective fails on rank 2's death; rank 0 then stays alive."""
    import os
    import signal
    import time
    from linkwise.errors import PeerError
    comm.barrier()
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if comm.rank == 0:
        req = comm.isend(np.ones(nbytes, np.uint8), 1)
        try:
            comm.all_gather(np.ones(1000, np.float32))
        except PeerError as exc:
            time.sleep(8.0)
            del req  # failed by the abort (CommAbortedError if waited on)
            return ("rank 0", exc.peer)
        return ("rank 0", "no error")
    time.sleep(1.0)  # rank 0 has given up by now, in the middle of the message to us
    t0 = time.monotonic()
    try:
        comm.recv(np.empty(nbytes, np.uint8), 0)
    except PeerError as exc:
        return ("rank 1", exc.peer, time.monotonic() - t0)
    return ("rank 1", "no error")


@pytest.mark.parametrize("env,nbytes", [({"LINKWISE_TRANSPORT": "tcp"}, 16 << 20),
                                        ({"LINKWISE_SHM_RING_SIZE": "4096"}, 32 << 10)],
                         ids=["tcp", "shm"])
def test_abort_mid_message_closes_the_link(env, nbytes):
    """The aborting rank cannot put a notice behind a half-written message, so it closes that
    link: rank 1 raises PeerError naming rank 0 at once, not when rank 0 exits (8 s later)."""
    out = run_ranks(3, _half_sent_body, nbytes, env=env, expect_fail=True, timeout=60)
    assert out[2][0] == "died"
    assert out[0][0] == "ok" and out[0][1][:2] == ("rank 0", 2), out[0]
    kind, (who, peer, waited) = out[1]
    assert (kind, who, peer) == ("ok", "rank 1", 0), out[1]
    assert waited < 3.0, f"rank 1 waited {waited:.1f} s"


def test_argument_errors():
    comm = linkwise.init()
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="integer"):
        comm.all_reduce(x, op="band")
    with pytest.raises(ValueError, match="not one of"):
        comm.all_reduce(x, op="mean")
    with pytest.raises(ValueError, match="root"):
        comm.broadcast(x, root=3)
    with pytest.raises(ValueError, match="out must be"):
        comm.all_reduce(x, out=np.ones(5, np.float32))
    with pytest.raises(ValueError, match="out must be"):
        comm.all_gather(x, out=np.ones(4, np.float64))
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(np.ones((4, 4), np.float32)[:, 1])
    with pytest.raises(TypeError, match="cannot be reduced"):
        comm.all_reduce(np.ones(4, np.int16))
    with pytest.raises(ValueError, match="read-only"):
        ro = np.ones(4, np.float32)
        ro.setflags(write=False)
        comm.all_reduce(ro)
    with pytest.raises(ValueError, match="root must pass x"):
        comm.scatter(None, root=0)
    with pytest.raises(TypeError, match="dtype"):
        comm.all_reduce(np.ones(4, np.uint16), dtype="bfloat17")
    # single rank: every collective is a local copy
    assert comm.all_gather(x).tolist() == [1.0] * 4
    assert comm.reduce_scatter(np.arange(4.0)).tolist() == [0, 1, 2, 3]
    assert comm.all_reduce(np.arange(3, dtype=np.int8), op="avg").tolist() == [0, 1, 2]
    comm.barrier()
    # buffer-protocol objects other than NumPy
    b = bytearray(b"\x01\x02")
    comm.broadcast(b)
    assert b == bytearray(b"\x01\x02")
    comm.close()


def _half_body(comm, dt):
    """Two ranks combine random half values: one rounding of the exact result, as NumPy does."""
    rng = np.random.default_rng(comm.rank + 10)
    typ = ml_dtypes.bfloat16 if dt == "bfloat16" else np.float16
    vals = rng.standard_normal(4000) * np.exp(rng.uniform(-12, 12, 4000))
    vals[:8] = [0.0, -0.0, np.inf, -np.inf, 6e-8, -6e-5, 65000.0, 3e-5]
    mine = vals.astype(typ)
    peer = comm.all_gather(mine).reshape(2, -1)
    a, b = peer[0], peer[1]
    for op, f in [("sum", np.add), ("prod", np.multiply), ("min", np.minimum), ("max", np.maximum)]:
        x = mine.copy()
        comm.all_reduce(x, op=op)
        want = f(a, b).astype(typ)
        ok = (x.view(np.uint16) == want.view(np.uint16)) | (np.isnan(x.astype(np.float32)) & np.isnan(want.astype(np.float32)))
        assert ok.all(), f"{dt} {op}: {np.flatnonzero(~ok)[:5]} got {x[~ok][:5]} want {want[~ok][:5]}"
    # a uint16 array tagged as bfloat16 reduces like the ml_dtypes array
    if dt == "bfloat16":
        u = mine.view(np.uint16).copy()
        comm.all_reduce(u, dtype="bfloat16")
        assert (u == np.add(a, b).astype(typ).view(np.uint16)).all()
    return True


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_half_rounding(dt):
    assert run_ranks(2, _half_body, dt, timeout=60) == [True, True]


def _mixed_forms_body(comm):
    """Ranks may use different forms (async on one, blocking on another); calls keep issue order."""
    n, r = comm.size, comm.rank
    a = np.full(200_000, r + 1.0)  # two-shot through shared memory
    b = np.full(7, r + 1, np.int64)  # one-shot
    c = np.full(100, float(r))
    if r % 2 == 0:
        ra = comm.all_reduce(a, async_op=True)
        comm.all_reduce(b)  # blocking, queued behind ra
        rc = comm.broadcast(c, root=1, async_op=True)
        ra.wait()
        rc.wait()
    else:
        comm.all_reduce(a)
        comm.all_reduce(b, async_op=True).wait()
        comm.broadcast(c, root=1)
    s = n * (n + 1) / 2
    assert (a == s).all() and (b == s).all() and (c == 1.0).all()
    return True


def test_mixed_blocking_and_async(shm_clean):
    assert run_ranks(3, _mixed_forms_body, timeout=60) == [True] * 3


def _nothing_pending_after_wait(comm):
    """Once wait() returns, the job no longer counts as pending: close() after it must not
    stop the executor under peers still in that call (it did, now and then, when the worker
    woke the waiter before it counted the job done)."""
    x = np.ones(7, np.int64)
    seen = 0
    for _ in range(3000):
        comm.all_reduce(x, async_op=True).wait()
        seen += comm._coll_worker.pending
    return seen


def test_no_job_pending_after_wait():
    assert run_ranks(2, _nothing_pending_after_wait, timeout=60) == [0, 0]


def _many_pending_async(comm):
    """600 pending async all_reduces under a limit of 256 open files: each used to hold an
    eventfd from submission (made now only when awaited), so the 256th failed with EMFILE."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        xs = [np.full(2, comm.rank + 1.0, np.float32) for _ in range(600)]
        reqs = [comm.all_reduce(x, async_op=True) for x in xs]
        return all(float(r.wait()[0]) == 3.0 for r in reqs)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_many_pending_async_collectives_need_no_file_each():
    assert run_ranks(2, _many_pending_async, timeout=120) == [True, True]


def _select_on_async(comm, algo):
    """An async collective's request has fileno(), as a point-to-point one has, for select()
    or an event loop's add_reader: readable once done, not before."""
    import os
    import select
    if algo:
        os.environ["LINKWISE_ALGO"] = algo
    x = np.full(1000, comm.rank + 1.0, np.float32)
    token = np.zeros(1, np.int32)
    comm.all_reduce(np.zeros(1, np.float32))  # sets up the shared-memory executor (every rank joins)
    if comm.rank == 1:  # calls only once rank 0 has looked: its request cannot be done before
        comm.recv(token, src=0, tag=5)
        req = comm.all_reduce(x, async_op=True)
        early = []
    else:
        req = comm.all_reduce(x, async_op=True)
        early = select.select([req], [], [], 0)[0]
        comm.send(token, dst=1, tag=5)
    ready = select.select([req], [], [], 30)[0]
    return len(early), len(ready), float(req.wait()[0])


@pytest.mark.parametrize("algo", ["", "ring"], ids=["executor", "ring"])
def test_async_collective_request_has_fileno(algo):
    assert run_ranks(2, _select_on_async, algo, timeout=60) == [(0, 1, 3.0)] * 2


def _block_shape_body(comm, rows_per_rank, cols):
    """reduce_scatter and scatter of a (size * k, m) array return (k, m) blocks; a first axis
    that does not divide gives flat blocks. Values against NumPy."""
    n, r = comm.size, comm.rank
    shapes = [(n * rows_per_rank, cols), (n * rows_per_rank, 2, cols), (n * rows_per_rank + 1, n)]
    for shape in shapes:
        count = int(np.prod(shape))
        inputs = [data(q, count, "float32", "sum", salt=4).reshape(shape) for q in range(n)]
        block = count // n
        want_shape = (shape[0] // n,) + shape[1:] if shape[0] % n == 0 else (block,)
        got = comm.reduce_scatter(inputs[r])
        assert got.shape == want_shape, (shape, got.shape)
        full = reduce_ref([a.reshape(-1) for a in inputs], "sum", "float32")
        check_equal(got.reshape(-1), full[r * block:(r + 1) * block], f"reduce_scatter {shape}")
        got = comm.scatter(inputs[0] if r == 0 else None, root=0, out=None if r == 0 else np.empty(want_shape, np.float32))
        assert got.shape == want_shape, (shape, got.shape)
        check_equal(got.reshape(-1), inputs[0].reshape(-1)[r * block:(r + 1) * block], f"scatter {shape}")
    return True


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 700])  # the shared-memory exchange (small) and messages
def test_reduce_scatter_and_scatter_blocks_keep_trailing_axes(n, rows):
    assert all(run_ranks(n, _block_shape_body, rows, 5))
    if n == 2:
        assert all(run_ranks(n, _block_shape_body, rows, 5, env={"LINKWISE_ALGO": "ring"}))

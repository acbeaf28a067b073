"""asyncio and request edges: what a cancel, a closed event loop or a dropped request leaves
behind (each test says what went wrong before)."""
import asyncio
import gc
import weakref

import numpy as np
import pytest

from multirank import run_ranks


def _cancelled_as_it_finishes(comm, what):
    """Two tasks await one request; the first to wake cancels the other, whose wait is then
    done but whose task has not run yet. The cancelled task must end with CancelledError:
    through asyncio.wait_for (Python < 3.12) it got the finished wait's result and ran on.
    The waiting rank (0 in a collective, the receiver 1) is the one looked at: a peer late by
    0.3 s makes sure that both tasks wait there before the request is done."""
    async def main():
        if what == "collective":
            if comm.rank == 1:
                await asyncio.sleep(0.3)
            req = comm.all_reduce(np.ones(4), async_op=True)
        else:
            if comm.rank == 0:
                await asyncio.sleep(0.3)
                comm.send(np.ones(4), 1, tag=1)
                return "sender"
            req = comm._post(np.zeros(4), 0, 1, False, True, None)  # what arecv awaits
        log = []

        async def consumer():
            await req
            log.append("ran on after the cancel")

        async def supervisor():
            await req
            victim.cancel()

        first = asyncio.create_task(supervisor())  # its future is the first one woken
        victim = asyncio.create_task(consumer())
        await first
        try:
            await victim
            return log
        except asyncio.CancelledError:
            return "cancelled"
    out = asyncio.run(main())
    comm.barrier()
    return out


@pytest.mark.parametrize("what", ["receive", "collective"])
def test_a_task_cancelled_as_its_operation_finishes_is_cancelled(what):
    out = run_ranks(2, _cancelled_as_it_finishes, what, env={"LINKWISE_TIMEOUT": "10"}, timeout=60)
    assert out[0 if what == "collective" else 1] == "cancelled", out


def _receive_left_in_a_closed_loop(comm):
    """An arecv task left pending in an event loop that is then closed: its receive must be
    withdrawn once the task is collected, so that the next receive of that tag gets the
    message. A global table kept the task alive, and its receive posted: it took the message
    into the abandoned buffer and the new receive timed out."""
    if comm.rank == 0:
        comm.barrier()
        comm.send(np.full(4, 7.0), 1, tag=5)
        comm.barrier()
        return None
    abandoned = np.zeros(4)
    loop = asyncio.new_event_loop()
    task = loop.create_task(comm.arecv(abandoned, 0, tag=5, timeout=10))
    loop.run_until_complete(asyncio.sleep(0.05))  # the task waits in its arecv
    loop.close()
    del task, loop
    gc.collect()
    comm.barrier()
    got = np.zeros(4)
    try:
        comm.recv(got, 0, tag=5, timeout=3)
        outcome = got.tolist()
    except Exception as exc:  # noqa: BLE001 - reported
        outcome = type(exc).__name__
    comm.barrier()
    return outcome, abandoned.tolist()


def test_a_receive_left_in_a_closed_loop_is_withdrawn():
    out = run_ranks(2, _receive_left_in_a_closed_loop, env={"LINKWISE_TIMEOUT": "10"}, timeout=60)
    assert out[1] == ([7.0] * 4, [0.0] * 4), out


def _dropped_async_requests(comm):
    """Async collectives whose requests are dropped at once (fire and forget): their arrays
    must be let go once the collectives are done. They were kept for good (8 MiB each here).
    Returns (on rank 0, whether all its arrays were still held while every one of its
    collectives was pending: rank 1 calls them only after; the arrays left once all are done)."""
    comm.barrier()
    if comm.rank == 1:
        comm.recv(np.zeros(1), 0, tag=9)  # rank 0's collectives are all pending until this
    alive = []
    for _ in range(6):
        x, part, gathered = np.ones(1 << 17), np.ones(1 << 14), np.empty(2 << 14)
        alive += [weakref.ref(x), weakref.ref(part), weakref.ref(gathered)]
        comm.all_reduce(x, async_op=True)
        comm.all_gather(part, out=gathered, async_op=True)
        del x, part, gathered
    held_while_pending = None
    if comm.rank == 0:
        gc.collect()
        held_while_pending = all(ref() is not None for ref in alive)
        comm.send(np.ones(1), 1, tag=9)
    comm.barrier()  # after all of them
    comm.all_reduce(np.ones(4))
    gc.collect()
    return held_while_pending, sum(ref() is not None for ref in alive)


@pytest.mark.parametrize("algo", ["", "ring"])
def test_dropped_async_collective_requests_let_their_arrays_go(algo):
    env = {"LINKWISE_TIMEOUT": "10", "LINKWISE_ALGO": algo}
    assert run_ranks(2, _dropped_async_requests, env=env, timeout=60) == [(True, 0), (None, 0)]


def _coroutine_cancelled_before_it_ran(comm):
    """Rank 0 cancels an aall_reduce task before it first ran. The collective must still be
    issued (as on rank 1): it was issued at the task's first step, so rank 0 skipped it, and
    its next all_reduce paired with rank 1's skipped one (a wrong sum, silently)."""
    x = np.full(4, 1.0 + comm.rank)
    y = np.full(4, 10.0 * (1 + comm.rank))

    async def main():
        task = asyncio.create_task(comm.aall_reduce(x))
        if comm.rank == 0:
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        comm.all_reduce(y)
        bad = comm.aall_reduce(np.ones(4), op="nope")  # an argument error: raised where awaited
        with pytest.raises(ValueError, match="nope"):
            await bad
    asyncio.run(main())
    comm.barrier()
    return x.tolist(), y.tolist()


@pytest.mark.parametrize("env", [{}, {"LINKWISE_ALGO": "ring"}])
def test_a_coroutine_collective_cancelled_before_it_ran_still_takes_its_turn(env):
    out = run_ranks(2, _coroutine_cancelled_before_it_ran, env=dict(env, LINKWISE_TIMEOUT="5"), timeout=60)
    assert out == [([3.0] * 4, [30.0] * 4)] * 2, out


def _send_dropped_while_moving(comm):
    """Rank 0 drops an isend of 16 MiB once its bytes started moving (too late to withdraw: it
    finishes in later calls). Its array must be held until the send is done, then let go (at
    the next send or receive): it was kept for good."""
    n = 16 << 20
    if comm.rank == 1:
        comm._store.get("test/dropped-checked")  # the peer has looked at its dropped send first
        got = np.zeros(n, np.uint8)
        comm.recv(got, 0, tag=1)
        comm.send(np.ones(1), 0, tag=2)
        comm.recv(np.zeros(1), 0, tag=3)
        return bool((got == 7).all())
    x = np.full(n, 7, np.uint8)
    alive = weakref.ref(x)
    req = comm.isend(x, 1, tag=1)
    for _ in range(5):
        req.test()  # moves what the link takes now (announces it, or fills the socket)
    done_when_dropped = req.done
    del req, x
    reply = comm.irecv(np.zeros(1), 1, tag=2)  # a post: lets go of the dropped sends that are done
    gc.collect()
    held_while_moving = alive() is not None  # not this one: the peer has not received it yet
    comm._store.set("test/dropped-checked", b"1")  # (a store key: not behind the 16 MiB send)
    reply.wait()  # moves the rest of the dropped send
    comm.send(np.ones(1), 1, tag=3)
    gc.collect()
    return done_when_dropped, held_while_moving, alive() is None


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_send_dropped_while_moving_lets_its_array_go(transport):
    env = {"LINKWISE_TRANSPORT": transport, "LINKWISE_TIMEOUT": "10"}
    out = run_ranks(2, _send_dropped_while_moving, env=env, timeout=60)
    assert out == [(False, True, True), True], out


def _never_awaited_warning(comm):
    import warnings
    x = np.arange(4, dtype=np.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        coro = comm.aall_reduce(x)  # issued now; never awaited
        name = coro.__qualname__
        del coro
        gc.collect()
    comm.barrier()
    return name, [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)], x.tolist()


def test_a_never_awaited_coroutine_collective_is_named_in_the_warning():
    """The a* methods return a coroutine of a shared helper; Python's "never awaited" warning
    named `_await_request`, not the method the user called. The collective itself still ran."""
    for name, warned, x in run_ranks(2, _never_awaited_warning, timeout=60):
        assert name == "Communicator.aall_reduce"
        assert any("Communicator.aall_reduce" in w for w in warned), warned
        assert x == [0.0, 2.0, 4.0, 6.0]  # in place, summed over 2 ranks: it ran


def _async_p2p_errors(comm):
    async def main():
        said = []
        for f in (lambda: comm.asend(np.ones(2), comm.size + 3), lambda: comm.arecv(np.ones(2), 0, timeout=-1)):
            try:
                await f()
            except ValueError as exc:
                said.append(str(exc))
        return said
    return asyncio.run(main())


def test_asend_and_arecv_errors_name_the_call_made():
    """Errors of `await comm.asend(...)` / `arecv(...)` said isend / irecv (the shared post)."""
    for said in run_ranks(2, _async_p2p_errors, timeout=60):
        assert len(said) == 2 and said[0].startswith("asend:") and said[1].startswith("arecv:"), said

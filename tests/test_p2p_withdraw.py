"""A send that fails after it was announced (its wait timed out, or its task was cancelled) must
never deliver bytes the sender's user wrote afterwards. Over shared memory a large message is
copied straight out of the sender's buffer (single-copy), possibly long after it was announced;
the sender withdraws it before failing, and the receiver's copy then raises PeerError."""
import asyncio
import os
import time

import numpy as np
import pytest

from multirank import run_ranks

N = 300_000  # 2.4 MB of float64: past the single-copy threshold


def _wait_for_file(path, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _reuse_after_failed_send(comm, form, flag_dir):
    """Rank 0's send fails, it overwrites the buffer (99), then rank 1 receives."""
    import linkwise
    overwritten, received = os.path.join(flag_dir, "overwritten"), os.path.join(flag_dir, "received")
    if comm.rank == 0:
        buf = np.full(N, 11.0)
        if form == "wait":
            req = comm.isend(buf, 1, tag=6)
            try:
                req.wait(timeout=0.3)
                sent = "completed"  # possible over TCP: the bytes fit in the socket buffers
            except linkwise.TimeoutError:
                sent = "timed out"
        else:
            async def send():
                await asyncio.wait_for(comm.asend(buf, 1, tag=6), 0.3)
            with pytest.raises(asyncio.TimeoutError):
                asyncio.run(send())
            sent = "timed out"
        buf[:] = 99.0
        open(overwritten, "w").close()
        _wait_for_file(received)  # keep this process (and its memory) alive meanwhile
        return sent
    _wait_for_file(overwritten)
    got = np.zeros(N)
    try:
        comm.recv(got, 0, tag=6, timeout=10)
        outcome = ("received", np.unique(got).tolist())
    except linkwise.PeerError as exc:
        outcome = ("PeerError", "withdrew" in str(exc) or "aborted" in str(exc))
    finally:
        open(received, "w").close()
    return outcome


@pytest.mark.parametrize("form", ["wait", "wait_for"])
def test_failed_large_send_never_delivers_later_bytes(form, tmp_path, shm_clean):
    # Over shared memory the receiver copies after the overwrite: it must refuse the copy.
    out = run_ranks(2, _reuse_after_failed_send, form, str(tmp_path), env={"LINKWISE_TRANSPORT": "shm"})
    assert out == ["timed out", ("PeerError", True)]


def test_failed_large_send_over_tcp(tmp_path):
    # Over TCP the bytes that reached the socket are the original ones, or the receive fails.
    out = run_ranks(2, _reuse_after_failed_send, "wait", str(tmp_path), env={"LINKWISE_TRANSPORT": "tcp"})
    # Whether the send's wait timed out depends on the socket buffers; either way no 99 arrives.
    assert out[0] in ("timed out", "completed")
    assert out[1] in (("received", [11.0]), ("PeerError", True)), out


def _cancel_a_receive_loop(comm):
    """A consumer task loops on arecv; the message arrives while the loop is busy, then the
    task is cancelled: it must stop (CancelledError), even though its arecv had finished. A
    version that returned the finished receive's result swallowed the cancel, and the loop
    kept receiving (the next 3 messages) until its caller gave up."""
    comm.barrier()
    if comm.rank == 0:
        time.sleep(0.5)
        for i in range(3):
            comm.send(np.full(4, float(i)), 1, tag=1)
        comm.barrier()
        return None

    async def consumer(log):
        while True:
            buf = np.zeros(4)
            await comm.arecv(buf, 0, tag=1, timeout=5)
            log.append(float(buf[0]))

    async def main():
        log = []
        task = asyncio.create_task(consumer(log))
        await asyncio.sleep(0.2)  # the consumer waits in arecv
        time.sleep(1.0)  # the loop is busy; the message arrives meanwhile
        task.cancel()
        try:
            await asyncio.wait_for(task, 3)
            return "returned"
        except asyncio.CancelledError:
            return "cancelled"
        except asyncio.TimeoutError:
            return "still running"

    outcome = asyncio.run(main())
    comm.barrier()
    return outcome


def test_cancel_stops_a_task_whose_arecv_just_finished():
    assert run_ranks(2, _cancel_a_receive_loop, env={"LINKWISE_TIMEOUT": "10"}, timeout=60)[1] == "cancelled"


def _two_tasks_await_one_request(comm, what):
    """Two tasks await one request; both must wake when it ends (before, the second task's
    add_reader replaced the first's, which slept until the request's timeout, 4 s here)."""
    async def main():
        if what == "collective":
            if comm.rank == 1:
                await asyncio.sleep(0.5)
            req = comm.all_reduce(np.ones(4), async_op=True)
        else:
            if comm.rank == 1:
                await asyncio.sleep(0.5)
                comm.send(np.ones(4), 0, tag=1)
                return [0.0, 0.0]
            req = comm._post(np.zeros(4), 1, 1, False, True, None)  # what arecv awaits (a driven request)

        async def waiter():
            t0 = time.monotonic()
            await req
            return time.monotonic() - t0

        return await asyncio.gather(waiter(), waiter())
    return asyncio.run(main())


@pytest.mark.parametrize("what", ["collective", "receive"])
def test_two_tasks_awaiting_one_request_both_wake(what):
    out = run_ranks(2, _two_tasks_await_one_request, what, env={"LINKWISE_TIMEOUT": "4"}, timeout=60)
    for seconds in out:
        assert max(seconds) < 2.5, out


def _send_times_out_mid_message(comm):
    """Rank 0's 16 MiB send times out while rank 1 is busy; rank 0 lives on (its communicator
    aborted, not closed). Rank 1's receive must raise PeerError at once: before, nobody told
    it, and it waited for the rest of the message until its own timeout (TimeoutError)."""
    import linkwise
    n = 16 << 20
    if comm.rank == 0:
        try:
            comm.send(np.ones(n, np.uint8), 1, tag=3, timeout=0.5)
            sent = "sent"
        except linkwise.TimeoutError:
            sent = "TimeoutError"
        comm_ = comm  # noqa: F841 - alive, not closed, while rank 1 receives
        time.sleep(6)
        return sent
    time.sleep(1.5)
    t0 = time.monotonic()
    try:
        comm.recv(np.zeros(n, np.uint8), 0, tag=3, timeout=20)
        got = "received"
    except (linkwise.PeerError, linkwise.TimeoutError) as exc:
        got = f"{type(exc).__name__}: {exc}"
    return got, time.monotonic() - t0


@pytest.mark.parametrize("transport", ["tcp", "shm-ring"])
def test_a_send_that_times_out_mid_message_tells_the_peer(transport):
    env = {"LINKWISE_TIMEOUT": "20"}
    env.update({"LINKWISE_TRANSPORT": "tcp"} if transport == "tcp" else {"LINKWISE_SHM_RNDV_THRESHOLD": "1G"})
    out = run_ranks(2, _send_times_out_mid_message, env=env, timeout=90)
    assert out[0] == "TimeoutError", out
    # rank 0 is alive: the message says it may have aborted (it said "exited or closed")
    assert out[1][0].startswith("PeerError") and "closed or aborted" in out[1][0] and out[1][1] < 3, out


def _send_times_out_while_a_collective_runs(comm):
    """Rank 0's all_reduce (a ring over TCP) waits for rank 2, asleep, on one thread, while its
    send to rank 2 times out mid-message on another. Rank 1, in the same all_reduce and waiting
    for rank 0's next chunk, must be released at once. Before, the send's notice named the
    next collective only, the all_reduce's own notice was never sent (only the first went
    out), and rank 1 waited until rank 2 woke and failed too."""
    import threading

    import linkwise
    comm.barrier()
    x = np.ones(1 << 18, np.float32)
    if comm.rank == 0:
        coll = []

        def all_reduce():
            try:
                comm.all_reduce(x)
                coll.append("ok")
            except linkwise.LinkwiseError as exc:
                coll.append(type(exc).__name__)
        t = threading.Thread(target=all_reduce)
        t.start()
        time.sleep(0.3)
        try:
            comm.send(np.ones(16 << 20, np.uint8), 2, tag=3, timeout=0.5)
            sent = "sent"
        except linkwise.TimeoutError:
            sent = "TimeoutError"
        t.join()
        time.sleep(9)  # alive while the others look
        return sent, coll
    if comm.rank == 2:
        time.sleep(8)
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        got = "ok"
    except linkwise.LinkwiseError as exc:
        got = type(exc).__name__
    return got, time.monotonic() - t0


def test_a_send_that_times_out_stops_a_collective_running_on_another_thread():
    env = {"LINKWISE_TIMEOUT": "20", "LINKWISE_TRANSPORT": "tcp", "LINKWISE_ALGO": "ring"}
    out = run_ranks(3, _send_times_out_while_a_collective_runs, env=env, timeout=90)
    assert out[0] == ("TimeoutError", ["CommAbortedError"]), out
    assert out[1][0] in ("PeerError", "CommAbortedError") and out[1][1] < 4, out
    assert out[2][0] in ("PeerError", "CommAbortedError"), out

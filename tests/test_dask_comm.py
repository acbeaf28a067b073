"""The Dask comm backend (linkwise/dask_comm.py): messages of every shape arrive whole, frames
between processes of one host go by address (and the writer's buffers are free once write()
returns), a peer that dies or closes fails the other side's calls, and a scheduler and a
worker in another process run tasks over ``linkwise://``."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
import weakref

import numpy as np
import pytest

from distributed.comm import CommClosedError, connect, listen
from distributed.protocol import to_serialize

import linkwise
from linkwise import dask_comm  # noqa: F401 - registers linkwise:// (installed: the entry point too)

# Where the linkwise under test was imported from (site-packages after `pip install .`, or a
# source tree with the built extension): the peer processes must import the same one.
SRC = os.path.dirname(os.path.dirname(os.path.abspath(linkwise.__file__)))
# A peer process: listens on linkwise://, sends back every message it reads (ECHO), or with
# "die" ends its process in the middle of reading one.
PEER = textwrap.dedent("""
    import asyncio, os, sys, time
    import numpy as np
    from distributed.comm import listen
    from linkwise import dask_comm

    async def main(mode):
        async def handle(comm):
            if mode == "stall":  # blocks its loop a while, then prints what it gets
                time.sleep(2)
            while True:
                try:
                    msg = await comm.read()
                except Exception as exc:
                    print("ended", type(exc).__name__, flush=True)
                    os._exit(0) if mode == "stall" else None
                    return
                if mode == "die":  # ends its process after the first message
                    os._exit(3)
                if mode == "stall":
                    print("got", int(np.asarray(msg["x"]).sum()), flush=True)
                    continue
                await comm.write(msg)
        listener = listen("linkwise://127.0.0.1:0", handle)
        await listener.start()
        print(listener.contact_address, flush=True)
        await asyncio.sleep(120)

    asyncio.run(main(sys.argv[1]))
""")


def _messages():
    rng = np.random.default_rng(7)
    return [
        {"op": "small", "x": 1},
        {"op": "empty", "x": np.zeros(0, np.float32)},
        {"op": "odd", "x": rng.integers(0, 255, 1001, dtype=np.uint8)},
        {"op": "big", "x": rng.standard_normal(3 << 20)},  # 24 MiB: by address, off the loop
        {"op": "many", "parts": [rng.standard_normal(n) for n in (10, 70_000, 300_000)]},
        {"op": "strided", "x": rng.standard_normal((600, 400))[:, ::2]},
        # Dask's own array serializer: frames typed as float64 / int32, which a socket call
        # counts in items, not bytes (they went out wrong before _byte_view)
        {"op": "typed", "x": to_serialize(rng.standard_normal(1000)), "y": to_serialize(np.arange(50_000, dtype=np.int32))},
    ]


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "data") and type(a).__name__ == "Serialize":
        a = a.data
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return a == b


def _start_peer(mode: str):
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", PEER, mode], stdout=subprocess.PIPE, env=env, text=True)
    return proc, proc.stdout.readline().strip()


def test_messages_round_trip_in_one_process():
    async def main():
        got = asyncio.Queue()

        async def handle(comm):
            while True:
                try:
                    await got.put(await comm.read())
                except CommClosedError:
                    return

        listener = listen("linkwise://127.0.0.1:0", handle)
        await listener.start()
        comm = await connect(listener.contact_address)
        assert not comm._send_by_address  # one process: nothing to read across
        for msg in _messages():
            await comm.write(msg)
            assert _same(msg, await asyncio.wait_for(got.get(), 30))
        await comm.close()
        listener.stop()

    asyncio.run(main())


def test_frames_go_by_address_between_processes_and_buffers_are_free_after_write():
    proc, address = _start_peer("echo")
    try:
        async def main():
            comm = await connect(address)
            assert comm._send_by_address and comm._read_by_address  # this VM allows CMA
            for msg in _messages():
                await comm.write(msg)
                assert _same(msg, await asyncio.wait_for(comm.read(), 60)), msg["op"]
            assert comm.frames_by_address >= 4  # big, many (two parts), strided's copy
            # write() returned only after the peer copied: overwriting now changes nothing sent
            x = np.arange(1 << 20, dtype=np.int64)
            sent = comm.frames_by_address
            await comm.write({"x": to_serialize(x)})
            assert comm.frames_by_address == sent + 1
            x[:] = -1
            echoed = await asyncio.wait_for(comm.read(), 60)
            assert np.array_equal(echoed["x"], np.arange(1 << 20, dtype=np.int64))
            await comm.close()
            assert comm.closed()
            with pytest.raises(CommClosedError):
                await comm.write({"after": "close"})

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


def test_a_peer_that_dies_fails_the_calls_waiting_on_it():
    proc, address = _start_peer("die")
    try:
        async def main():
            comm = await connect(address)
            await comm.write({"x": to_serialize(np.ones(1 << 20))})  # read whole; then the peer exits
            with pytest.raises(CommClosedError):
                # by address to a dead peer: no ack will come; the write must raise, not hang
                for _ in range(50):
                    await asyncio.wait_for(comm.write({"x": to_serialize(np.ones(1 << 20))}), 30)
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(comm.read(), 30)

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


WORKER = textwrap.dedent("""
    import asyncio, sys
    from distributed import Worker
    from linkwise import dask_comm

    async def main(address):
        async with Worker(address, nthreads=1, protocol="linkwise") as w:
            await w.finished()

    asyncio.run(main(sys.argv[1]))
""")


def test_scheduler_and_worker_in_another_process_run_tasks():
    from distributed import Client, Scheduler

    async def main():
        async with Scheduler(protocol="linkwise", port=0, dashboard_address=":0") as s:
            assert s.address.startswith("linkwise://")
            env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
            proc = subprocess.Popen([sys.executable, "-c", WORKER, s.address], env=env)
            try:
                async with Client(s.address, asynchronous=True) as client:
                    await client.wait_for_workers(1, timeout=60)
                    x = np.arange(2_000_000, dtype=np.float64)
                    future = client.submit(lambda a: a * 2, x)
                    y = await future
                    assert np.array_equal(y, x * 2)
                    total = await client.submit(np.sum, future)
                    assert total == float(np.sum(x * 2))
            finally:
                proc.kill()
                proc.wait()

    asyncio.run(main())


def test_local_cluster_moves_data_between_worker_processes():
    """The usual entry: LocalCluster(protocol="linkwise://"), whose worker processes find the
    backend through the package's entry point; a reduction over chunks made on both workers
    moves arrays between them."""
    import dask.array as da
    from distributed import Client, LocalCluster

    with LocalCluster(protocol="linkwise://", n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        assert cluster.scheduler_address.startswith("linkwise://")
        assert all(a.startswith("linkwise://") for a in client.scheduler_info()["workers"])
        x = da.arange(8_000_000, chunks=1_000_000, dtype=np.float64)
        y = (x.reshape(8, 1_000_000).T @ np.ones(8)).persist()  # every row needs all chunks
        assert float(y.sum().compute()) == float(np.arange(8_000_000, dtype=np.float64).sum())


async def _until(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_a_write_given_up_before_its_ack_is_never_delivered(how):
    """A write cancelled (a timeout around it) or a comm closed while the peer has not yet
    copied the frames: the caller may change them right away, so the peer must never deliver
    them (it did, with the changed bytes: QA repro); the comm ends."""
    proc, address = _start_peer("stall")
    try:
        async def main():
            comm = await connect(address)
            x = np.ones(1 << 20, np.int64)  # 8 MiB: by address
            write = asyncio.ensure_future(comm.write({"x": to_serialize(x)}))
            await asyncio.sleep(0.5)  # the peer's loop is blocked: no ack yet
            if how == "cancel":
                write.cancel()
            else:
                await comm.close()
            with pytest.raises((asyncio.CancelledError, CommClosedError)):
                await write
            assert comm.closed()
            x[:] = 7  # the caller reuses its buffer

        asyncio.run(main())
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert "got" not in out, out  # neither 8 Mi ones nor sevens
    assert "ended CommClosedError" in out, out


def test_close_wakes_a_write_blocked_in_the_socket():
    """close() while a large inline write waits for socket room (the peer not reading): the
    write raises at once (it hung: its fd was closed under it)."""
    proc, address = _start_peer("stall")
    try:
        async def main():
            comm = await connect(address)
            parts = [to_serialize(np.full(50_000, i, np.float64)) for i in range(60)]  # 24 MB inline
            write = asyncio.ensure_future(comm.write({"x": 0, "parts": parts}))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await comm.close()
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(write, 10)
            assert time.monotonic() - t0 < 2

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


def test_listener_lifetime_and_dropped_comms():
    """A connection that never says hello ends with stop(); a handler that raises closes its
    comm (the client's read raises); a comm dropped without close() is collected, and the
    other side sees it closed; IPv6 loopback works."""
    import gc
    import socket as sockets

    async def main():
        async def handler(comm):
            if (await comm.read()) == "raise":
                raise RuntimeError("handler failed on purpose")
            await comm.read()  # the dropped client's side: ends when it is gone

        listener = listen("linkwise://127.0.0.1:0", handler)
        await listener.start()
        host, port = listener._sock.getsockname()[:2]
        silent = sockets.create_connection((host, port))
        await _until(lambda: len(listener._handshaking) == 1)
        raising = await connect(listener.contact_address)
        await raising.write("raise")
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(raising.read(), 10)
        dropped = await connect(listener.contact_address)
        ref = weakref.ref(dropped)
        del dropped
        gc.collect()
        assert ref() is None
        listener.stop()
        await _until(lambda: not listener._handshaking)
        silent.settimeout(5)
        while silent.recv(4096):  # the listener's hello, then the end of the stream
            pass
        silent.close()
        v6 = listen("linkwise://[::1]:0", lambda comm: None)
        try:
            await v6.start()
        except OSError:  # no IPv6 on this host
            return
        assert v6.contact_address.startswith("linkwise://[::1]:")
        c = await connect(v6.contact_address)
        await c.close()
        v6.stop()

    asyncio.run(main())


@pytest.mark.parametrize("closed_by", ["peer", "reader"])
def test_messages_read_after_a_close(closed_by):
    """Messages the peer sent before it closed are still read, then CommClosedError (as
    tcp:// reads the rest of its stream); after this side closes, read() raises at once (as
    tcp://), although messages were queued (it returned them before)."""
    async def main():
        comms = asyncio.Queue()
        listener = listen("linkwise://127.0.0.1:0", comms.put)
        await listener.start()
        writer = await connect(listener.contact_address)
        reader = await asyncio.wait_for(comms.get(), 30)
        for i in range(2):
            await writer.write({"i": i})
        await _until(lambda: reader._messages.qsize() == 2)
        if closed_by == "peer":
            await writer.close()
            await _until(lambda: reader._closed)  # the reader task has seen the end
            assert not reader.closed()  # while messages sent before it are unread (as tcp://)
            assert [await reader.read() for _ in range(2)] == [{"i": 0}, {"i": 1}]
            assert reader.closed()
        else:
            await reader.close()
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(reader.read(), 30)
        await writer.close()
        await reader.close()
        listener.stop()

    asyncio.run(main())

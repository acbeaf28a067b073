"""The Dask comm backend at its edges, each as tcp:// behaves: a peer's close does not hide the
messages it sent before (Server.handle_comm stops at closed()), a read given up in the middle
ends the comm, the listener outlives a failed accept and a malformed handshake, shards of a
large frame arrive joinable without a copy, and Dask's address helpers work."""
from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("distributed")
from distributed.comm import CommClosedError, connect, get_address_host_port, listen  # noqa: E402
from distributed.core import Server  # noqa: E402
from distributed.protocol.utils import merge_memoryviews  # noqa: E402

from linkwise import _dask_wire, dask_comm  # noqa: E402
from test_dask_comm import SRC  # noqa: E402


def _run(coro, timeout=60):
    asyncio.run(asyncio.wait_for(coro, timeout))


async def _pair():
    """A listener and the two ends of one comm to it: (listener, writer, reader)."""
    comms = asyncio.Queue()
    listener = listen("linkwise://127.0.0.1:0", comms.put)
    await listener.start()
    writer = await connect(listener.contact_address)
    return listener, writer, await comms.get()


def test_messages_sent_before_the_peer_closed_are_all_handled():
    async def main():
        handled = []

        async def op(i):
            await asyncio.sleep(0.05)  # the handler takes a while: the close arrives meanwhile
            handled.append(i)

        server = Server({"op": op})
        await server.listen("linkwise://127.0.0.1:0")
        comm = await connect(server.address)
        for i in range(3):
            await comm.write({"op": "op", "i": i, "reply": False})
        await comm.close()
        for _ in range(100):
            if len(handled) == 3:
                break
            await asyncio.sleep(0.05)
        server.stop()
        assert handled == [0, 1, 2]

    _run(main())


def test_closed_turns_true_once_the_last_message_is_read():
    async def main():
        listener, writer, reader = await _pair()
        await writer.write({"i": 0})
        await writer.close()
        await asyncio.sleep(0.3)  # the reader task has seen the end by now
        assert not reader.closed()
        assert (await reader.read())["i"] == 0
        assert reader.closed()
        with pytest.raises(CommClosedError):
            await reader.read()
        listener.stop()

    _run(main())


def test_a_read_cancelled_while_deserialising_ends_the_comm(monkeypatch):
    """Over the socket the message is gone once read() took it: going on would hand the next
    read the message after it, one short and without a word."""
    started = asyncio.Event

    async def main():
        taken = started()

        async def slow_from_frames(*args, **kwargs):  # a large message deserialised in a thread
            taken.set()
            await asyncio.sleep(60)

        listener, writer, reader = await _pair()
        await writer.write({"i": 0})
        await writer.write({"i": 1})
        monkeypatch.setattr(dask_comm, "from_frames", slow_from_frames)
        task = asyncio.ensure_future(reader.read())
        await taken.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert reader.closed()
        with pytest.raises(CommClosedError):
            await reader.read()
        await writer.close()
        listener.stop()

    _run(main())


def test_listener_survives_a_failed_accept():
    """EMFILE (out of file descriptors) used to end the accept loop for good."""
    async def main():
        loop = asyncio.get_running_loop()
        real_accept, failures = loop.sock_accept, []

        async def flaky_accept(sock):
            if len(failures) < 2:
                failures.append(1)
                await asyncio.sleep(0)
                raise OSError(errno.EMFILE, "Too many open files")
            return await real_accept(sock)

        loop.sock_accept = flaky_accept

        async def echo(comm):
            await comm.write(await comm.read())

        listener = listen("linkwise://127.0.0.1:0", echo)
        await listener.start()
        comm = await connect(listener.contact_address, timeout=10)
        await comm.write({"x": 5})
        assert (await asyncio.wait_for(comm.read(), 10))["x"] == 5
        assert len(failures) == 2
        await comm.close()
        listener.stop()

    _run(main())


def _this_host_hello(**fields) -> bytes:
    from linkwise._setup import host_identity
    import json
    return json.dumps({"host": host_identity(), "pid": os.getpid(), "probe": 0, "value": 0, "live": 0,
                       "token": 1} | fields).encode()


@pytest.mark.parametrize("body", [b"[]", b'{"x": 1}', b"not json", b'{"host": "h", "pid": -1, "probe": 0, '
                                  b'"value": 0, "live": 0}', "pid 2**63", "token 0"])
def test_malformed_hello_closes_that_connection_only(body):
    """A pid of 2**63 from this host reached the native probe, whose TypeError ended the
    listener's task with the connection left open; a zero token would pass any freed word."""
    if body == "pid 2**63":
        body = _this_host_hello(pid=1 << 63)
    elif body == "token 0":
        body = _this_host_hello(token=0)
    async def main():
        async def echo(comm):
            await comm.write(await comm.read())

        listener = listen("linkwise://127.0.0.1:0", echo)
        await listener.start()
        host, port = get_address_host_port(listener.contact_address)
        loop = asyncio.get_running_loop()
        raw = socket.create_connection((host, port))
        raw.setblocking(False)
        await loop.sock_sendall(raw, _dask_wire.HEAD.pack(_dask_wire.MAGIC, _dask_wire.HELLO, len(body)) + body)
        rest = b""
        while True:  # the server's HELLO, then the end of the stream (not a hang)
            chunk = await asyncio.wait_for(loop.sock_recv(raw, 4096), 10)
            if not chunk:
                break
            rest += chunk
        raw.close()
        assert not listener._handshaking and not listener._tasks
        comm = await connect(listener.contact_address)  # the listener goes on
        await comm.write({"x": 1})
        assert (await asyncio.wait_for(comm.read(), 10))["x"] == 1
        await comm.close()
        listener.stop()

    _run(main())


def test_address_helpers():
    assert get_address_host_port("linkwise://127.0.0.1:8786") == ("127.0.0.1", 8786)
    assert get_address_host_port("linkwise://[::1]:99") == ("::1", 99)


def test_empty_frames_of_any_shape():
    for shape in [(0,), (0, 5), (3, 0, 2)]:
        assert _dask_wire.byte_view(np.zeros(shape)).nbytes == 0
    assert _dask_wire.byte_view(np.arange(6.0).reshape(2, 3)).nbytes == 48


def _peer(handler: str, lifetime: float) -> str:
    """A peer program: a linkwise:// listener whose handler is ``handler`` (the body of
    ``async def handle(comm)``, indented 8), printing its address, then living ``lifetime`` s."""
    return f"""
import asyncio, time
import numpy as np
from distributed.comm import listen
from distributed.protocol import to_serialize
from linkwise import dask_comm

async def main():
    async def handle(comm):
{handler}
    listener = listen("linkwise://127.0.0.1:0", handle)
    await listener.start()
    print(listener.contact_address, flush=True)
    await asyncio.sleep({lifetime})

asyncio.run(main())
"""


# A peer that, once connected to, sends one 80 MiB array through Dask's array serializer.
SENDER = _peer("""\
        await comm.write({"x": to_serialize(np.arange(10 << 20, dtype=np.int64))})
        await comm.read()  # until the test closes""", 120)


def test_shards_of_a_large_frame_arrive_joinable():
    """Dask cuts a frame over 64 MiB into shards and joins them without a copy only where they
    are adjacent views of one buffer (as tcp:// delivers them); each arrived in a buffer of
    its own before."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", SENDER], stdout=subprocess.PIPE, env=env, text=True)

    async def main():
        comm = await connect(proc.stdout.readline().strip())
        assert comm._read_by_address
        frames = await asyncio.wait_for(comm._messages.get(), 60)  # before deserialising
        big = [f for f in frames if f.nbytes >= dask_comm.CMA_MIN]
        assert [f.nbytes for f in big] == [64 << 20, 16 << 20]
        joined = merge_memoryviews(big)  # raises where they are not adjacent in one buffer
        assert np.array_equal(np.frombuffer(joined, np.int64), np.arange(10 << 20, dtype=np.int64))
        await comm.close()

    try:
        _run(main(), timeout=120)
    finally:
        proc.kill()
        proc.wait()


def test_sockets_get_tcp_keepalive():
    async def main():
        listener, writer, reader = await _pair()
        for comm in (writer, reader):
            assert comm._sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        await writer.close()
        await reader.close()
        listener.stop()

    _run(main())


def test_abort_from_another_thread_ends_the_comm_on_its_loop():
    """Dask's rpc.__del__ may abort a comm from a thread without a loop: the work is handed
    to the comm's own loop (asyncio's queue and futures are not thread-safe)."""
    async def main():
        listener, writer, reader = await _pair()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, writer.abort)
        assert writer.closed()
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(reader.read(), 10)  # the peer sees the end
        listener.stop()

    _run(main())


# A peer whose handler keeps its event loop busy for 2 s before reading: the frames of the
# message written meanwhile are copied (and the writer's live word read) only after that.
BUSY_READER = _peer("""\
        time.sleep(2)
        try:
            msg = await comm.read()
            print("DELIVERED", np.unique(np.asarray(msg["x"])).tolist(), flush=True)
        except Exception as exc:
            print("not delivered:", type(exc).__name__, flush=True)""", 6)


def test_a_given_up_write_is_not_delivered_after_its_comm_is_freed():
    """The live word was a small array freed with the comm; NumPy gave its 8 bytes to the next
    small array, whose non-zero value the peer took for "live": it delivered the cancelled
    message, with the bytes the caller wrote into its buffer afterwards."""
    import gc

    from distributed.protocol import to_serialize
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", BUSY_READER], stdout=subprocess.PIPE, env=env, text=True)

    async def main():
        comm = await connect(proc.stdout.readline().strip())
        assert comm._send_by_address
        x = np.ones(1 << 20, np.int64)  # 8 MiB: by address
        write = asyncio.ensure_future(comm.write({"x": to_serialize(x)}))
        await asyncio.sleep(0.5)
        write.cancel()
        with pytest.raises(BaseException):
            await write
        assert comm.closed()
        del comm, write
        await asyncio.sleep(0.1)
        gc.collect()
        keep = [np.full(1, 7, np.uint64) for _ in range(64)]  # small arrays where the word was
        x[:] = 7  # the caller's buffer is its own again
        await asyncio.sleep(3)
        return keep

    try:
        _run(main(), timeout=60)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert out.splitlines()[-1] == "not delivered: CommClosedError", out


def test_an_older_peers_hello_is_named_as_such():
    """A HELLO without the live token (linkwise before the token) is refused, saying why."""
    old = b'{"host": "h", "pid": 5, "probe": 0, "value": 0, "live": 1}'
    with pytest.raises(CommClosedError, match="no live token: an older linkwise"):
        _dask_wire._parse_hello(old)
    with pytest.raises(CommClosedError, match=r"malformed$"):
        _dask_wire._parse_hello(b"not json")

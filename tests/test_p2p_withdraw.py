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

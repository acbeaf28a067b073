"""comm.sendrecv (MPI_Sendrecv): rings of 1-8 ranks over shared memory and forced TCP, every
size class (eager, single-copy, copied by both sides), checked byte for byte; errors."""
import os
import signal
import time

import numpy as np
import pytest

from multirank import run_ranks, shm_of_this_process

# 0, tiny, odd, eager; single copy (64 KiB up); copied by both sides (256 KiB up), short pieces
SIZES = [0, 1, 7, 1000, 70_001, 300_007, (1 << 20) + 5]
DTYPES = [np.uint8, np.int32, np.float64]


def torch_tensor_or_none(x):
    """A CPU torch tensor sharing x's memory (the Python layer's path), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.from_numpy(x)


def _values(rank, n, dtype):
    return (np.arange(n) * (rank + 3) % 251).astype(dtype)


def _ring(comm):
    """Every rank sends to the next and receives from the previous in one call; send and
    receive tags differ, so a call that mixed them up would hang or take the wrong message."""
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    done = 0
    for dtype in DTYPES:
        for n in SIZES:
            out = np.full(n, 9, dtype)
            got = comm.sendrecv(_values(comm.rank, n, dtype), nxt, out, prv,
                                send_tag=n % 7 + 1, recv_tag=n % 7 + 1)
            assert got == out.nbytes, (got, out.nbytes)
            np.testing.assert_array_equal(out, _values(prv, n, dtype))
            done += 1
    # different tags each way: rank r sends with tag r, receives with tag prv
    out = np.zeros(5, np.int64)
    comm.sendrecv(np.full(5, comm.rank, np.int64), nxt, out, prv, send_tag=comm.rank, recv_tag=prv)
    assert (out == prv).all()
    return done


@pytest.mark.parametrize("nranks", [1, 2, 3, 5, 8])
def test_sendrecv_ring(nranks, transport_env, shm_clean):
    assert run_ranks(nranks, _ring, env=transport_env) == [len(DTYPES) * len(SIZES)] * nranks


def _torch_and_pairs(comm):
    """DLPack arrays (torch tensors) take the isend/irecv fallback; a pair exchange with
    sizes that differ by direction (each receive is sized for its sender)."""
    import torch
    peer = 1 - comm.rank
    x = torch.arange(1000, dtype=torch.float32) + comm.rank
    out = torch.zeros(1000, dtype=torch.float32)
    assert comm.sendrecv(x, peer, out, peer) == 4000
    assert torch.equal(out, torch.arange(1000, dtype=torch.float32) + peer)
    mine, theirs = (300_000, 12) if comm.rank == 0 else (12, 300_000)
    out = np.zeros(theirs, np.uint8)
    assert comm.sendrecv(np.full(mine, 40 + comm.rank, np.uint8), peer, out, peer, 4, 4) == theirs
    assert (out == 40 + peer).all()
    return "ok"


def test_sendrecv_torch_and_uneven_pairs(transport_env):
    pytest.importorskip("torch")
    assert run_ranks(2, _torch_and_pairs, env=transport_env) == ["ok", "ok"]


def _errors(comm):
    import linkwise
    peer = 1 - comm.rank
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="out of range"):
        comm.sendrecv(x, 2, x.copy(), peer)
    with pytest.raises(ValueError, match="out of range"):
        comm.sendrecv(x, peer, x.copy(), -1)
    with pytest.raises(ValueError, match="tag"):
        comm.sendrecv(x, peer, x.copy(), peer, recv_tag=-1)
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        comm.sendrecv(x, peer, ro, peer)
    # x and out sharing memory (MPI_Sendrecv_replace's case): refused before anything moves
    buf = np.arange(9, dtype=np.float32)
    for out in (buf, buf[1:], buf[:5]):
        with pytest.raises(ValueError, match="share memory"):
            comm.sendrecv(buf[:8], peer, out, peer, 9, 9)
    # a timeout that is not positive finite seconds (NaN never runs out; inf spun a core) is
    # refused before anything is posted, in every form
    # (the error names the call, from the native checks and from the Python layer alike)
    t = torch_tensor_or_none(x)
    for bad in (float("nan"), float("inf"), 0, -1.0):
        for name, call in (("sendrecv", lambda a: comm.sendrecv(a, peer, a.clone() if t is a else a.copy(), peer,
                                                                9, 9, timeout=bad)),
                           ("sendrecv_replace", lambda a: comm.sendrecv_replace(a, peer, peer, 9, 9, timeout=bad)),
                           ("recv", lambda a: comm.recv(a, peer, 9, timeout=bad)),
                           ("send", lambda a: comm.send(a, peer, 9, timeout=bad)),
                           ("irecv", lambda a: comm.irecv(a, peer, 9, timeout=bad)),
                           ("isend", lambda a: comm.isend(a, peer, 9, timeout=bad)),
                           ("wait_all", lambda a: linkwise.wait_all([], timeout=bad))):
            for a in (x, t) if t is not None else (x,):
                with pytest.raises(ValueError, match=f"^{name}: timeout .*positive finite"):
                    call(a)
    r = comm.irecv(x, peer, 9)
    for bad in (float("nan"), float("inf"), 0, -1.0):
        with pytest.raises(ValueError, match="^wait: timeout .*positive finite"):
            r.wait(timeout=bad)
    comm.send(np.full(4, comm.rank + 1, np.float32), peer, 9)
    assert r.wait() == 16 and (x == peer + 1).all()  # nothing of the refused calls was posted
    c = comm.all_reduce(np.ones(4, np.float32), async_op=True)  # an async collective's wait too
    for bad in (float("nan"), float("inf"), 0, -1.0):
        with pytest.raises(ValueError, match="positive finite"):
            c.wait(timeout=bad)
    assert (c.wait() == 2).all()
    x[:] = 0
    # a receive too small raises, and the message stays queued for a larger receive
    small, big = np.zeros(2, np.float32), np.zeros(8, np.float32)
    with pytest.raises(ValueError):
        comm.sendrecv(np.full(8, comm.rank, np.float32), peer, small, peer, 5, 5)
    assert comm.recv(big, peer, 5) == 32 and (big == peer).all()
    # the peer sends nothing with tag 7: the receive half times out, in about its timeout
    if comm.rank == 0:
        t0 = time.monotonic()
        with pytest.raises(linkwise.TimeoutError, match="did not complete within 0.3 s"):
            comm.sendrecv(np.ones(3, np.float32), 1, np.zeros(3, np.float32), 1, 6, 7, timeout=0.3)
        assert time.monotonic() - t0 < 5
        comm.send(np.zeros(1), 1, tag=8)
    else:
        comm.recv(np.zeros(1), 0, tag=8)  # rank 0 has timed out
        y = np.zeros(3, np.float32)
        assert comm.recv(y, 0, 6) == 12 and (y == 1).all()  # its send half was delivered
    comm.sendrecv(np.zeros(1), peer, np.zeros(1), peer, 9, 9)  # neither exits while the other waits
    return "ok"


def _post_errors(comm):
    """isend / irecv take a one-call path for plain arguments: every other case must still get
    _post's checks and conversions."""
    import torch

    import linkwise
    peer = 1 - comm.rank
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="out of range"):
        comm.isend(x, 2)
    with pytest.raises(ValueError, match="tag"):
        comm.irecv(x, peer, tag=-3)
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.irecv(np.zeros((4, 4), np.float32)[:, 1], peer)
    with pytest.raises(TypeError, match="buffer protocol"):
        comm.isend(object(), peer)
    # a DLPack tensor goes through the conversion, and wait returns the bytes moved
    t = torch.full((6,), float(comm.rank))
    out = torch.zeros(6)
    r = comm.irecv(out, peer, tag=2)
    assert comm.isend(t, peer, tag=2).wait() == 24
    assert r.wait() == 24 and bool((out == peer).all())
    comm.barrier()
    if comm.rank == 0:
        comm.close()
        with pytest.raises(linkwise.CommAbortedError, match="closed"):
            comm.isend(x, 1)
        with pytest.raises(linkwise.CommAbortedError, match="closed"):
            comm.link(1)
    return "ok"


def test_isend_irecv_argument_paths():
    pytest.importorskip("torch")
    assert run_ranks(2, _post_errors) == ["ok", "ok"]


def test_sendrecv_errors(transport_env):
    assert run_ranks(2, _errors, env=transport_env) == ["ok", "ok"]


def _killed(comm, size):
    import linkwise
    if comm.rank == 1:
        comm.recv(np.zeros(1), 0, tag=1)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.send(np.zeros(1), 1, tag=1)
    time.sleep(0.3)
    t0 = time.monotonic()
    with pytest.raises(linkwise.PeerError) as info:
        comm.sendrecv(np.ones(size, np.uint8), 1, np.zeros(size, np.uint8), 1, 2, 2, timeout=60)
    assert info.value.peer == 1
    assert time.monotonic() - t0 < 10
    return "raised"


@pytest.mark.parametrize("size", [8, 1 << 20])
def test_sendrecv_with_a_dead_peer_raises(size, transport_env, shm_clean):
    out = run_ranks(2, _killed, size, env=transport_env, expect_fail=True)
    assert out[0] == ("ok", "raised"), out[0]
    assert not shm_of_this_process()


def _replace_ring(comm):
    """comm.sendrecv_replace: x goes to the next rank and x then holds the previous rank's
    message; NumPy arrays of every size class and dtype, and a bytearray."""
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    done = 0
    for dtype in DTYPES:
        for n in SIZES:
            x = _values(comm.rank, n, dtype)
            assert comm.sendrecv_replace(x, nxt, prv, send_tag=3, recv_tag=3) == x.nbytes
            np.testing.assert_array_equal(x, _values(prv, n, dtype))
            done += 1
    b = bytearray([comm.rank] * 5)
    comm.sendrecv_replace(b, nxt, prv)
    assert b == bytearray([prv] * 5)
    return done


@pytest.mark.parametrize("nranks", [1, 2, 3, 5])
def test_sendrecv_replace_ring(nranks, transport_env, shm_clean):
    out = run_ranks(nranks, _replace_ring, env=transport_env)
    assert out == [len(DTYPES) * len(SIZES)] * nranks


def _replace_ring_torch(comm):
    """The same ring with torch CPU tensors (bfloat16 too, through DLPack)."""
    import torch
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for dt in (torch.float32, torch.bfloat16):
        t = torch.full((300_001,), float(comm.rank + 1), dtype=dt)
        comm.sendrecv_replace(t, nxt, prv)
        assert bool((t == float(prv + 1)).all()), dt
    return "ok"


@pytest.mark.parametrize("nranks", [1, 3])
def test_sendrecv_replace_ring_torch(nranks, transport_env, shm_clean):
    pytest.importorskip("torch")
    assert run_ranks(nranks, _replace_ring_torch, env=transport_env) == ["ok"] * nranks


def _replace_shorter_and_longer(comm):
    """A message shorter than x fills its front (the rest of x is kept); a longer one raises
    ValueError and stays queued for a receive that fits, as for recv."""
    import linkwise
    if comm.rank == 0:
        x = np.arange(8, dtype=np.int32)
        assert comm.sendrecv_replace(x, 1, 1) == 12
        assert x.tolist() == [7, 7, 7, 3, 4, 5, 6, 7]
        small = np.zeros(2, np.int32)
        with pytest.raises(ValueError):
            comm.sendrecv_replace(small, 1, 1, timeout=10)
        rest = np.zeros(8, np.int32)
        comm.recv(rest, 1)
        return rest.tolist()
    out = np.zeros(8, np.int32)
    comm.sendrecv(np.full(3, 7, np.int32), 0, out, 0)
    assert out.tolist() == list(range(8))
    comm.sendrecv(np.full(8, 9, np.int32), 0, out, 0)
    assert out.tolist() == [0, 0, 2, 3, 4, 5, 6, 7]  # rank 0's send went before its receive failed
    return None


def test_sendrecv_replace_shorter_and_longer_messages(shm_clean):
    assert run_ranks(2, _replace_shorter_and_longer)[0] == [9] * 8


def _replace_sizes_and_threads(comm):
    """The copy sendrecv_replace sends: the communicator's kept memory (grown as needed) up to
    16 MiB, memory of its own above it or while another thread's exchange holds the kept one.
    Two threads exchange at once with their own tags: neither may send the other's bytes."""
    import threading
    peer = 1 - comm.rank
    for n in [(16 << 20) // 8 + 1, 1000, (16 << 20) // 8, 3]:
        x = _values(comm.rank, n, np.float64)
        comm.sendrecv_replace(x, peer, peer)
        np.testing.assert_array_equal(x, _values(peer, n, np.float64))
    errors = []

    def worker(k):
        try:
            for i in range(60):
                n = 20_000 + 1000 * k + i
                x = np.full(n, comm.rank * 1000 + k * 100 + i, np.int64)
                comm.sendrecv_replace(x, peer, peer, send_tag=10 + k, recv_tag=10 + k)
                assert (x == peer * 1000 + k * 100 + i).all(), (k, i)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return True


def test_sendrecv_replace_large_and_from_two_threads(shm_clean):
    assert run_ranks(2, _replace_sizes_and_threads, env={"LINKWISE_TRANSPORT": "shm"}) == [True, True]

"""Point-to-point calls and the arrays they take: a Fortran-order array is refused (its bytes
arrived transposed in a C-order receive), a sendrecv whose receive fails on the dtype sends
its message once (it used to send it again through the general path), and a torch sendrecv
with x and out sharing memory is refused as a NumPy one is (it ran and corrupted both)."""
import numpy as np
import pytest

from multirank import run_ranks


def _fortran_refused(comm):
    import linkwise  # noqa: F401 - the ranks import it
    peer = 1 - comm.rank
    a = np.arange(12.0).reshape(3, 4)
    fortran = np.asfortranarray(a)
    for call in (lambda: comm.send(fortran, peer, 1), lambda: comm.isend(fortran, peer, 1),
                 lambda: comm.recv(np.zeros((3, 4), order="F"), peer, 1),
                 lambda: comm.irecv(np.zeros((3, 4), order="F"), peer, 1),
                 lambda: comm.sendrecv(fortran, peer, np.zeros((3, 4)), peer, 1, 1),
                 lambda: comm.sendrecv(a, peer, np.zeros((3, 4), order="F"), peer, 1, 1),
                 lambda: comm.sendrecv_replace(np.asfortranarray(a), peer, peer, 1, 1)):
        with pytest.raises(ValueError, match="C-contiguous"):
            call()
    # nothing was posted: the next message on tag 1 is this one, in C order
    y = np.zeros((3, 4))
    assert comm.sendrecv(np.ascontiguousarray(fortran) + comm.rank, peer, y, peer, 1, 1) == 96
    np.testing.assert_array_equal(y, a + peer)
    # a 1-d view is both C- and Fortran-contiguous: taken
    z = np.zeros(5)
    comm.sendrecv(np.arange(5.0)[::1], peer, z, peer, 2, 2)
    np.testing.assert_array_equal(z, np.arange(5.0))
    return "ok"


def test_fortran_order_is_refused(transport_env):
    assert run_ranks(2, _fortran_refused, env=transport_env) == ["ok", "ok"]


def _dtype_mismatch_sends_once(comm):
    import linkwise
    peer = 1 - comm.rank
    x = np.arange(4, dtype=np.float32) + 10 * comm.rank
    out = np.zeros(4, np.int32 if comm.rank == 0 else np.float32)
    if comm.rank == 0:
        with pytest.raises(TypeError, match="float32"):
            comm.sendrecv(x, peer, out, peer, 3, 3, timeout=10)
        kept = np.zeros(4, np.float32)  # the message is kept for a receive of its dtype
        comm.recv(kept, peer, 3)
        np.testing.assert_array_equal(kept, np.arange(4) + 10)
    else:
        assert comm.sendrecv(x, peer, out, peer, 3, 3, timeout=10) == 16
        np.testing.assert_array_equal(out, np.arange(4))
    comm.barrier()
    if comm.rank == 1:  # rank 0 sent exactly one message on tag 3
        with pytest.raises(linkwise.TimeoutError):
            comm.recv(np.zeros(4, np.float32), peer, 3, timeout=0.5)
    comm.barrier()
    return "ok"


def test_sendrecv_whose_receive_is_refused_sends_once(transport_env):
    assert run_ranks(2, _dtype_mismatch_sends_once, env=transport_env) == ["ok", "ok"]


def _torch_overlap(comm):
    import torch
    peer = 1 - comm.rank
    t = torch.full((1 << 18,), float(comm.rank))
    with pytest.raises(ValueError, match="share memory"):
        comm.sendrecv(t, peer, t, peer, 1, 1, timeout=10)
    with pytest.raises(ValueError, match="share memory"):
        comm.sendrecv(t[: 1 << 17], peer, t[1 << 16:], peer, 1, 1, timeout=10)
    assert torch.all(t == comm.rank)  # untouched
    out = torch.zeros(1 << 18)
    assert comm.sendrecv(t, peer, out, peer, 1, 1, timeout=10) == 4 << 18
    assert torch.all(out == peer)
    return "ok"


def test_torch_sendrecv_refuses_shared_memory(transport_env):
    pytest.importorskip("torch")
    assert run_ranks(2, _torch_overlap, env=transport_env) == ["ok", "ok"]


def _none_arguments(comm):
    x = np.zeros(2)
    for call, kind, text in [
            (lambda: comm.isend(None, 0), TypeError, "isend: expected an array"),
            (lambda: comm.send(None, 0), TypeError, "send: expected an array"),
            (lambda: comm.recv(None, 0), TypeError, "recv: expected an array"),
            (lambda: comm.sendrecv(None, 0, x, 0), TypeError, "sendrecv: expected an array"),
            (lambda: comm.sendrecv(x, 0, None, 0), TypeError, "sendrecv: expected an array"),
            (lambda: comm.sendrecv_replace(None, 0, 0), TypeError, "sendrecv_replace: expected an array"),
            (lambda: comm.isend(x, 0, None), ValueError, "isend: tag must be"),
            (lambda: comm.irecv(x, None), ValueError, "irecv: rank must be"),
            (lambda: comm.sendrecv(x, None, x.copy(), 0), ValueError, "sendrecv: rank must be")]:
        with pytest.raises(kind, match=text):  # was nanobind's "incompatible function arguments"
            call()
    return "ok"


def test_none_arguments_get_the_calls_own_errors():
    assert run_ranks(1, _none_arguments) == ["ok"]

"""comm.isend, irecv, sendrecv and sendrecv_replace are native methods (bind_p2p_entries.cc)
that run plain calls themselves and hand every other to the Python definitions: both paths
give the same errors and take the same forms."""
import numpy as np
import pytest

from multirank import run_ranks


def _isend_irecv_arguments(comm):
    """isend / irecv (and sendrecv, sendrecv_replace) are native methods that run plain calls
    themselves and hand every other to the general path: both give the same errors and take the
    same forms."""
    import linkwise
    from linkwise.comm import MAX_TAG
    peer = 1 - comm.rank
    x = np.zeros(4, np.float32)
    for post in (comm.isend, comm.irecv):
        for bad in (comm.size, -1, 1 << 70, True, 1.0, "1"):
            with pytest.raises(ValueError, match="rank"):
                post(x, bad)
        for bad in (-1, MAX_TAG + 1, 1 << 70, False):
            with pytest.raises(ValueError, match="tag"):
                post(x, peer, bad)
        with pytest.raises(TypeError, match="buffer protocol"):
            post(object(), peer)
        with pytest.raises(ValueError, match="timeout"):
            post(x, peer, 5, timeout=float("nan"))
    ro = np.zeros(4, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        comm.irecv(ro, peer)
    # The largest tag, an int timeout, keywords, a memoryview and a bytearray all post natively.
    got, raw = np.zeros(4, np.float32), bytearray(3)
    reqs = [comm.irecv(got, src=peer, tag=MAX_TAG, timeout=30), comm.irecv(raw, peer, 1),
            comm.isend(np.full(4, comm.rank + 1, np.float32), dst=peer, tag=MAX_TAG, timeout=30),
            comm.isend(memoryview(bytes([comm.rank] * 3)), peer, 1)]
    assert linkwise.wait_all(reqs) == [16, 3, 16, 3]
    assert got.tolist() == [peer + 1] * 4 and raw == bytearray([peer] * 3)
    # sendrecv and sendrecv_replace are native methods of the same kind.
    out = np.zeros(4, np.float32)
    exchanges = (lambda d, s, st=0, rt=0: comm.sendrecv(x, d, out, s, st, rt),
                 lambda d, s, st=0, rt=0: comm.sendrecv_replace(x, d, s, st, rt))
    for exchange in exchanges:
        for bad in (comm.size, -1, 1 << 70, True, 1.0):
            with pytest.raises(ValueError, match="rank"):
                exchange(bad, peer)
            with pytest.raises(ValueError, match="rank"):
                exchange(peer, bad)
        for bad in (-1, MAX_TAG + 1, False):
            with pytest.raises(ValueError, match="tag"):
                exchange(peer, peer, bad)
            with pytest.raises(ValueError, match="tag"):
                exchange(peer, peer, 0, bad)
    assert comm.sendrecv(x, dst=peer, out=out, src=peer, send_tag=MAX_TAG, recv_tag=MAX_TAG, timeout=30) == 16
    assert comm.sendrecv_replace(out, dst=peer, src=peer, send_tag=2, recv_tag=2, timeout=30) == 16
    comm.close()
    for post in (comm.isend, comm.irecv):
        with pytest.raises(linkwise.CommAbortedError, match="closed"):
            post(x, peer)
    for exchange in exchanges:
        with pytest.raises(linkwise.CommAbortedError, match="closed"):
            exchange(peer, peer)
    return "ok"


def test_isend_irecv_arguments():
    assert run_ranks(2, _isend_irecv_arguments) == ["ok", "ok"]


ENTRIES = ("isend", "irecv", "sendrecv", "sendrecv_replace")


def test_native_entries_repeat_the_python_docstrings():
    """The native methods carry copies of the Python definitions' docstrings (a nanobind
    method's __doc__ is fixed when the extension is built, and help() shows the Python ones
    until it is loaded): both must say the same, words and signatures' keywords alike."""
    import ast
    import inspect
    from pathlib import Path

    import linkwise.comm as comm_module
    from linkwise.comm import Communicator, _native
    _native()  # installs the native methods
    tree = ast.parse(Path(comm_module.__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Communicator")
    python_defs = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in ENTRIES}
    assert sorted(python_defs) == sorted(ENTRIES)
    for name in ENTRIES:
        method = getattr(Communicator, name)
        assert not inspect.isfunction(method), f"{name} is not the native method"
        signature, native_doc = method.__doc__.split("\n\n", 1)
        python_doc = ast.get_docstring(python_defs[name])
        assert " ".join(native_doc.split()) == " ".join(python_doc.split()), name
        f = python_defs[name]
        keywords = [a.arg for a in f.args.args[1:] + f.args.kwonlyargs]
        assert all(f"{k}:" in signature for k in keywords), (name, signature, keywords)

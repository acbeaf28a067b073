"""Bad collective tunables and arguments: LINKWISE_CHUNK_SIZE that is not a non-negative byte
size raises the same ValueError (naming the variable and the value) from every collective;
LINKWISE_ALGO's error lists only the real choices; bool and other non-integer roots are
rejected like out-of-range ones."""
import os

import numpy as np
import pytest

from linkwise import config
from multirank import run_ranks


# -- parsing (one process) -------------------------------------------------------------------
@pytest.mark.parametrize("raw", ["-5", "-1K", "abc", "inf", "nan", "1e400", "K", "1.5X"])
def test_chunk_size_rejects_bad_values(monkeypatch, raw):
    monkeypatch.setenv("LINKWISE_CHUNK_SIZE", raw)
    with pytest.raises(ValueError, match=f"LINKWISE_CHUNK_SIZE={raw!r} is not valid"):
        config.get("LINKWISE_CHUNK_SIZE")


@pytest.mark.parametrize("raw,value", [("0", 0), ("256", 256), ("64K", 64 << 10), ("1M", 1 << 20),
                                       ("2GiB", 2 << 30), (" 4kb ", 4096)])
def test_chunk_size_accepts_sizes(monkeypatch, raw, value):
    monkeypatch.setenv("LINKWISE_CHUNK_SIZE", raw)
    assert config.get("LINKWISE_CHUNK_SIZE") == value


@pytest.mark.parametrize("raw", ["inf", "nan", "-5", "1e7", "abc"])
def test_spin_us_rejects_endless_and_negative_spins(monkeypatch, raw):
    """An endless spin never reached the waits' timeout and dead-peer checks (inf was taken)."""
    monkeypatch.setenv("LINKWISE_SPIN_US", raw)
    with pytest.raises(ValueError, match=f"LINKWISE_SPIN_US={raw!r} is not valid"):
        config.get("LINKWISE_SPIN_US")


@pytest.mark.parametrize("raw,value", [("-1", -1.0), ("0", 0.0), ("50", 50.0), ("1e6", 1e6)])
def test_spin_us_accepts_pick_and_microseconds(monkeypatch, raw, value):
    monkeypatch.setenv("LINKWISE_SPIN_US", raw)
    assert config.get("LINKWISE_SPIN_US") == value


def test_gpu_tunables_the_native_code_reads_are_checked_up_front(monkeypatch):
    """GpuComm checks them all first (and every rank learns of a refusal on one rank, in
    tests/test_gpu_robust.py): the CUDA code reads LINKWISE_GPU_LL_MAX and others with atoi,
    which ran "256K" as 256 bytes while `linkwise info` called it invalid."""
    for name in config.TUNABLES:
        if name.startswith(config.READ_BY_GPU_PLANE):
            monkeypatch.delenv(name, raising=False)
    assert config.first_invalid(config.READ_BY_GPU_PLANE) == ""  # nothing set: nothing to refuse
    monkeypatch.setenv("LINKWISE_GPU_LL_MAX", "256K")
    assert "LINKWISE_GPU_LL_MAX='256K' is not valid" in config.first_invalid(config.READ_BY_GPU_PLANE)
    assert config.first_invalid() == ""  # not one the host communicator reads
    monkeypatch.setenv("LINKWISE_GPU_LL_MAX", "262144")
    monkeypatch.setenv("LINKWISE_P2P_DISABLE", "maybe")
    assert "LINKWISE_P2P_DISABLE='maybe'" in config.first_invalid(config.READ_BY_GPU_PLANE)


def test_algo_error_lists_real_choices(monkeypatch):
    monkeypatch.setenv("LINKWISE_ALGO", "foo")
    with pytest.raises(ValueError) as info:
        config.get("LINKWISE_ALGO")
    msg = str(info.value)
    assert "LINKWISE_ALGO='foo'" in msg
    assert "expected one of ring, tree, chain, direct" in msg
    assert "of ," not in msg and ", ," not in msg and "''" not in msg
    assert "unset" in msg  # says what leaving it empty means
    for ok in ("ring", "TREE", " chain ", "direct"):
        monkeypatch.setenv("LINKWISE_ALGO", ok)
        assert config.get("LINKWISE_ALGO") == ok.strip().lower()
    monkeypatch.setenv("LINKWISE_ALGO", "")
    assert config.get("LINKWISE_ALGO") == ""


def test_transport_error_unchanged(monkeypatch):
    monkeypatch.setenv("LINKWISE_TRANSPORT", "udp")
    with pytest.raises(ValueError, match=r"expected one of auto, shm, tcp$"):
        config.get("LINKWISE_TRANSPORT")


# -- every collective, on ranks --------------------------------------------------------------
def _every_collective(comm):
    """Each collective (and async/coroutine forms) once, on small arrays."""
    n = comm.size
    f = np.ones(4 * n, np.float32)
    calls = {
        "all_reduce": lambda: comm.all_reduce(f.copy()),
        "all_reduce out": lambda: comm.all_reduce(f.copy(), out=np.empty_like(f)),
        "all_reduce async": lambda: comm.all_reduce(f.copy(), async_op=True).wait(),
        "broadcast": lambda: comm.broadcast(f.copy(), root=0),
        "broadcast big": lambda: comm.broadcast(np.zeros(3 << 20, np.float32), root=1),
        "reduce": lambda: comm.reduce(f.copy(), root=0),
        "all_gather": lambda: comm.all_gather(f.copy()),
        "reduce_scatter": lambda: comm.reduce_scatter(f.copy()),
        "all_to_all": lambda: comm.all_to_all(f.copy()),
        "gather": lambda: comm.gather(f.copy(), root=0),
        "scatter": lambda: comm.scatter(f.copy(), root=0),
        "barrier": lambda: comm.barrier(),
    }
    return calls


def _bad_chunk(comm, raw, first):
    calls = _every_collective(comm)
    if first is not None:  # that kind first: it sets up the latency paths on a first call
        calls = {first: calls.pop(first), **calls}
    seen = {}
    for name, call in list(calls.items()) * 2:
        with pytest.raises(ValueError) as info:
            call()
        seen[name] = str(info.value)
        assert f"LINKWISE_CHUNK_SIZE={raw!r}" in seen[name], (name, seen[name])
    # The communicator is still usable once the variable is fixed.
    os.environ.pop("LINKWISE_CHUNK_SIZE")
    x = np.full(5, comm.rank + 1.0, np.float32)
    comm.all_reduce(x)
    np.testing.assert_array_equal(x, sum(range(1, comm.size + 1)))
    g = comm.all_gather(np.array([comm.rank], np.int64))
    np.testing.assert_array_equal(g, np.arange(comm.size))
    comm.barrier()
    return len(seen)


@pytest.mark.parametrize("raw", ["-5", "abc"])
def test_bad_chunk_size_every_collective(transport_env, raw):
    assert run_ranks(2, _bad_chunk, raw, None, env={**transport_env, "LINKWISE_CHUNK_SIZE": raw},
                     timeout=60) == [12, 12]


@pytest.mark.parametrize("first", ["barrier", "broadcast", "all_gather"])
def test_bad_chunk_size_whatever_comes_first(first):
    assert run_ranks(3, _bad_chunk, "-1M", first, env={"LINKWISE_CHUNK_SIZE": "-1M"},
                     timeout=60) == [12, 12, 12]


def _good_chunk(comm):
    out = {}
    for name, call in _every_collective(comm).items():
        call()
        out[name] = True
    x = np.arange(5000, dtype=np.float64) + comm.rank
    g = comm.all_gather(x)
    np.testing.assert_array_equal(g, np.concatenate([np.arange(5000.0) + r for r in range(comm.size)]))
    return len(out)


@pytest.mark.parametrize("raw", ["0", "4K", " 256 "])
def test_valid_chunk_sizes_still_work(raw):
    assert run_ranks(2, _good_chunk, env={"LINKWISE_CHUNK_SIZE": raw}, timeout=60) == [12, 12]


def _bad_algo(comm):
    for name, call in _every_collective(comm).items():
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert "LINKWISE_ALGO='foo'" in msg and "expected one of ring, tree, chain, direct" in msg, (name, msg)
    return "ok"


def test_bad_algo_every_collective():
    assert run_ranks(2, _bad_algo, env={"LINKWISE_ALGO": "foo"}, timeout=60) == ["ok", "ok"]


# -- roots ----------------------------------------------------------------------------------
BAD_ROOTS = [True, False, np.True_, 1.0, 0.0, "0", None, -1, 3, 1 << 70]


def _roots(comm):
    n = comm.size
    f = np.arange(2 * n, dtype=np.float32)
    forms = {
        "broadcast": lambda r: comm.broadcast(f.copy(), root=r),
        "broadcast out": lambda r: comm.broadcast(f.copy(), root=r, out=np.empty_like(f)),
        "broadcast async": lambda r: comm.broadcast(f.copy(), root=r, async_op=True),
        "reduce": lambda r: comm.reduce(f.copy(), root=r),
        "gather": lambda r: comm.gather(f.copy(), root=r),
        "scatter": lambda r: comm.scatter(f.copy(), root=r),
    }
    for name, call in forms.items():
        for bad in BAD_ROOTS:
            with pytest.raises((ValueError, TypeError)) as info:
                call(bad)
            msg = str(info.value)
            assert "root" in msg and repr(bad) in msg, (name, bad, msg)
            assert name.split()[0] in msg, (name, msg)
            if type(bad) is not int:
                assert "integer" in msg, (name, bad, msg)
    # Integer roots of any integer type still work, every rank naming the same root.
    for root in (1, np.int64(2), np.int32(0), np.uint8(1)):
        x = np.full(3, comm.rank * 10.0, np.float32)
        comm.broadcast(x, root=root)
        np.testing.assert_array_equal(x, int(root) * 10.0)
        y = np.full(3, 1.0, np.float32)
        comm.reduce(y, root=root)
        if comm.rank == int(root):
            np.testing.assert_array_equal(y, float(n))
        g = comm.gather(np.array([comm.rank], np.int32), root=root)
        if comm.rank == int(root):
            np.testing.assert_array_equal(g, np.arange(n))
        else:
            assert g is None
        s = comm.scatter(np.arange(n, dtype=np.int32) * 7, root=root)
        np.testing.assert_array_equal(s, [comm.rank * 7])
    return "ok"


def test_roots_must_be_integer_ranks():
    assert run_ranks(3, _roots, timeout=60) == ["ok"] * 3


def _gather_small_out(comm):
    x = np.ones(4, np.float32)
    try:
        comm.gather(x, root=0, out=np.empty(3, np.float32))  # the same wrong out on every rank
    except ValueError as e:
        return "ValueError" if "gather" in str(e) else str(e)
    return "no error"


def test_gather_wrong_out_raises_on_every_rank():
    assert run_ranks(3, _gather_small_out, timeout=60) == ["ValueError"] * 3


def _out_errors(comm):
    """Errors about out= name out, not x (reduce, gather on a non-root and scatter said "x is
    not C-contiguous", advice that changed nothing); another byte order in a collective that
    only moves bytes is a dtype mismatch, not "reductions need native byte order"; a scatter
    out in the other bfloat16 form is taken, as by the other collectives; a list as op is a
    ValueError naming the ops, not "unhashable type"."""
    strided = np.zeros(8, np.float32)[::2]
    x = np.ones(4, np.float32)
    said = []
    for call in (lambda: comm.reduce(x, root=0, out=strided),
                 lambda: comm.gather(np.ones(1, np.float32), root=comm.size - 1,
                                     out=np.zeros(2 * comm.size, np.float32)[::2]),
                 lambda: comm.scatter(np.ones(4 * comm.size, np.float32), root=0, out=strided),
                 lambda: comm.reduce(x, root=0, out=np.zeros(4, object))):
        with pytest.raises((ValueError, TypeError)) as err:
            call()
        said.append(str(err.value))
    assert all(" out " in s or s.split(": ")[1].startswith("out") for s in said), said
    assert not any(" x " in s for s in said), said
    with pytest.raises(ValueError, match=r"float32 in the other byte order \(>f4\)") as err:
        comm.broadcast(np.arange(4, dtype="<f4"), root=0, out=np.zeros(4, ">f4"))
    assert "reductions" not in str(err.value)
    with pytest.raises(ValueError, match=r"op \['sum'\] is not one of"):
        comm.all_reduce(np.ones(2, np.float32), op=["sum"])
    import ml_dtypes
    full = np.arange(2 * comm.size, dtype=np.float32).astype(ml_dtypes.bfloat16)
    got = np.zeros(2, "V2")
    comm.scatter(full, root=0, out=got)
    return got.view(ml_dtypes.bfloat16).astype(np.float32).tolist()


def test_out_errors_name_out_and_byte_orders_are_dtypes():
    pytest.importorskip("ml_dtypes")
    assert run_ranks(2, _out_errors, timeout=60) == [[0.0, 1.0], [2.0, 3.0]]

"""The executor's latency entries (csrc/bindings/bind_shm_fast.cc): all_reduce_fast and
broadcast_fast test their arguments natively and either run the call or return
NotImplemented (the caller then takes the general path). Checked:
- what they serve: every linkwise dtype NumPy exports (bfloat16 aside) with every op valid for
  it, in place and out=, against the NumPy reference; broadcast of bool, complex, int16 and
  big-endian arrays, in place and out=, from every root;
- what they decline, with nothing moved and the executor's call numbering intact (the next
  collective still matches): dtypes linkwise does not reduce, bitwise ops on floats, an op
  that is not a str, a subclass of ndarray, a root out of range or not an int, an out of
  another dtype or size; then through the communicator the general path serves or refuses the
  same call on every rank;
- argument errors of served calls (read-only, non-contiguous) raise ValueError on every rank
  and the ranks go on with the next collective."""
import numpy as np
import pytest

from coll_ref import DTYPES, INT, check_equal, data, ops_for, reduce_ref
from multirank import run_ranks

NUMPY_DTYPES = [d for d in DTYPES if d != "bfloat16"]


def _executor(comm):
    """The communicator's shared-memory executor, attached by its first collective."""
    comm.all_reduce(np.zeros(1, np.float32))
    assert comm._fast_shm is not None
    return comm._fast_shm


def _reductions(comm, salt):
    """(dtype, op, count, this rank's input, the reference) for every case served natively."""
    for dt in NUMPY_DTYPES:
        for op in ops_for(dt):
            for count in (0, 1, 7, 1000):
                ins = [data(r, count, dt, op, salt=salt) for r in range(comm.size)]
                yield dt, op, count, ins[comm.rank], reduce_ref(ins, op, dt)


def _served_all_reduce(comm):
    fast, checked = _executor(comm), 0
    for dt, op, count, mine, want in _reductions(comm, 3):
        x = mine.copy()
        assert fast.all_reduce_fast(comm, x, op, None) is x
        check_equal(x, want, f"all_reduce_fast {dt} {op} {count} in place", avg_float=op == "avg")
        x = mine.copy()
        out = np.full(count, 7, x.dtype)
        assert fast.all_reduce_fast(comm, x, op, out) is out
        check_equal(out, want, f"all_reduce_fast {dt} {op} {count} out=", avg_float=op == "avg")
        check_equal(x, mine, "x untouched by all_reduce_fast(out=)")
        checked += 2
    return checked


def _served_reduce(comm):
    fast, checked = _executor(comm), 0
    for dt, op, count, mine, want in _reductions(comm, 4):
        for root in range(comm.size):
            x = mine.copy()
            assert fast.reduce_fast(comm, x, root, op, None) is x
            check_equal(x, want if comm.rank == root else mine, f"reduce_fast {dt} {op} {count} in place",
                        avg_float=op == "avg")
            x = mine.copy()
            x.setflags(write=comm.rank == root)  # only the root's x is written in place
            out = np.full(count, 7, x.dtype)
            assert fast.reduce_fast(comm, x, root, op, out) is out
            check_equal(x, mine, "x untouched by reduce_fast(out=)")
            if comm.rank == root:
                check_equal(out, want, f"reduce_fast {dt} {op} {count} out=", avg_float=op == "avg")
            else:
                check_equal(out, np.full(count, 7, x.dtype), "a non-root's out untouched")
            checked += 1
    return checked


def test_reduce_fast_serves_every_numpy_dtype_op_and_root():
    counts = run_ranks(3, _served_reduce)
    assert counts[0] == 3 * 4 * sum(len(ops_for(d)) for d in NUMPY_DTYPES)


def test_all_reduce_fast_serves_every_numpy_dtype_and_op():
    counts = run_ranks(3, _served_all_reduce)
    assert counts[0] == 2 * 4 * sum(len(ops_for(d)) for d in NUMPY_DTYPES)


BCAST_DTYPES = [np.dtype(t) for t in ("float32", "uint8", "bool", "complex64", "int16", ">f4", "<i8", "float64")]


def _served_broadcast(comm):
    fast = _executor(comm)
    for dt in BCAST_DTYPES:
        for count in (0, 1, 7, 5003):
            for root in range(comm.size):
                ref = (np.arange(count) % 5 + root).astype(dt)
                x = ref.copy() if comm.rank == root else np.zeros(count, dt)
                assert fast.broadcast_fast(comm, x, root, None) is x
                check_equal(x, ref, f"broadcast_fast {dt} {count} root {root}")
                x = ref.copy() if comm.rank == root else np.zeros(count, dt)
                before = x.copy()
                out = np.ones(count, dt)
                assert fast.broadcast_fast(comm, x, root, out) is out
                check_equal(out, ref, f"broadcast_fast out= {dt} {count} root {root}")
                check_equal(x, before, "x untouched by broadcast_fast(out=)")
    return True


def test_broadcast_fast_serves_plain_arrays_of_any_number_kind():
    run_ranks(3, _served_broadcast)


class _Sub(np.ndarray):
    pass


def _read_only(count):
    a = np.ones(count, np.float32)
    a.setflags(write=False)
    return a


def _declined(comm):
    fast = _executor(comm)
    f32 = np.ones(4, np.float32)
    cases = {
        "int16": lambda: fast.all_reduce_fast(comm, np.ones(4, np.int16), "sum", None),
        "uint32": lambda: fast.all_reduce_fast(comm, np.ones(4, np.uint32), "sum", None),
        "bool": lambda: fast.all_reduce_fast(comm, np.ones(4, bool), "max", None),
        "complex": lambda: fast.all_reduce_fast(comm, np.ones(4, np.complex64), "sum", None),
        "big-endian": lambda: fast.all_reduce_fast(comm, np.ones(4, ">f4"), "sum", None),
        "structured": lambda: fast.all_reduce_fast(comm, np.zeros(4, "i4,f4"), "sum", None),
        "bfloat16 (V2)": lambda: fast.all_reduce_fast(comm, np.zeros(4, "V2"), "sum", None),
        "band on float": lambda: fast.all_reduce_fast(comm, f32, "band", None),
        "unknown op": lambda: fast.all_reduce_fast(comm, f32, "mean", None),
        "op not a str": lambda: fast.all_reduce_fast(comm, f32, b"sum", None),
        "subclass": lambda: fast.all_reduce_fast(comm, f32.view(_Sub), "sum", None),
        "out a list": lambda: fast.all_reduce_fast(comm, f32, "sum", [0.0] * 4),
        "reduce int16": lambda: fast.reduce_fast(comm, np.ones(4, np.int16), 0, "sum", None),
        "reduce bxor on float": lambda: fast.reduce_fast(comm, f32, 0, "bxor", None),
        "reduce root too big": lambda: fast.reduce_fast(comm, f32, comm.size, "sum", None),
        "reduce root a float": lambda: fast.reduce_fast(comm, f32, 0.0, "sum", None),
        "reduce out other dtype": lambda: fast.reduce_fast(comm, f32, 0, "sum", np.ones(4, np.float64)),
        "reduce out other size": lambda: fast.reduce_fast(comm, f32, 0, "sum", np.ones(3, np.float32)),
        "reduce out read-only": lambda: fast.reduce_fast(comm, f32, 0, "sum", _read_only(4)),
        "bcast object": lambda: fast.broadcast_fast(comm, np.empty(4, object), 0, None),
        "bcast str": lambda: fast.broadcast_fast(comm, np.array(["ab", "cd"]), 0, None),
        "bcast structured": lambda: fast.broadcast_fast(comm, np.zeros(4, "i4,f4"), 0, None),
        "bcast root too big": lambda: fast.broadcast_fast(comm, f32, comm.size, None),
        "bcast root negative": lambda: fast.broadcast_fast(comm, f32, -1, None),
        "bcast root np.int64": lambda: fast.broadcast_fast(comm, f32, np.int64(0), None),
        "bcast root bool": lambda: fast.broadcast_fast(comm, f32, True, None),
        "bcast out other dtype": lambda: fast.broadcast_fast(comm, f32, 0, np.ones(4, np.int32)),
        "bcast out other byte order": lambda: fast.broadcast_fast(comm, f32, 0, np.ones(4, ">f4")),
        "bcast out other size": lambda: fast.broadcast_fast(comm, f32, 0, np.ones(5, np.float32)),
        "bcast subclass": lambda: fast.broadcast_fast(comm, f32.view(_Sub), 0, None),
    }
    kept = f32.copy()
    for what, call in cases.items():
        assert call() is NotImplemented, what
    check_equal(f32, kept, "declined calls move nothing")
    # The executor numbered no call: the next one matches on every rank.
    x = np.full(3, comm.rank + 1, np.int64)
    comm.all_reduce(x)
    check_equal(x, np.full(3, comm.size * (comm.size + 1) // 2, np.int64), "all_reduce after declined calls")
    return len(cases)


def test_fast_entries_decline_what_they_do_not_serve():
    run_ranks(2, _declined)


def _through_the_communicator(comm):
    """Calls the fast entries decline, as users make them: the general path serves them."""
    n = comm.size
    x = np.full(5, comm.rank + 1, np.int16)  # int16: not reducible, broadcast by the general path
    with pytest.raises(TypeError):
        comm.all_reduce(x)
    root = n - 1
    out = np.zeros(5, np.int16)
    got = comm.broadcast(x, np.int64(root), out=out)  # a NumPy integer root
    assert got is out
    check_equal(out, np.full(5, root + 1, np.int16), "broadcast with a np.int64 root")
    sub = np.full(4, comm.rank + 1.0).view(_Sub)
    comm.all_reduce(sub)
    check_equal(np.asarray(sub), np.full(4, n * (n + 1) / 2), "all_reduce of an ndarray subclass")
    # An out of another dtype: ValueError on every rank, from the general path.
    with pytest.raises(ValueError, match="out must be"):
        comm.broadcast(np.ones(4, np.float32), 0, out=np.ones(4, np.float64))
    return True


def test_declined_calls_take_the_general_path():
    run_ranks(3, _through_the_communicator)


def _argument_errors(comm):
    ro = np.ones(4, np.float32)
    ro.setflags(write=False)
    strided = np.ones(8, np.float32)[::2]
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(ro)
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(np.ones(4, np.float32), out=ro)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(strided)
    with pytest.raises(ValueError, match="read-only"):
        comm.broadcast(ro, 0)
    with pytest.raises(ValueError, match="read-only"):
        comm.broadcast(np.ones(4, np.float32), 0, out=ro)
    with pytest.raises(ValueError, match="contiguous"):
        comm.broadcast(np.ones(4, np.float32), 0, out=np.ones(8, np.float32)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        comm.reduce(strided, 0)
    x = np.full(3, comm.rank + 1.0)
    comm.all_reduce(x)  # every refused call was numbered as skipped on every rank
    check_equal(x, np.full(3, comm.size * (comm.size + 1) / 2), "all_reduce after refused calls")
    return True


@pytest.mark.parametrize("n", [2, 3])
def test_argument_errors_of_served_calls(n):
    run_ranks(n, _argument_errors)


def _bitwise_int_ops(comm):
    n = comm.size
    for dt in INT:
        for op in ("band", "bor", "bxor"):
            ins = [data(r, 9, dt, op) for r in range(n)]
            x = ins[comm.rank].copy()
            assert comm.all_reduce(x, op) is x
            check_equal(x, reduce_ref(ins, op, dt), f"{op} {dt} through the communicator")
    return True


def test_bitwise_ops_on_integers_through_the_communicator():
    run_ranks(5, _bitwise_int_ops)


def _env_forces_the_general_path(comm):
    """LINKWISE_ALGO or LINKWISE_CHECK set while the executor is attached (os.environ, as a
    user would between calls): every entry declines, so the general path honours the
    variable; unset, the entries serve again."""
    import os
    from linkwise.collectives import _ALL_GATHER, _ALL_TO_ALL, _REDUCE_SCATTER
    fast, n = _executor(comm), comm.size
    f = np.ones(2 * n, np.float32)
    entries = {
        "all_reduce_fast": lambda: fast.all_reduce_fast(comm, f.copy(), "sum", None),
        "reduce_fast": lambda: fast.reduce_fast(comm, f.copy(), 0, "sum", None),
        "broadcast_fast": lambda: fast.broadcast_fast(comm, f.copy(), 0, None),
        "all_gather": lambda: fast.exchange_fast(comm, _ALL_GATHER, f.copy(), None, ""),
        "reduce_scatter": lambda: fast.exchange_fast(comm, _REDUCE_SCATTER, f.copy(), None, "sum"),
        "all_to_all": lambda: fast.exchange_fast(comm, _ALL_TO_ALL, f.copy(), None, ""),
        "gather_fast": lambda: fast.gather_fast(comm, f.copy(), 0, None),
        "scatter_fast": lambda: fast.scatter_fast(comm, f.copy() if comm.rank == 0 else None, 0, f[:2].copy()),
    }
    for name in ("LINKWISE_CHECK", "LINKWISE_ALGO"):
        os.environ[name] = ""  # set to anything, even empty
        try:
            for entry, call in entries.items():
                assert call() is NotImplemented, (name, entry)
        finally:
            del os.environ[name]
    served = {entry: call() for entry, call in entries.items()}
    assert [e for e, r in served.items() if r is NotImplemented] == []
    check_equal(served["all_reduce_fast"], np.full(2 * n, float(n), np.float32), "all_reduce after the variables")
    # Through the communicator, an invalid LINKWISE_ALGO now reaches the general path's check,
    # for bfloat16 (V2) all_reduce too, whose latency path is Python's.
    os.environ["LINKWISE_ALGO"] = "foo"
    try:
        for call in (lambda: comm.all_reduce(f.copy()), lambda: comm.all_reduce(np.zeros(4, "V2")),
                     lambda: comm.broadcast(f.copy()), lambda: comm.all_gather(f.copy()),
                     lambda: comm.gather(f.copy(), root=0)):
            with pytest.raises(ValueError, match="LINKWISE_ALGO='foo'"):
                call()
    finally:
        del os.environ["LINKWISE_ALGO"]
    x = np.full(3, comm.rank + 1.0)
    comm.all_reduce(x)
    check_equal(x, np.full(3, n * (n + 1) / 2), "all_reduce after the refused calls")
    return True


def test_algo_or_check_set_at_run_time_takes_the_general_path():
    assert run_ranks(2, _env_forces_the_general_path) == [True, True]

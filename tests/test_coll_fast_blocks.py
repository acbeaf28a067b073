"""The executor's latency entries of the block collectives (csrc/bindings/
bind_shm_fast_blocks.cc): exchange_fast (all_gather, reduce_scatter, all_to_all), gather_fast
and scatter_fast test their arguments natively and either run the call or return
NotImplemented (the caller then takes the general path). Checked:
- what they serve: every dtype NumPy moves as it is (bool, integers, floats, complex, big-endian),
  sizes 0, 1, 7 and up to the one-shot area, 2-D and 0-d shapes, out given or made by the entry
  (the general path's shape), all_to_all in place, every root, against the NumPy reference;
- what they decline, with nothing moved and the executor's call numbering intact;
- argument errors of served calls (read-only, non-contiguous) raise ValueError on every rank,
  and the ranks go on."""
import numpy as np
import pytest

from coll_ref import check_equal, data, reduce_ref
from multirank import run_ranks
from linkwise.collectives import _ALL_GATHER, _ALL_TO_ALL, _REDUCE_SCATTER

MOVED = [np.dtype(t) for t in ("bool", "int8", "uint8", "int16", "uint32", "int64", "float16", "float32",
                               ">f8", "complex64", "complex128")]
ONE_SHOT = 32 << 10  # ShmColl::kOneMax


def _executor(comm):
    comm.all_reduce(np.zeros(1, np.float32))
    assert comm._fast_shm is not None
    return comm._fast_shm


def _block_of(rank: int, shape, dt, salt: int = 0) -> np.ndarray:
    """Rank's distinct values of dtype dt (bool: alternating with the rank)."""
    v = (np.arange(int(np.prod(shape, dtype=np.int64))) * 3 + 11 * rank + salt) % 97
    return (v % 2 == rank % 2 if dt == np.bool_ else v.astype(dt)).astype(dt).reshape(shape)


def _same(got, want, what):
    check_equal(np.asarray(got).reshape(-1), np.asarray(want).reshape(-1), what)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"


def _shapes(n, itemsize):
    """x shapes: 0, 1, 7 elements, 2-D, 0-d, and the largest block the one-shot area holds."""
    yield (0,)
    yield (1,)
    yield (7,)
    yield (3, 2)
    yield ()
    yield (ONE_SHOT // itemsize // n,)


def _served_all_gather(comm):
    fast, n, r = _executor(comm), comm.size, comm.rank
    done = 0
    for dt in MOVED:
        for shape in _shapes(n, dt.itemsize):
            ins = [_block_of(q, shape, dt) for q in range(n)]
            want = np.concatenate([a if a.ndim else a.reshape(1) for a in ins]).astype(dt)  # keeps byte order
            x = ins[r].copy()
            got = fast.exchange_fast(comm, _ALL_GATHER, x, None, "")
            _same(got, want, f"all_gather {dt} {shape} made out")
            out = np.zeros(want.shape, dt)
            assert fast.exchange_fast(comm, _ALL_GATHER, x, out, "") is out
            _same(out, want, f"all_gather {dt} {shape} out=")
            _same(x, ins[r], "x untouched by all_gather")
            # In place: x is this rank's block of out.
            out = np.zeros(want.size, dt)
            m = ins[r].size
            out[r * m:(r + 1) * m] = ins[r].reshape(-1)
            assert fast.exchange_fast(comm, _ALL_GATHER, out[r * m:(r + 1) * m], out, "") is out
            _same(out, want.reshape(-1), f"all_gather {dt} {shape} in place")
            done += 3
    return done


def _served_all_to_all(comm):
    fast, n, r = _executor(comm), comm.size, comm.rank
    for dt in MOVED:
        for m in (0, 1, 7, ONE_SHOT // dt.itemsize // n):
            ins = [_block_of(q, (n * m,), dt) for q in range(n)]
            want = np.concatenate([ins[q][r * m:(r + 1) * m] for q in range(n)]).astype(dt)
            out = np.zeros(n * m, dt)
            assert fast.exchange_fast(comm, _ALL_TO_ALL, ins[r], out, "") is out
            _same(out, want, f"all_to_all {dt} {m} out=")
            x = ins[r].reshape(n, m).copy()
            assert fast.exchange_fast(comm, _ALL_TO_ALL, x, None, "") is x
            _same(x, want.reshape(n, m), f"all_to_all {dt} {m} in place")
    return True


RS_CASES = (("int8", ("sum", "bxor")), ("uint8", ("max", "bor")), ("int32", ("prod", "band")),
            ("int64", ("min", "sum")), ("float16", ("sum",)), ("float32", ("avg", "max")), ("float64", ("prod", "min")))
RS_COUNTS = (0, 1, 7, 500)


def _served_reduce_scatter(comm):
    fast, n, r = _executor(comm), comm.size, comm.rank
    done = 0
    for dt, ops in RS_CASES:
        for op in ops:
            for m in RS_COUNTS:
                ins = [data(q, n * m, dt, op, salt=9) for q in range(n)]
                want = reduce_ref(ins, op, dt)[r * m:(r + 1) * m]
                got = fast.exchange_fast(comm, _REDUCE_SCATTER, ins[r].reshape(n, m), None, op)
                assert got.shape == (1, m), got.shape  # block_shape of (n, m)
                check_equal(got.reshape(-1), want, f"reduce_scatter {dt} {op} {m} made out", avg_float=op == "avg")
                out = np.full(m, 5, ins[r].dtype)
                assert fast.exchange_fast(comm, _REDUCE_SCATTER, ins[r], out, op) is out
                check_equal(out, want, f"reduce_scatter {dt} {op} {m} out=", avg_float=op == "avg")
                done += 1
    return done


def _served_gather_scatter(comm):
    fast, n, r = _executor(comm), comm.size, comm.rank
    for dt in MOVED:
        for shape in ((0,), (1,), (7,), (2, 3), (ONE_SHOT // dt.itemsize // n,)):
            ins = [_block_of(q, shape, dt, salt=5) for q in range(n)]
            want = np.concatenate(ins).astype(dt)
            for root in range(n):
                got = fast.gather_fast(comm, ins[r], root, None)
                if r == root:
                    _same(got, want, f"gather {dt} {shape} root {root} made out")
                else:
                    assert got is None
                out = np.zeros(want.shape, dt) if r == root else None
                assert fast.gather_fast(comm, ins[r], root, out) is out
                if r == root:
                    _same(out, want, f"gather {dt} {shape} root {root} out=")
                src = want.copy() if r == root else None
                got = fast.scatter_fast(comm, src, root, None if r == root else np.zeros(shape, dt))
                _same(got, ins[r], f"scatter {dt} {shape} root {root}")
                if r == root:
                    _same(src, want, "root's x untouched by scatter")
    return True


@pytest.mark.parametrize("n", [2, 3])
def test_exchange_fast_all_gather_serves_every_moved_dtype_and_shape(n):
    assert run_ranks(n, _served_all_gather)[0] == 3 * len(MOVED) * 6


def test_exchange_fast_all_to_all_serves_every_moved_dtype():
    run_ranks(3, _served_all_to_all)


@pytest.mark.parametrize("n", [2, 5])
def test_exchange_fast_reduce_scatter_against_the_reference(n):
    assert run_ranks(n, _served_reduce_scatter)[0] == len(RS_COUNTS) * sum(len(ops) for _, ops in RS_CASES)


def test_gather_and_scatter_fast_serve_every_root():
    run_ranks(3, _served_gather_scatter)


class _Sub(np.ndarray):
    pass


def _read_only(a):
    a = a.copy()
    a.setflags(write=False)
    return a


def _declined(comm):
    fast, n, r = _executor(comm), comm.size, comm.rank
    f32 = np.ones(2 * n, np.float32)
    big = np.ones(ONE_SHOT // 4 + 1, np.float32)
    AG, RS, A2A = _ALL_GATHER, _REDUCE_SCATTER, _ALL_TO_ALL
    cases = {
        "all_gather over the one-shot area": lambda: fast.exchange_fast(comm, AG, big, None, ""),
        "all_gather structured": lambda: fast.exchange_fast(comm, AG, np.zeros(2, "i4,f4"), None, ""),
        "all_gather object": lambda: fast.exchange_fast(comm, AG, np.empty(2, object), None, ""),
        "all_gather str": lambda: fast.exchange_fast(comm, AG, np.array(["a", "b"]), None, ""),
        "all_gather V2": lambda: fast.exchange_fast(comm, AG, np.zeros(2, "V2"), None, ""),
        "all_gather subclass": lambda: fast.exchange_fast(comm, AG, f32.view(_Sub), None, ""),
        "all_gather out other dtype": lambda: fast.exchange_fast(comm, AG, f32, np.ones(2 * n * n, np.int32), ""),
        "all_gather out other byte order": lambda: fast.exchange_fast(comm, AG, f32, np.ones(2 * n * n, ">f4"), ""),
        "all_gather out other size": lambda: fast.exchange_fast(comm, AG, f32, np.ones(2 * n * n + 1, np.float32), ""),
        "all_gather out a list": lambda: fast.exchange_fast(comm, AG, f32, [0.0] * (2 * n * n), ""),
        "a kind the entry does not run": lambda: fast.exchange_fast(comm, 0, f32, None, ""),
        "reduce_scatter size not a multiple": lambda: fast.exchange_fast(comm, RS, np.ones(2 * n + 1, np.float32), None,
                                                                         "sum"),
        "reduce_scatter int16": lambda: fast.exchange_fast(comm, RS, np.ones(2 * n, np.int16), None, "sum"),
        "reduce_scatter band on float": lambda: fast.exchange_fast(comm, RS, f32, None, "band"),
        "reduce_scatter unknown op": lambda: fast.exchange_fast(comm, RS, f32, None, "mean"),
        "reduce_scatter out other size": lambda: fast.exchange_fast(comm, RS, f32, np.ones(3, np.float32), "sum"),
        "all_to_all size not a multiple": lambda: fast.exchange_fast(comm, A2A, np.ones(2 * n + 1, np.float32), None, ""),
        "all_to_all out other dtype": lambda: fast.exchange_fast(comm, A2A, f32, np.ones(2 * n, np.float64), ""),
        "gather over the one-shot area": lambda: fast.gather_fast(comm, np.ones(ONE_SHOT // 4 // n + 1, np.float32), 0,
                                                                  None),
        "gather root too big": lambda: fast.gather_fast(comm, f32, n, None),
        "gather root np.int64": lambda: fast.gather_fast(comm, f32, np.int64(0), None),
        # Declined on the root only (the other ranks would post their blocks): called there only.
        "gather out on the root other dtype": lambda: fast.gather_fast(comm, f32, 0, np.ones(2 * n * n, np.float64))
        if r == 0 else NotImplemented,
        "gather out read-only": lambda: fast.gather_fast(comm, f32, 0, _read_only(np.ones(2 * n * n, np.float32)))
        if r == 0 else NotImplemented,
        "gather out on a non-root": lambda: fast.gather_fast(comm, f32, 0, np.ones(2 * n * n, np.float32))
        if r != 0 else NotImplemented,
        "scatter root negative": lambda: fast.scatter_fast(comm, f32 if r == 0 else None, -1, np.ones(2, np.float32)),
        "scatter x on a non-root": lambda: fast.scatter_fast(comm, f32, 0, np.ones(2, np.float32))
        if r != 0 else NotImplemented,
        "scatter out read-only": lambda: fast.scatter_fast(comm, f32 if r == 0 else None, 0,
                                                           _read_only(np.ones(2, np.float32))),
        "scatter out other dtype on the root": lambda: fast.scatter_fast(comm, f32, 0, np.ones(2, np.int32))
        if r == 0 else NotImplemented,
        "scatter without out on a non-root": lambda: fast.scatter_fast(comm, None, 0, None)
        if r != 0 else NotImplemented,
    }
    kept = f32.copy()
    for what, call in cases.items():
        assert call() is NotImplemented, what
    check_equal(f32, kept, "declined calls move nothing")
    x = np.full(3, r + 1, np.int64)
    comm.all_reduce(x)  # the executor numbered no call: the next one matches on every rank
    check_equal(x, np.full(3, n * (n + 1) // 2, np.int64), "all_reduce after declined calls")
    return len(cases)


def test_block_entries_decline_what_they_do_not_serve():
    run_ranks(3, _declined)


def _argument_errors(comm):
    n, r = comm.size, comm.rank
    strided = np.ones(4 * n, np.float32)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_gather(strided)
    with pytest.raises(ValueError, match="read-only"):
        comm.all_gather(np.ones(2, np.float32), out=_read_only(np.ones(2 * n, np.float32)))
    with pytest.raises(ValueError, match="read-only"):
        comm.all_to_all(_read_only(np.ones(2 * n, np.float32)))
    with pytest.raises(ValueError, match="contiguous"):
        comm.reduce_scatter(strided)
    with pytest.raises(ValueError, match="contiguous"):
        comm.gather(strided, 0)
    with pytest.raises(ValueError, match="contiguous"):
        comm.scatter(np.ones(2 * n, np.float32) if r == 0 else None, 0, out=np.ones(4, np.float32)[::2])
    # A declined call on the general path: an out of another dtype raises on every rank there.
    with pytest.raises(ValueError):
        comm.all_gather(np.ones(2, np.float32), out=np.ones(2 * n, np.float64))
    got = comm.all_gather(np.full(2, r, np.int32))  # every refused call was numbered as skipped
    check_equal(got, np.repeat(np.arange(n, dtype=np.int32), 2), "all_gather after refused calls")
    return True


@pytest.mark.parametrize("n", [2, 3])
def test_argument_errors_of_served_block_calls(n):
    run_ranks(n, _argument_errors)


def _refused_on_either_path(comm):
    """A call refused on every rank, by the fast entry on some (a plain ndarray) and by the
    general path on others (a subclass, which the entries decline): every rank numbers it
    alike, so the next collective matches."""
    _executor(comm)  # attached: the fast entries serve from here on
    n, r = comm.size, comm.rank
    ro = _read_only(np.ones(2 * n, np.float32))
    if r % 2:
        ro = ro.view(_Sub)
    for call in (lambda: comm.all_to_all(ro), lambda: comm.all_reduce(ro), lambda: comm.broadcast(ro, 0),
                 lambda: comm.reduce_scatter(ro, out=_read_only(np.ones(2, np.float32)))):
        with pytest.raises(ValueError, match="read-only"):
            call()
    got = comm.all_gather(np.full(2, r, np.int32))
    check_equal(got, np.repeat(np.arange(n, dtype=np.int32), 2), "all_gather after refusals on both paths")
    return True


@pytest.mark.parametrize("n", [2, 3])
def test_refusals_numbered_alike_on_the_fast_and_general_paths(n):
    run_ranks(n, _refused_on_either_path)

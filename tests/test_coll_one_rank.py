"""One-rank CPU collectives (linkwise.init() alone, or a split that leaves a rank alone): the
latency path of one rank (csrc/bindings/bind_solo.cc: a copy of x, or nothing in place, also
for async calls and barriers) must give bitwise what the general path gives, raise the same
errors with the same messages, and number its calls as the general path does, for every
collective x op x dtype, 0-size and 0-d arrays, out= of every kind (x itself, a fresh one, an
overlapping view, a wrong one); and it must serve the valid calls (never reaching _run)."""
from __future__ import annotations

import asyncio
import select

import numpy as np
import pytest

import linkwise
from linkwise._request import CollectiveRequest
from linkwise.errors import CommAbortedError

try:
    import ml_dtypes
    _ML_BF16 = [np.dtype(ml_dtypes.bfloat16)]
except ImportError:  # pragma: no cover - ml_dtypes is optional
    _ML_BF16 = []

DTYPES = [np.dtype(d) for d in ("int8", "uint8", "int32", "int64", "float16", "float32", "float64", "bool",
                                "int16", "complex64", ">f4", "V2")] + _ML_BF16
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor", "bogus", None]
SHAPES = [(0,), (), (5,), (3, 2)]
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
KINDS = REDUCING + ("broadcast", "all_gather", "all_to_all", "gather", "scatter")


@pytest.fixture(scope="module")
def comm():
    c = linkwise.init()
    assert c.size == 1
    yield c
    c.close()


def _array(shape, dt, seed: int) -> np.ndarray:
    """An array of shape and dtype dt whose bytes are random (bool: 0 or 1)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = rng.integers(0, 2 if dt.kind == "b" else 256, size=n, dtype=np.uint8)
    return raw.view(dt).reshape(shape) if n else np.empty(shape, dt)


def _outs(x: np.ndarray):
    """out= variants: (name, maker(x) -> out). Every collective of one rank needs out of x's size."""
    return [
        ("none", lambda a: None),
        ("x", lambda a: a),
        ("fresh", _filled_like),
        ("readonly", lambda a: _readonly(_filled_like(a))),
        ("bigger", lambda a: np.zeros(a.size + 1, a.dtype)),
        ("float64", lambda a: np.zeros(a.shape, np.float64 if a.dtype != np.float64 else np.float32)),
        ("noncontig", lambda a: np.zeros(a.size * 2, a.dtype)[::2]),
        ("list", lambda a: [0] * a.size),
        ("overlap", None),  # x and out from one buffer: made in _outcome
    ]


def _filled_like(a: np.ndarray) -> np.ndarray:
    out = np.empty(a.shape, a.dtype)
    out.reshape(-1).view(np.uint8)[:] = 0x5A
    return out


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _call(comm, kind, x, out, op, root, async_op):
    if kind == "all_reduce":
        return comm.all_reduce(x, op=op, out=out, async_op=async_op)
    if kind == "reduce":
        return comm.reduce(x, root=root, op=op, out=out, async_op=async_op)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(x, op=op, out=out, async_op=async_op)
    return getattr(comm, kind)(x, **({"root": root} if kind in ("broadcast", "gather", "scatter") else {}),
                               out=out, async_op=async_op)


def _outcome(comm, general: bool, kind, shape, dt, out_name, op, root, async_op, x_form="plain"):
    """What one call gives on one path: (how it returned: x, out, a new array, None, or the
    error's type and message; the result's dtype, shape and bytes; x's and out's bytes after;
    the collective numbers a refused call took)."""
    if out_name == "overlap":  # x and out from one buffer, out one element further
        n = int(np.prod(shape, dtype=np.int64))
        base = _array((n + 1,), dt, 1)
        x, out = base[:n].reshape(shape), base[1:].reshape(shape)
    else:
        x = _array(shape, dt, 1)
        out = dict(_outs(x))[out_name](x)
    if x_form == "readonly":
        x = _readonly(x.copy()) if out is not x else _readonly(x)
    elif x_form == "noncontig":
        x = np.repeat(x.reshape(-1), 2)[::2].reshape(shape) if x.size > 1 else x
    saved = comm.__dict__.get("_fast_shm")
    if general:
        comm._fast_shm = None  # the general path (what a one-rank call took before)
    seq = comm._coll_seq
    try:
        r = _call(comm, kind, x, out, op, root, async_op)
        if async_op:
            assert isinstance(r, CollectiveRequest)
            r = r.wait()
        how = "x" if r is x else "out" if r is out and out is not None else "none" if r is None else "new"
        res = (how, None if r is None or how == "out" and isinstance(out, list) else
               (r.dtype.str, r.shape, r.tobytes()))
    except AssertionError:
        raise  # the test's own check, not an outcome to compare
    except Exception as exc:  # noqa: BLE001 - compared below
        res = ("raised", type(exc).__name__, str(exc))
    finally:
        comm._fast_shm = saved
    after = (x.tobytes(), out.tobytes() if isinstance(out, np.ndarray) else None)
    # A refusal numbers its call (_skips_on_argument_error); a call that ran takes a message
    # number on the general path only: one rank sends no messages, so no number is compared.
    return res, after, comm._coll_seq - seq if res[0] == "raised" else None


def _cases():
    for kind in KINDS:
        for dt in DTYPES:
            for op in (OPS if kind in REDUCING else [""]):
                yield kind, dt, op


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_every_collective_matches_the_general_path(comm, async_op):
    """Every collective x op x dtype x shape x out= variant: the same outcome on both paths."""
    checked = 0
    for kind, dt, op in _cases():
        for shape in SHAPES:
            for out_name, _ in _outs(np.zeros(1)):
                args = (kind, shape, dt, out_name, op, 0, async_op)
                want, got = _outcome(comm, True, *args), _outcome(comm, False, *args)
                assert got == want, (kind, dt, op, shape, out_name)
                checked += 1
    assert checked > 4000


@pytest.mark.parametrize("x_form", ["readonly", "noncontig"])
@pytest.mark.parametrize("root", [0, 1, -1, True, np.int64(0), "0", None])
def test_roots_and_refused_inputs_match_the_general_path(comm, root, x_form):
    """Roots out of range or of another type, read-only and non-contiguous x: the same errors
    (or results) on both paths, and the same numbering."""
    for kind in KINDS:
        for dt in (np.dtype(np.float32), np.dtype(np.int32)):
            for out_name in ("none", "x", "fresh"):
                args = (kind, (6,), dt, out_name, "sum", root, False, x_form)
                assert _outcome(comm, False, *args) == _outcome(comm, True, *args), (kind, dt, out_name)


@pytest.mark.parametrize("env", [{"LINKWISE_CHUNK_SIZE": "bogus"}, {"LINKWISE_ALGO": "bogus"},
                                 {"LINKWISE_CHECK": "1"}, {"LINKWISE_CHUNK_SIZE": "65536"}])
def test_tunables_act_as_on_the_general_path(comm, monkeypatch, env):
    """A bad LINKWISE_CHUNK_SIZE or LINKWISE_ALGO fails every collective (barrier too) as on the
    general path; LINKWISE_CHECK numbers its check exchange there too."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for kind in KINDS:
        for async_op in (False, True):
            args = (kind, (4,), np.dtype(np.float32), "fresh", "sum", 0, async_op)
            assert _outcome(comm, False, *args) == _outcome(comm, True, *args), kind
    for async_op in (False, True):
        outcomes = []
        for general in (True, False):
            saved = comm._fast_shm
            if general:
                comm._fast_shm = None
            try:
                r = comm.barrier(async_op=async_op)
                outcomes.append(("ok", r.wait() if async_op else r))
            except Exception as exc:  # noqa: BLE001 - compared below
                outcomes.append((type(exc).__name__, str(exc)))
            finally:
                comm._fast_shm = saved
        assert outcomes[0] == outcomes[1]
        assert ("bogus" in str(outcomes[0])) == ("bogus" in str(env))


def test_valid_calls_are_served_without_the_general_path(comm, monkeypatch):
    """The one-rank latency path serves valid calls, blocking and async (their request done at
    once, with a readable eventfd), and barriers: _run (the general path) is never reached."""
    def general(*args, **kwargs):
        raise AssertionError("the general path ran")
    monkeypatch.setattr(comm, "_run", general)
    for kind in KINDS:
        for dt in (np.dtype(np.float32), np.dtype("V2")) if kind == "all_reduce" else (np.dtype(np.float32),):
            for out_name in ("none", "x", "fresh"):
                for async_op in (False, True):
                    res, _, _ = _outcome(comm, False, kind, (4,), dt, out_name, "sum", 0, async_op)
                    assert res[0] != "raised", (kind, dt, out_name, async_op, res)
    assert comm.barrier() is None
    req = comm.barrier(async_op=True)
    assert req.done and req.test() and req.wait() is None
    x = np.arange(4, dtype=np.float32)
    req = comm.all_reduce(x, async_op=True)
    assert req.done and select.select([req.fileno()], [], [], 0)[0] == [req.fileno()]
    assert req.wait() is x and linkwise.wait_all([req]) == [x]

    async def coroutines():
        assert await comm.aall_reduce(x, op="max") is x
        assert (await comm.aall_gather(x) == x).all()
        assert await comm.abarrier() is None
    asyncio.run(coroutines())


def test_a_split_alone_and_a_closed_one(comm):
    """A split that leaves the rank alone takes the same path; after close every collective
    raises CommAbortedError, blocking, async and as a barrier."""
    sub = comm.split(0)
    x = np.arange(6, dtype=np.int32)
    assert sub.size == 1 and sub.all_reduce(x, op="avg") is x and (x == np.arange(6)).all()
    assert (sub.all_gather(x) == x).all() and sub.reduce_scatter(x, op="bxor").tobytes() == x.tobytes()
    sub.close()
    for call in (lambda: sub.all_reduce(x), lambda: sub.all_reduce(x, async_op=True), sub.barrier,
                 lambda: sub.barrier(async_op=True), lambda: sub.gather(x), lambda: sub.scatter(x),
                 lambda: sub.broadcast(x, out=x.copy()), lambda: sub.all_to_all(x)):
        with pytest.raises(CommAbortedError, match="closed communicator"):
            call()


def test_the_latency_entries_say_whether_they_serve_async_calls(comm):
    """One rule, the entries' serves_async (SoloColl: True; the executor's ShmColl: False), and
    not the communicator's size, decides whether an async call may take a latency entry and
    whether the general path runs it at once. Entries that serve blocking calls only, on a
    one-rank communicator, see its blocking calls and none of its async ones, which go to the
    worker in issue order and still give the same results."""
    from linkwise import _native
    assert _native.SoloColl.serves_async is True and _native.ShmColl.serves_async is False
    assert comm._fast_shm.serves_async is True
    sub = comm.split(0)
    solo, seen = sub._fast_shm, []

    class BlockingOnly:  # as a many-rank executor's entries: blocking calls only
        serves_async = False

        def __getattr__(self, name):
            def entry(*args):
                seen.append(name)
                return getattr(solo, name)(*args)
            return entry
    try:
        sub._fast_shm = BlockingOnly()
        x = np.arange(6, dtype=np.float32)
        assert sub.all_reduce(x) is x and seen == ["all_reduce_fast"]
        reqs = [sub.all_reduce(x, async_op=True), sub.broadcast(x, async_op=True),
                sub.all_gather(x, async_op=True), sub.reduce_scatter(x, async_op=True),
                sub.gather(x, async_op=True), sub.scatter(x, async_op=True),
                sub.reduce(x, async_op=True), sub.all_to_all(x, async_op=True)]
        results = linkwise.wait_all(reqs)
        assert seen == ["all_reduce_fast"], seen
        assert results[0] is x and results[1] is x and (x == np.arange(6)).all()
        assert all((r == x).all() for r in results[2:6]), results
        assert sub.__dict__.get("_coll_worker") is not None  # not run at once: queued in order
    finally:
        sub.close()

"""bfloat16 and PyTorch tensors in the host collectives.

A CPU torch.bfloat16 tensor (which np.from_dlpack refuses) is reduced, broadcast, gathered and
sent as bfloat16 through a view of its bits, with ml_dtypes or without it; an unstructured
2-byte NumPy void array ("V2") reduces as bfloat16, a structured one stays refused; every host
collective returns the caller's own object where its result lands (in place: x, with out=: out)
in its blocking, async and coroutine forms; ``linkwise bench -d bfloat16`` checks with 0 wrong
and compares with Gloo."""
from __future__ import annotations

import asyncio
import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest

from linkwise.bench import common
from array_wrappers import DlpackOnly
from multirank import run_ranks
from test_bench import SRC, TINY, _data_rows, bench

# One-shot, and two-shot through the shared segment (40 KB > its 32 KiB one-shot area).
COUNTS = [5, 20_001]
CASES = [(2, {}), (3, {}), (3, {"LINKWISE_ALGO": "ring", "LINKWISE_CHUNK_SIZE": "4K"})]


def _vals(rank: int, n: int) -> np.ndarray:
    """Rank's input: small integers, exact in bfloat16, and so are their sums and maxima."""
    return ((np.arange(n) * 7 + rank * 3) % 11 - 5).astype(np.float32)


def _refs(ins: list) -> dict:
    total = np.sum(ins, axis=0, dtype=np.float32)
    return {"sum": total, "max": np.max(ins, axis=0), "avg": total / np.float32(len(ins))}


def _check(got: np.ndarray, want: np.ndarray, op: str, what: str) -> None:
    if op == "avg":  # rounded to bfloat16 once: within half a step of its 8-bit significand
        np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=0, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


# -- torch.bfloat16 ---------------------------------------------------------------------------
def _torch_bf16_body(comm):
    import torch
    bf = torch.bfloat16
    size, rank = comm.size, comm.rank
    for n in COUNTS:
        ins = [_vals(r, n) for r in range(size)]

        def mine():
            return torch.from_numpy(ins[rank]).to(bf)
        for op, want in _refs(ins).items():
            t = mine()
            assert comm.all_reduce(t, op=op) is t, op
            assert t.dtype == bf
            _check(t.float().numpy(), want, op, f"all_reduce {op} n={n} in place")
            t, out = mine(), torch.zeros(n, dtype=bf)
            assert comm.all_reduce(t, op=op, out=out) is out, op
            _check(out.float().numpy(), want, op, f"all_reduce {op} n={n} out=")
            np.testing.assert_array_equal(t.float().numpy(), ins[rank])  # x untouched
        t = mine()
        assert comm.broadcast(t, root=size - 1) is t
        np.testing.assert_array_equal(t.float().numpy(), ins[-1])
        out = torch.zeros(n, dtype=bf)
        assert comm.broadcast(mine(), root=0, out=out) is out
        np.testing.assert_array_equal(out.float().numpy(), ins[0])
        g = comm.all_gather(mine())  # allocated: a NumPy array of ml_dtypes' bfloat16
        assert type(g) is np.ndarray and g.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(g.astype(np.float32), np.concatenate(ins))
        out = torch.zeros(n * size, dtype=bf)
        assert comm.all_gather(mine(), out=out) is out
        np.testing.assert_array_equal(out.float().numpy(), np.concatenate(ins))
    # send / recv / irecv share the view (comm._as_buffer)
    x = torch.full((7,), rank + 0.5, dtype=bf)
    if rank == 0:
        comm.send(x, 1, tag=3)
        comm.isend(x, 1, tag=4).wait()
    elif rank == 1:
        assert comm.recv(x, 0, tag=3) == 14
        y = torch.zeros(7, dtype=bf)
        comm.irecv(y, 0, tag=4).wait()
        assert x.tolist() == y.tolist() == [0.5] * 7
    comm.barrier()
    return True


@pytest.mark.parametrize("n,env", CASES, ids=["2", "3", "3-ring"])
def test_torch_bfloat16_collectives(n, env):
    pytest.importorskip("torch")
    assert run_ranks(n, _torch_bf16_body, env=env, timeout=120) == [True] * n


def _dlpack_only_body(comm):
    import torch
    t = torch.full((5,), comm.rank + 1.5, dtype=torch.bfloat16)
    comm.all_reduce(DlpackOnly(t), op="sum")  # in place, in t's own memory
    got = torch.zeros(comm.size * 5, dtype=torch.bfloat16)
    comm.all_gather(DlpackOnly(t), out=DlpackOnly(got))
    x = torch.full((3,), 7.25 + comm.rank, dtype=torch.bfloat16)
    y = torch.zeros(3, dtype=torch.bfloat16)
    peer = 1 - comm.rank
    comm.sendrecv(DlpackOnly(x), peer, DlpackOnly(y), peer)
    return t.tolist(), got.tolist(), y.tolist()


def test_bfloat16_known_only_by_dlpack():
    # Before, refused ("cannot view DlpackOnly through DLPack"): NumPy has no bfloat16, and
    # the torch view took real tensors only.
    pytest.importorskip("torch")
    got = run_ranks(2, _dlpack_only_body, timeout=60)
    for rank, (t, gathered, y) in enumerate(got):
        assert t == [4.0] * 5 and gathered == [4.0] * 10 and y == [7.25 + (1 - rank)] * 3, got


def _no_ml_dtypes_body(comm):
    import torch
    from linkwise import _bf16
    sys.modules["ml_dtypes"] = None  # as if not installed: the view is typed "V2"
    _bf16._dtype = None
    t = torch.full((6,), comm.rank + 1.5, dtype=torch.bfloat16)
    assert comm.all_reduce(t, op="max") is t
    g = comm.all_gather(t)
    bits = (g.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return t.tolist(), g.dtype.str, bits.tolist()


def test_torch_bfloat16_without_ml_dtypes():
    pytest.importorskip("torch")
    got = run_ranks(2, _no_ml_dtypes_body, timeout=60)
    assert got == [([2.5] * 6, "|V2", [2.5] * 12)] * 2


# -- the caller's own object comes back -------------------------------------------------------
def _same_object_body(comm):
    import torch
    size, rank = comm.size, comm.rank
    total = size * (size + 1) / 2

    def x(k=2 * size):
        return torch.full((k,), rank + 1.0)

    def empty(k=2 * size):
        return torch.zeros(k)
    got = {}
    a = x()
    got["all_reduce"] = comm.all_reduce(a) is a and a.tolist() == [total] * (2 * size)
    n = np.ones(3, np.float32)  # the NumPy latency path (set up by the first call) returns x too
    got["numpy"] = comm.all_reduce(n) is n and n.tolist() == [size] * 3
    a, o = x(), empty()
    got["all_reduce out"] = comm.all_reduce(a, out=o) is o and o.tolist() == [total] * (2 * size)
    a, o = np.full(4, rank + 1.0, np.float32), empty(4)  # a NumPy x, a tensor out
    got["all_reduce numpy x"] = comm.all_reduce(a, out=o) is o and o.tolist() == [total] * 4
    a = x()
    got["broadcast"] = comm.broadcast(a, root=1) is a and a.tolist() == [2.0] * (2 * size)
    a, o = x(), empty()
    got["broadcast out"] = comm.broadcast(a, root=0, out=o) is o and o.tolist() == [1.0] * (2 * size)
    a = x()
    got["reduce"] = comm.reduce(a, root=0) is a
    a, o = x(), empty()
    got["reduce out"] = comm.reduce(a, root=0, out=o) is o
    o = empty(2 * size * size)
    got["all_gather out"] = comm.all_gather(x(), out=o) is o and o.sum().item() == 2 * size * total
    o = empty(2)
    got["reduce_scatter out"] = comm.reduce_scatter(x(), out=o) is o and o.tolist() == [total] * 2
    a = x()
    got["all_to_all"] = comm.all_to_all(a) is a
    a, o = x(), empty()
    got["all_to_all out"] = comm.all_to_all(a, out=o) is o
    o = empty(2 * size * size)
    r = comm.gather(x(), root=0, out=o)
    got["gather out"] = r is o if rank == 0 else r is None
    o = empty(2)
    got["scatter out"] = comm.scatter(x(), root=0, out=o) is o and o.tolist() == [1.0] * 2
    ba = bytearray(b"\x01" * 4)  # any buffer-protocol object comes back as itself
    got["bytearray"] = comm.all_reduce(ba) is ba and list(ba) == [size] * 4
    got["allocated"] = (type(comm.all_gather(x())) is np.ndarray
                        and type(comm.reduce_scatter(x())) is np.ndarray)
    a, o = x(), empty()
    got["async"] = comm.all_reduce(a, async_op=True).wait() is a
    got["async out"] = comm.broadcast(a, out=o, async_op=True).wait() is o
    o = empty(2 * size * size)
    got["async all_gather out"] = comm.all_gather(x(), out=o, async_op=True).wait() is o

    async def coros():
        a, o = x(), empty()
        return (await comm.aall_reduce(a)) is a and (await comm.aall_reduce(a, out=o)) is o
    got["await"] = asyncio.run(coros())
    return got


def test_collectives_return_the_callers_object():
    pytest.importorskip("torch")
    for got in run_ranks(3, _same_object_body, timeout=60):
        assert all(got.values()), {k: v for k, v in got.items() if not v}
        assert len(got) == 20


# -- NumPy void and ml_dtypes -----------------------------------------------------------------
def _to_v2(f: np.ndarray) -> np.ndarray:
    """float32 values exact in bfloat16 -> their bfloat16 bits as an unstructured "V2" array."""
    return (f.view(np.uint32) >> 16).astype(np.uint16).view("V2")


def _from_v2(v: np.ndarray) -> np.ndarray:
    return (v.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _void_body(comm):
    size, rank = comm.size, comm.rank
    for n in COUNTS:
        ins = [_vals(r, n) for r in range(size)]
        for op, want in (("sum", np.sum(ins, 0)), ("min", np.min(ins, 0)), ("prod", np.prod(ins, 0))):
            v = _to_v2(ins[rank])
            assert v.dtype.kind == "V" and v.dtype.names is None
            assert comm.all_reduce(v, op=op) is v
            np.testing.assert_array_equal(_from_v2(v), want, err_msg=f"V2 {op} n={n}")
        blocks = np.concatenate([_vals(r, 3 * size) for r in range(size)]).reshape(size, -1)
        r = comm.reduce_scatter(_to_v2(blocks[rank]))
        assert r.dtype == np.dtype("V2")
        np.testing.assert_array_equal(_from_v2(r), blocks.sum(0)[rank * 3:(rank + 1) * 3])
    with pytest.raises(TypeError, match="cannot be reduced"):  # a structured dtype is no bfloat16
        comm.all_reduce(np.zeros(4, [("a", "u1"), ("b", "u1")]))
    # ml_dtypes' bfloat16 (no buffer protocol) also goes point to point
    m = np.full(5, rank + 0.25, ml_dtypes.bfloat16)
    if rank == 0:
        comm.send(m, 1)
    elif rank == 1:
        comm.recv(m, 0)
        assert m.astype(np.float32).tolist() == [0.25] * 5
    comm.barrier()
    return True


@pytest.mark.parametrize("n,env", CASES, ids=["2", "3", "3-ring"])
def test_void2_reduces_as_bfloat16(n, env):
    assert run_ranks(n, _void_body, env=env, timeout=120) == [True] * n


def _mixed_forms_body(comm):
    """Rank 0 passes "V2", the others ml_dtypes' bfloat16: one dtype, also to LINKWISE_CHECK."""
    rank, size = comm.rank, comm.size
    mine = _vals(rank, 4)
    x = _to_v2(mine) if rank == 0 else mine.astype(ml_dtypes.bfloat16)
    as_f32 = (lambda a: _from_v2(a)) if rank == 0 else (lambda a: a.astype(np.float32))
    np.testing.assert_array_equal(as_f32(comm.all_gather(x)), np.concatenate([_vals(r, 4) for r in range(size)]))
    y = x.copy()
    comm.broadcast(y, root=size - 1)
    np.testing.assert_array_equal(as_f32(y), _vals(size - 1, 4))
    comm.all_reduce(x)
    np.testing.assert_array_equal(as_f32(x), np.sum([_vals(r, 4) for r in range(size)], 0))
    return True


@pytest.mark.parametrize("check", ["0", "1"])
def test_mixed_bfloat16_forms_across_ranks(check):
    env = {"LINKWISE_CHECK": "1"} if check == "1" else {}
    assert run_ranks(3, _mixed_forms_body, env=env, timeout=60) == [True] * 3


# -- linkwise bench -d bfloat16 ---------------------------------------------------------------
def test_bench_bfloat16_types_and_checks():
    bf = common.DTYPES["bfloat16"]
    assert common.resolve_dtypes("bf16") == ["bfloat16"] and "bfloat16" in common.resolve_dtypes("all")
    assert common.is_float(bf)
    stack = np.array([[1, 2], [4, 3], [2, 3]], bf)
    avg = common.reduce_reference(stack, "avg", bf)  # floats, not floored like integers
    assert avg.dtype == bf and avg.astype(np.float32).tolist() == [2.328125, 2.671875]
    got = avg.copy()
    assert common.count_wrong(got, avg, "avg") == 0
    got[1] = 2.0
    assert common.count_wrong(got, avg, "avg") == 1


@pytest.mark.parametrize("coll", ["all_reduce", "all_gather"])
def test_bench_bfloat16_has_no_wrong(coll, tmp_path):
    out = tmp_path / "bf16.json"
    r = bench(coll, *TINY, "-c", "1", "-d", "bfloat16" if coll == "all_reduce" else "bf16",
              "-o", "sum,max,avg", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["systems"]["linkwise"]["rows"]
    assert rows and {row["type"] for row in rows} == {"bfloat16"}
    assert len(rows) == (9 if coll == "all_reduce" else 3)  # 3 sizes (x 3 ops)
    for row in rows:
        assert row["oop"]["wrong"] == 0 and row["ip"]["wrong"] == 0, row
    assert "# Out of bounds values : 0 OK" in r.stdout


def test_bench_bfloat16_without_ml_dtypes_is_one_clear_error(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['ml_dtypes'] = None\n")
    env = {"PYTHONPATH": f"{shim}{os.pathsep}{SRC}"}
    r = bench("all_reduce", "-b", "8", "-e", "8", "-n", "2", "-w", "1", "--no-progress", "-d", "bf16",
              env=env)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bfloat16" in lines[0] and "pip install ml_dtypes" in lines[0], r.stderr
    r = bench("all_reduce", "-b", "8", "-e", "8", "-n", "2", "-w", "1", "--no-progress", "-d", "all",
              "-c", "1", env=env)  # all: every type but bfloat16
    assert r.returncode == 0, r.stderr
    assert [row[2] for row in _data_rows(r.stdout)] == [t for t in common.DTYPES if t != "bfloat16"]


def test_bench_bfloat16_compare_gloo(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "gloo.json"
    r = bench("all_reduce", "-b", "8", "-e", "64", "-f", "8", "-n", "2", "-w", "1", "--no-progress",
              "-d", "bfloat16", "-c", "1", "--compare", "gloo", "--json", str(out), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _data_rows(r.stdout)
    assert [row[2] for row in rows] == ["bfloat16", "bfloat16"]
    assert all(float(row[-1]) > 0 for row in rows), r.stdout  # lw/gloo, compared in place
    gloo = json.loads(out.read_text())["systems"]["gloo"]["rows"]
    assert all(row["ip"]["time_us"] > 0 and row["ip"]["wrong"] == 0 for row in gloo), gloo

"""Collectives on CUDA arrays route to the GPU data plane; host arrays are unaffected.

CPU-only checks run everywhere (a stand-in object with ``__cuda_array_interface__`` looks like
a CUDA array, and every error here is raised before any GPU work); the ``gpu`` tests go through
``comm.all_reduce(tensor)`` and friends on real GPUs against NumPy references.
"""
from __future__ import annotations

import numpy as np
import pytest
from multirank import run_ranks
from test_gpu_collectives import SAFE_ENV


class FakeCuda:
    """Looks like a CUDA array to linkwise's cheap test; has no real memory."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}
    shape = (4,)


def _cpu_body(comm, _):
    x = np.arange(8, dtype=np.float32) + comm.rank
    got = comm.all_reduce(x.copy())
    assert np.array_equal(got, sum(np.arange(8, dtype=np.float32) + r for r in range(comm.size)))
    b = np.arange(5, dtype=np.int64) if comm.rank == 0 else np.zeros(5, np.int64)
    comm.broadcast(b, root=0)
    assert np.array_equal(b, np.arange(5))
    g = comm.all_gather(np.full(3, comm.rank, np.int32))
    assert np.array_equal(g, np.repeat(np.arange(comm.size, dtype=np.int32), 3))
    rs = comm.reduce_scatter(np.ones(2 * comm.size, np.float64))
    assert np.array_equal(rs, np.full(2, comm.size, np.float64))
    comm.barrier()
    errors = []
    fake = FakeCuda()
    checks = [
        # async_op=True works on CUDA arrays (test_gpu_robust.py); its arguments are still
        # checked before any GPU work.
        (lambda: comm.all_reduce(fake, async_op=True, dtype="float32"), "dtype="),
        (lambda: comm.reduce(fake, async_op=True), "reduce"),
        (lambda: comm.all_reduce(fake, dtype="float32"), "dtype="),
        (lambda: comm.reduce(fake), "reduce"),
        (lambda: comm.gather(fake), "gather"),
        (lambda: comm.scatter(fake), "scatter"),
        (lambda: comm.all_reduce(fake, out=np.zeros(4, np.float32)), "CUDA array but out is not"),
        (lambda: comm.all_gather(fake, out=np.zeros(4 * comm.size, np.float32)), "CUDA array but out is not"),
        (lambda: comm.all_reduce(np.zeros(4, np.float32), out=fake), "host array but out is a CUDA"),
        (lambda: comm.reduce_scatter(np.zeros(4 * comm.size, np.float32), out=fake), "host array but out"),
        (lambda: comm.broadcast(np.zeros(4, np.float32), out=fake), "host array but out"),
        (lambda: comm.all_to_all(np.zeros(4 * comm.size, np.float32), out=fake), "host array but out"),
    ]
    for fn, want in checks:
        try:
            fn()
            errors.append(f"no error for {want}")
        except TypeError as exc:
            if want not in str(exc):
                errors.append(f"{want!r} not in {exc}")
    # The host path still works after the rejected calls (nothing was half-issued).
    x = np.ones(3, np.float32)
    comm.all_reduce(x)
    assert np.array_equal(x, np.full(3, comm.size, np.float32))
    return errors


@pytest.mark.parametrize("n", [1, 3])
def test_host_path_unaffected_and_clear_errors(n):
    for errs in run_ranks(n, _cpu_body, None, timeout=120):
        assert errs == []


def _device_mismatch_body(comm, kind):
    """Under LINKWISE_CHECK, rank 0 passes a CUDA array and the others host arrays: every rank
    raises the agreement error naming both kinds of array (nothing is issued on the GPU: the
    check runs before the GPU side is set up), and the communicator still works afterwards."""
    x = FakeCuda() if comm.rank == 0 else np.zeros(4, np.float32)
    call = {"all_reduce": lambda: comm.all_reduce(x), "broadcast": lambda: comm.broadcast(x, root=0),
            "all_gather": lambda: comm.all_gather(x)}[kind]
    try:
        call()
        return "no error"
    except ValueError as exc:
        msg = str(exc)
        if "disagree" not in msg or "CUDA array" not in msg or "host array" not in msg:
            return f"unclear error: {msg}"
    y = np.ones(3, np.float32)
    comm.all_reduce(y)
    return "raised" if np.array_equal(y, np.full(3, comm.size, np.float32)) else "wrong after"


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "all_gather"])
def test_check_mixed_devices_raises_everywhere(kind):
    assert run_ranks(3, _device_mismatch_body, kind, env={"LINKWISE_CHECK": "1"}, timeout=60) == ["raised"] * 3


def _gpu_check_body(comm, _):
    """LINKWISE_CHECK with real CUDA arrays: agreeing calls run (correct results), a size that
    differs on the last rank raises on every rank, and the next call works."""
    import torch
    torch.cuda.set_device(comm.cuda().device)
    n, r = comm.size, comm.rank
    x = torch.full((1000,), float(r + 1), device="cuda")
    comm.all_reduce(x)
    out = []
    if not torch.equal(x.cpu(), torch.full((1000,), float(n * (n + 1) // 2))):
        out.append("all_reduce under LINKWISE_CHECK wrong")
    if n > 1:  # on one GPU there is no other rank to disagree with
        try:
            comm.broadcast(torch.zeros(7 + (r == n - 1), device="cuda"), root=0)
            out.append("no error for a size mismatch")
        except ValueError as exc:
            if "disagree" not in str(exc):
                out.append(f"unclear error: {exc}")
    b = torch.full((5,), float(r), device="cuda")
    comm.broadcast(b, root=n - 1)
    if not torch.equal(b.cpu(), torch.full((5,), float(n - 1))):
        out.append("broadcast after the error wrong")
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
def test_check_on_cuda_arrays():
    import torch
    n = min(4, torch.cuda.device_count())
    for bad in run_ranks(n, _gpu_check_body, None, env={**SAFE_ENV, "LINKWISE_CHECK": "1"}, timeout=300):
        assert bad == []


def _gpu_body(comm, sizes):
    import torch
    torch.cuda.set_device(comm.cuda().device)
    n, r = comm.size, comm.rank
    bad = []

    def inp(q, count, seed):
        return torch.from_numpy(np.random.default_rng([seed, q, count]).integers(-50, 50, count).astype(np.float32))

    for i, count in enumerate(sizes):
        ins = [inp(q, count, i) for q in range(n)]
        x = ins[r].cuda()
        assert comm.all_reduce(x) is x
        want = sum(ins[1:], ins[0].clone())
        if not torch.equal(x.cpu(), want):
            bad.append(f"all_reduce {count}")
        out = torch.empty_like(x)
        comm.all_reduce(ins[r].cuda(), op="max", out=out)
        if not torch.equal(out.cpu(), torch.stack(ins).max(0).values):
            bad.append(f"all_reduce max out= {count}")
        b = ins[r].cuda()
        comm.broadcast(b, root=n - 1)
        if not torch.equal(b.cpu(), ins[n - 1]):
            bad.append(f"broadcast {count}")
        g = comm.all_gather(ins[r].cuda())
        if not torch.equal(g.cpu(), torch.cat(ins)):
            bad.append(f"all_gather {count}")
        full = torch.cat([t.repeat(n) for t in ins[:1]])  # shape n*count
        xs = [torch.cat([ins[q]] * n) for q in range(n)]
        rs = comm.reduce_scatter(xs[r].cuda())
        total = sum(xs[1:], xs[0].clone())
        if not torch.equal(rs.cpu(), total[r * count:(r + 1) * count]):
            bad.append(f"reduce_scatter {count}")
        del full
        a = xs[r].cuda()
        comm.all_to_all(a)
        want_a = torch.cat([xs[q][r * count:(r + 1) * count] for q in range(n)])
        if not torch.equal(a.cpu(), want_a):
            bad.append(f"all_to_all in place {count}")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = torch.full((1000,), float(r + 1), device="cuda")
    comm.all_reduce(y, stream=s)
    comm.barrier(stream=s)
    if not torch.equal(y.cpu(), torch.full((1000,), float(n * (n + 1) // 2))):
        bad.append("all_reduce on a side stream")
    torch.cuda.synchronize()
    return bad


@pytest.mark.gpu
def test_collectives_route_cuda_arrays():
    import torch
    n = min(4, torch.cuda.device_count())
    for bad in run_ranks(n, _gpu_body, [1, 1000, 300001], env=SAFE_ENV, timeout=300):
        assert bad == []

"""The eager fast path (linkwise/cuda/fast.py) and the out-of-place broadcast, on real GPUs.

* ``comm.all_reduce`` / ``comm.broadcast`` on torch CUDA tensors (and cupy arrays where cupy is
  installed) take the fast path for every dtype and op, in place and out=, and give the
  rank-order NumPy/torch reference bitwise (the general path ``_gpu_coll.dispatch`` is replaced by
  a tripwire while they run, so a call that fell through to it is counted as a failure);
* what the fast path declines still raises the general path's clear errors (CUDA x with a host
  out, unsupported dtype or op, bad root, out of another size on the root), and the refusal
  stops the GPU plane on every rank (cuda/refusal.py: a peer may be waiting): one case a run;
* out-of-place broadcast (root's kernel reads x and writes out itself up to the LL limit, a
  copy on the stream first above it): sizes 0, 1, odd, misaligned, 256 KiB and above the LL
  limit, every root, through the communicator and through GpuComm; the root's x and every
  non-root's x stay untouched;
* both captured in a CUDA graph and replayed with new inputs.
"""
from __future__ import annotations

import pytest

from multirank import run_ranks
from test_gpu_collectives import DTYPES, OPS, SAFE_ENV, _check, _nranks, _setup

pytestmark = pytest.mark.gpu

# float32 counts: 256 KiB = 65536 (the LL limit: two-phase LL with 3+ ranks), 65537 and
# 300001 take the flag kernels (root copies first).
BCAST_COUNTS = [0, 1, 7, 1000, 4097, 65536, 65537, 300001]


def _tripwire(comm):
    """Replaces the general GPU dispatch; returns the list of calls that reached it."""
    import linkwise._gpu_coll as gc
    hits, real = [], gc.dispatch

    def dispatch(c, op, x, **kw):
        hits.append(op)
        return real(c, op, x, **kw)
    gc.dispatch = dispatch
    return hits, lambda: setattr(gc, "dispatch", real)


def _fast_body(comm, counts):
    from gpu_util import collector, host_input, reference
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors: list = []
    expect = collector(r, errors)
    if comm._gpu_fast is None:
        return [f"rank {r}: no fast path installed"]
    hits, restore = _tripwire(comm)
    try:
        for i, (dt, op) in enumerate((d, o) for d in DTYPES for o in OPS):
            for count in counts:
                ins = [host_input(q, count, dt, op, seed=i) for q in range(n)]
                want = reference(ins, dt, op)
                x = ins[r].cuda()
                assert comm.all_reduce(x, op=op) is x
                expect(f"all_reduce {dt} {op} {count}", x, want)
                out = torch.full_like(x, 3)
                y = ins[r].cuda()
                assert comm.all_reduce(y, op=op, out=out) is out
                expect(f"all_reduce out= {dt} {op} {count}", out, want)
                expect(f"all_reduce out= x untouched {dt} {count}", y, ins[r])
        for count in counts:
            root = count % n
            src = host_input(root, count, "int64", "sum", seed=99)
            b = (src if r == root else torch.zeros(count, dtype=torch.int64)).cuda()
            assert comm.broadcast(b, root=root) is b
            expect(f"broadcast {count} root {root}", b, src)
    finally:
        restore()
    if hits:
        errors.append(f"rank {r}: {len(hits)} eligible calls took the general path: {hits[:5]}")
    torch.cuda.synchronize()
    return errors


# What the fast path declines: (the call, the error, words of its message, only the root calls)
DECLINED = {
    "host out": (lambda comm, x, torch: comm.all_reduce(x, out=torch.zeros(4)), TypeError,
                 "CUDA array but out is not", False),
    "uint8": (lambda comm, x, torch: comm.all_reduce(torch.ones(4, dtype=torch.uint8, device="cuda")),
              TypeError, "not supported", False),
    "op": (lambda comm, x, torch: comm.all_reduce(x, op="xor"), ValueError, "op must be", False),
    "root": (lambda comm, x, torch: comm.broadcast(x, root=comm.size), ValueError, "root", False),
    "root's out dtype": (lambda comm, x, torch: comm.broadcast(
        x, root=0, out=torch.empty(x.numel(), dtype=torch.int32, device="cuda")),
        ValueError, "same dtype", True),  # only the root checks out's dtype and size
    "root's out size": (lambda comm, x, torch: comm.broadcast(x, root=0, out=torch.empty(5, device="cuda")),
                        ValueError, "same size", True),
}


def _declined_body(comm, case):
    """A call the fast path declines, after it served one: the general path's error, and the GPU
    plane stopped on every rank (the next call raises CommAbortedError). One rank: nobody can be
    waiting for it, so the refusal stops nothing (refusal.py) and the plane goes on."""
    import linkwise
    g, torch = _setup(comm)
    fn, exc, text, root_only = DECLINED[case]
    stops = comm.size > 1
    errors = []
    x = torch.ones(4, device="cuda")
    comm.all_reduce(x)  # the fast path, working
    torch.cuda.synchronize()
    if comm._gpu_fast is None or not torch.equal(x.cpu(), torch.full((4,), float(comm.size))):
        errors.append(f"rank {comm.rank}: the fast path before the declined call")
    if comm.rank == 0 or not root_only:
        try:
            fn(comm, x, torch)
            errors.append(f"rank {comm.rank}: no error for {case} ({text})")
        except exc as e:
            if text not in str(e) or ("stopped on every rank" in str(e)) != stops:
                errors.append(f"rank {comm.rank}: {case}: {text!r} (and the stop: {stops}) not in {e}")
    try:
        comm.all_reduce(x)
        torch.cuda.synchronize()
        g.check()
        if stops:
            errors.append(f"rank {comm.rank}: the GPU plane went on after {case}")
    except linkwise.CommAbortedError:
        if not stops:
            errors.append(f"rank {comm.rank}: the one-rank GPU plane stopped after {case}")
    return errors


@pytest.mark.parametrize("case", list(DECLINED))
def test_fast_path_declines_raise_the_general_paths_errors(case):
    env = {**SAFE_ENV, "LINKWISE_TIMEOUT": "30"}
    _check(run_ranks(_nranks(), _declined_body, case, env=env, timeout=120))


def test_fast_path_all_dtypes_and_ops():
    _check(run_ranks(_nranks(), _fast_body, [1, 7, 4097], env=SAFE_ENV, timeout=300))


def _oop_body(comm, counts):
    from gpu_util import collector
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors: list = []
    expect = collector(r, errors)
    for k, count in enumerate(counts):
        for off in (0, 1):
            for root in range(n):
                seed = 1000 * k + 10 * root + off
                # bytes, at an odd offset when off: the kernel's element width falls to 1
                src = (torch.arange(count * 4, dtype=torch.int64) * 13 + seed) % 251
                src = src.to(torch.uint8)
                xb = torch.empty(count * 4 + off, dtype=torch.uint8, device="cuda")
                ob = torch.empty(count * 4 + off, dtype=torch.uint8, device="cuda")
                x, out = xb[off:], ob[off:]
                mine = src if r == root else torch.full_like(src, 5)
                x.copy_(mine)
                out.fill_(9)
                via = "comm" if (k + root) % 2 == 0 else "gpucomm"
                if via == "comm":
                    got = comm.broadcast(x, root=root, out=out)
                else:
                    got = g.broadcast(x, root=root, out=out)
                if got is not out:
                    errors.append(f"rank {r}: {via} broadcast out= returned another object")
                expect(f"{via} broadcast out= {count * 4} B +{off} root {root}", out, src)
                expect(f"{via} broadcast out= x untouched {count * 4} B root {root}", x, mine)
    # float32 views through the fast path (element width 4/8/16 bytes)
    for count in counts:
        root = (count + 1) % n
        src = torch.arange(count, dtype=torch.float32) + 0.5 * root
        x = (src if r == root else torch.zeros(count)).cuda()
        out = torch.full((count,), -1.0, device="cuda")
        assert comm.broadcast(x, root=root, out=out) is out
        expect(f"float32 broadcast out= {count} root {root}", out, src)
    torch.cuda.synchronize()
    return errors


def test_broadcast_out_of_place():
    n = _nranks()
    _check(run_ranks(n, _oop_body, BCAST_COUNTS, env=SAFE_ENV, timeout=300))
    if n >= 3:
        _check(run_ranks(2, _oop_body, BCAST_COUNTS[:6], env=SAFE_ENV, timeout=300))


def _graph_body(comm, reps):
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    s = torch.cuda.Stream()
    x = torch.zeros(1000, device="cuda")
    y = torch.zeros(1000, device="cuda")
    bx = torch.zeros(3001, dtype=torch.uint8, device="cuda")
    bo = torch.zeros(3001, dtype=torch.uint8, device="cuda")
    root = n - 1
    with torch.cuda.stream(s):  # warm-up outside the capture
        comm.all_reduce(x, out=y)
        comm.broadcast(bx, root=root, out=bo)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        comm.all_reduce(x, out=y)
        comm.broadcast(bx, root=root, out=bo)
    for it in range(reps):
        x.copy_(torch.arange(1000, dtype=torch.float32) * (r + 1) + it)
        bx.copy_((torch.arange(3001) * 3 + it) % 256 if r == root else torch.zeros(3001))
        graph.replay()
        torch.cuda.synchronize()
        want = sum(torch.arange(1000, dtype=torch.float32) * (q + 1) + it for q in range(n))
        if not torch.equal(y.cpu(), want):
            errors.append(f"rank {r} replay {it}: all_reduce out= wrong")
        if not torch.equal(bo.cpu(), ((torch.arange(3001) * 3 + it) % 256).to(torch.uint8)):
            errors.append(f"rank {r} replay {it}: broadcast out= wrong")
    return errors


def test_fast_path_in_cuda_graph():
    _check(run_ranks(_nranks(), _graph_body, 5, env=SAFE_ENV, timeout=300))


def _cupy_body(comm, counts):
    import cupy
    import numpy as np
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    hits, restore = _tripwire(comm)
    try:
        with cupy.cuda.Device(g.device):
            for count in counts:
                x = cupy.asarray(np.arange(count, dtype=np.float32) * (r + 1))
                out = cupy.full(count, -1, dtype=np.float32)
                assert comm.all_reduce(x, out=out) is out
                want = sum(np.arange(count, dtype=np.float32) * (q + 1) for q in range(n))
                if not np.array_equal(cupy.asnumpy(out), want):
                    errors.append(f"rank {r}: cupy all_reduce out= {count}")
                b = cupy.asarray(np.arange(count, dtype=np.int64) if r == 0 else np.zeros(count, np.int64))
                comm.broadcast(b, root=0)
                if not np.array_equal(cupy.asnumpy(b), np.arange(count)):
                    errors.append(f"rank {r}: cupy broadcast {count}")
    finally:
        restore()
    if hits:
        errors.append(f"rank {r}: cupy calls took the general path: {hits[:4]}")
    return errors


def test_fast_path_cupy():
    pytest.importorskip("cupy")
    _check(run_ranks(_nranks(), _cupy_body, [1, 7, 4097], env=SAFE_ENV, timeout=300))

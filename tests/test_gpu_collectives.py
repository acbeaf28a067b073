"""GPU collectives and send/recv against NumPy references (linkwise.cuda.GpuComm).

Each test forks one rank per GPU (at most 4); every rank rebuilds every rank's input from a
seed, so the reference needs no communication. A small scratch slot (64 KiB) makes the larger
sizes span many pieces ("larger than the scratch area"). Results must match the reference
bitwise (kernels reduce in rank order in float32/float64/int) and be identical on all ranks.
"""
from __future__ import annotations

import hashlib
import os

import pytest

import linkwise

from multirank import run_ranks

pytestmark = pytest.mark.gpu

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SMALL_SLOT = {**SAFE_ENV, "LINKWISE_GPU_SLOT_BYTES": str(64 * 1024)}
SIZES = [0, 1, 7, 1000, 65537, 300001]
DTYPES = ["float32", "float16", "bfloat16", "int32", "float64", "int64"]
OPS = ["sum", "prod", "min", "max", "avg"]


def _nranks() -> int:
    """One rank per GPU, at most 4. LINKWISE_TEST_GPU_RANKS=n runs n ranks on the GPUs there
    are (local_rank % count: ranks share a GPU through CUDA IPC, as on a 1-GPU machine)."""
    gpus = _gpu_count()
    if not gpus:
        return 0
    forced = os.environ.get("LINKWISE_TEST_GPU_RANKS")
    return int(forced) if forced and gpus > 0 else min(4, gpus)


def _gpu_count() -> int:
    """The GPUs NVML sees; 0 without NVML or a driver."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:  # noqa: BLE001
        return 0


def _errors(res) -> None:
    """Every rank's list of problems (run_ranks' results) is empty."""
    bad = [e for r in res for e in r]
    assert not bad, bad


def _two_or_more() -> int:
    """_nranks(), at least 2 where there is a GPU: with one GPU, two ranks share it."""
    n = _nranks()
    return max(2, n) if n else 0


def _setup(comm):
    import torch
    from linkwise.cuda import gpu_comm
    g = gpu_comm(comm)
    torch.cuda.set_device(g.device)
    return g, torch


def _digest(t) -> bytes:
    return hashlib.sha1(t.cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()).digest()


def _same_everywhere(comm, name, t):
    if comm.size == 1:  # a 1-rank communicator has no store (one GPU)
        return True
    d = _digest(t)
    allv = comm._store.all_gather(f"test/{name}", comm.rank, comm.size, d)
    return all(v == d for v in allv)


def _allreduce_body(comm, cases):
    from gpu_util import host_input, mismatch, reference
    g, torch = _setup(comm)
    errors = []
    for i, (count, dtype, op, algo, offset) in enumerate(cases):
        ins = [host_input(r, count, dtype, op, seed=i) for r in range(comm.size)]
        want = reference(ins, dtype, op)
        buf = torch.empty(count + offset, dtype=getattr(torch, dtype), device="cuda")
        x = buf[offset:]
        x.copy_(ins[comm.rank])
        out = torch.full_like(x, 7) if i % 2 else None  # alternate in-place and out=
        g.all_reduce(x, op=op, out=out, algo=algo)
        got = (x if out is None else out).cpu()
        bad = mismatch(got, want)
        if bad:
            errors.append(f"rank {comm.rank} {count} {dtype} {op} {algo} +{offset}: {bad}")
        if not _same_everywhere(comm, f"ar{i}", got):
            errors.append(f"{count} {dtype} {op} {algo}: ranks differ")
    g.close()
    return errors


def _check(results):
    errors = [e for r in results for e in r]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("algo", ["oneshot", "twoshot", "auto"])
def test_all_reduce_dtypes_ops_sizes(algo):
    n = _nranks()
    cases = [(c, d, o, algo, 0) for d in DTYPES for o in OPS for c in SIZES]
    _check(run_ranks(n, _allreduce_body, cases, env=SMALL_SLOT, timeout=300))


def test_all_reduce_misaligned_and_default_slot():
    n = _nranks()
    cases = [(c, "float32", "sum", a, 1) for c in (5, 4099, 300001) for a in ("oneshot", "twoshot")]
    cases += [(c, "bfloat16", "sum", "auto", 0) for c in (8, 2048, 1 << 20, (1 << 24) + 3)]
    _check(run_ranks(n, _allreduce_body, cases, env=SAFE_ENV, timeout=300))
    if n >= 2:  # also a 2-rank communicator
        _check(run_ranks(2, _allreduce_body, cases[:4], env=SMALL_SLOT, timeout=300))


def _movement_body(comm, sizes):
    from gpu_util import collector, host_input, reference
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    expect = collector(r, errors)
    for i, count in enumerate(sizes):
        for root in range(n):
            ins = host_input(root, count, "float32", "sum", seed=100 + i)
            x = ins.cuda() if r == root else torch.full((count,), -1.0, device="cuda")
            g.broadcast(x, root=root)
            expect(f"broadcast {count} root {root}", x, ins)
        ins = [host_input(q, count, "float16", "sum", seed=200 + i) for q in range(n)]
        out = torch.full((n * count,), -1.0, dtype=torch.float16, device="cuda")
        g.all_gather(ins[r].cuda(), out)
        expect(f"all_gather {count}", out, torch.cat(ins))
        for dtype, op in (("float32", "sum"), ("bfloat16", "max"), ("int32", "prod"), ("float64", "avg")):
            ins = [host_input(q, n * count, dtype, op, seed=300 + i) for q in range(n)]
            want = reference(ins, dtype, op)[r * count:(r + 1) * count]
            out = torch.full((count,), 3, dtype=getattr(torch, dtype), device="cuda")
            g.reduce_scatter(ins[r].cuda(), out, op=op)
            expect(f"reduce_scatter {count} {dtype} {op}", out, want)
        ins = [host_input(q, n * count, "int32", "sum", seed=400 + i) for q in range(n)]
        out = torch.full((n * count,), -1, dtype=torch.int32, device="cuda")
        g.all_to_all(ins[r].cuda(), out)
        want = torch.cat([ins[q][r * count:(r + 1) * count] for q in range(n)])
        expect(f"all_to_all {count}", out, want)
        # send/recv: pairs (0,1), (2,3), ...; even ranks send first, odd ranks receive first.
        peer = r ^ 1
        if peer < n:
            mine = host_input(r, count, "float32", "sum", seed=500 + i).cuda()
            got = torch.full((count,), -1.0, device="cuda")
            if r % 2 == 0:
                g.send(mine, peer)
                g.recv(got, peer)
            else:
                g.recv(got, peer)
                g.send(mine, peer)
            expect(f"send/recv {count}", got, host_input(peer, count, "float32", "sum", seed=500 + i))
    g.barrier()
    g.close()
    return errors


def test_broadcast_gather_scatter_alltoall_sendrecv():
    n = _nranks()
    _check(run_ranks(n, _movement_body, SIZES, env=SMALL_SLOT, timeout=300))


def test_movement_default_slot_large():
    n = _nranks()
    _check(run_ranks(n, _movement_body, [3, (1 << 22) + 5], env=SAFE_ENV, timeout=300))


def _comm_sendrecv_body(comm):
    """Communicator.sendrecv with CUDA tensors (the isend/irecv path onto the GPU plane), in a
    ring: the bytes received and every element."""
    g, torch = _setup(comm)
    n = comm.size
    nxt, prv = (comm.rank + 1) % n, (comm.rank - 1) % n
    got = []
    for count in (0, 7, 300001, (1 << 20) + 3):  # the last from LINKWISE_GPU_REG_MIN (4 MiB)
        x = torch.arange(count, dtype=torch.float32, device="cuda") + 1000 * comm.rank
        out = torch.full((count,), -1.0, device="cuda")
        nbytes = comm.sendrecv(x, nxt, out, prv, send_tag=3, recv_tag=3)
        want = torch.arange(count, dtype=torch.float32, device="cuda") + 1000 * prv
        got.append((nbytes == 4 * count, bool(torch.equal(out, want))))
    x = torch.full((9,), float(comm.rank), device="cuda")
    out = torch.zeros(9, device="cuda")
    nbytes = comm.sendrecv(x, nxt, out, prv, send_tag=5, recv_tag=5)
    got.append((nbytes == 36, bool(torch.equal(out, torch.full((9,), float(prv), device="cuda")))))
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:  # the same through cupy's side stream, registered-buffer size included
        with cupy.cuda.Device(g.device):
            for count in (7, (1 << 20) + 3):
                x = cupy.arange(count, dtype=cupy.float32) + 1000 * comm.rank
                out = cupy.full(count, -1, cupy.float32)
                nbytes = comm.sendrecv(x, nxt, out, prv, send_tag=4, recv_tag=4)
                want = cupy.arange(count, dtype=cupy.float32) + 1000 * prv
                got.append((nbytes == 4 * count, bool((out == want).all())))
    # A CUDA x with a host out (and the reverse) is refused before anything is sent; a refusal
    # stops the GPU plane on every rank (the peer's receive may wait for it), so the second
    # call raises CommAbortedError: last, then.
    import numpy as np
    for want, (x, out) in ((TypeError, (torch.ones(5, device="cuda"), np.zeros(5, np.float32))),
                           (linkwise.CommAbortedError, (np.ones(5, np.float32),
                                                        torch.zeros(5, device="cuda")))):
        try:
            comm.sendrecv(x, nxt, out, prv, send_tag=5, recv_tag=5)
            got.append(("no error", None))
        except want:
            pass
    g.close()
    return got


def test_communicator_sendrecv_cuda():
    n = _two_or_more()
    res = run_ranks(n, _comm_sendrecv_body, env=SAFE_ENV, timeout=120)
    assert all(len(r) in (5, 7) and all(ok == (True, True) for ok in r) for r in res), res


ERROR_CASES = {  # (the call on GpuComm g, the error it raises)
    "host array": (lambda g, np, torch: g.all_reduce(np.ones(4, np.float32)), "TypeError"),
    "uint8": (lambda g, np, torch: g.all_reduce(torch.ones(4, dtype=torch.uint8, device="cuda")),
              "TypeError"),
    "all_gather out": (lambda g, np, torch: g.all_gather(torch.ones(4, device="cuda"),
                                                         torch.ones(5, device="cuda")), "ValueError"),
}


def _errors_body(comm, case):
    """One refused call per GPU plane: a refusal stops it on every rank (refusal.py), so the
    next call raises CommAbortedError naming this rank (one rank: nobody can be waiting, so the
    plane goes on)."""
    import numpy as np
    g, torch = _setup(comm)
    msgs = []
    for call in (ERROR_CASES[case][0], lambda g, np, torch: g.all_reduce(torch.ones(4, device="cuda"))):
        try:
            call(g, np, torch)
            msgs.append("no error")
        except Exception as exc:  # noqa: BLE001
            msgs.append(type(exc).__name__)
    g.close()
    return msgs


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors(case):
    n = _nranks()
    res = run_ranks(n, _errors_body, case, env=SAFE_ENV, timeout=120)
    assert res[0] == [ERROR_CASES[case][1], "CommAbortedError" if n > 1 else "no error"], res[0]


# -- registered user buffers (copy engines) and the host-staged path --------------------------
REG_ENV = {**SAFE_ENV, "LINKWISE_GPU_REG_MIN": "1", "LINKWISE_GPU_BCAST_REG_MIN": "1",
           "LINKWISE_GPU_CHAIN_PIECE": "4096"}
STAGED_ENV = {**SAFE_ENV, "LINKWISE_P2P_DISABLE": "1", "LINKWISE_CHUNK_SIZE": "4096"}


def test_registered_buffers_movement():
    """broadcast (chain of 4 KiB pieces), all_gather and send/recv on registered user buffers,
    new tensors every size (allocations come and go: the mapping cache must follow)."""
    _check(run_ranks(_nranks(), _movement_body, SIZES + [(1 << 22) + 5], env=REG_ENV, timeout=300))


def _reg_reuse_body(comm, _):
    g, torch = _setup(comm)
    errors = []
    n, r = comm.size, comm.rank
    x = torch.full((1 << 20,), float(r), device="cuda")
    out = torch.empty(n << 20, device="cuda")
    for it in range(20):  # same buffers: one mapping per peer allocation, reused
        x.fill_(float(r + it))
        g.all_gather(x, out)
        want = torch.cat([torch.full((1 << 20,), float(q + it)) for q in range(n)])
        if not torch.equal(out.cpu(), want):
            errors.append(f"rank {r} iteration {it}: wrong all_gather")
    cached = g._engine.reg_cached()
    if cached > 2 * (n - 1):
        errors.append(f"rank {r}: {cached} mappings cached for {n - 1} peers' buffers")
    return errors


def test_registered_cache_reuse():
    _check(run_ranks(_nranks(), _reg_reuse_body, None, env=REG_ENV, timeout=300))


def test_host_staged_all_reduce():
    n = _nranks()
    # The CPU engine may add in another order than the rank-order reference: exact cases only.
    cases = [(c, d, o, "auto", 0) for d, o in (("int64", "sum"), ("int32", "prod"), ("float32", "max"),
                                               ("bfloat16", "min")) for c in (0, 1, 1000, 300001)]
    _check(run_ranks(n, _allreduce_body, cases, env=STAGED_ENV, timeout=300))


def test_host_staged_movement():
    # reduce_scatter float32 sum / float64 avg may round differently on the CPU engine: report
    # only the exact operations here.
    res = run_ranks(_nranks(), _movement_body, [0, 1, 7, 300001], env=STAGED_ENV, timeout=300)
    _check([[e for e in r if "float32 sum" not in e and "float64 avg" not in e] for r in res])

"""GPU plane fixes from the review probes (/tmp/review_gpu): a closed GpuComm refuses every call
(it crashed the process), CUDA sendrecv refuses x / out that overlap, GpuComm.barrier takes
stream objects, all_to_all / all_gather check elements and out's dtype, an out-of-range
LINKWISE_DEVICE is refused on every rank, the CAI v3 "stream" entry is honoured,
LINKWISE_GPU_AR_ALGO=prs works at any size, and memory CUDA IPC cannot export (torch's
expandable segments) takes the scratch path on every rank instead of failing.

Multi-rank tests run several ranks on the one GPU where there is only one (_two_or_more).
"""
from __future__ import annotations

import time

import pytest

from multirank import run_ranks
from test_gpu_collectives import SAFE_ENV, _errors, _setup, _two_or_more

pytestmark = pytest.mark.gpu


class Cai:
    """A CUDA array known only by its __cuda_array_interface__ (v3), with a chosen stream."""

    def __init__(self, t, stream=None):
        d = dict(t.__cuda_array_interface__)
        d["version"] = 3
        d["stream"] = stream
        self.__cuda_array_interface__ = d


# -- A: a closed GpuComm ------------------------------------------------------------------------
def _closed_body(comm):
    import linkwise
    g, torch = _setup(comm)
    t = torch.ones(1024, device="cuda")
    comm.all_reduce(t)
    torch.cuda.synchronize()
    comm.cuda().close()
    peer = (comm.rank + 1) % comm.size
    got = []
    for name, call in (("comm.all_reduce", lambda: comm.all_reduce(t)),
                       ("comm.all_reduce out=", lambda: comm.all_reduce(t, out=torch.empty_like(t))),
                       ("comm.broadcast", lambda: comm.broadcast(t, root=0)),
                       ("comm.all_gather", lambda: comm.all_gather(t)),
                       ("comm.send", lambda: comm.send(t, peer)),
                       ("comm.sendrecv", lambda: comm.sendrecv(t, peer, torch.empty_like(t), peer)),
                       ("comm.barrier(stream=)", lambda: comm.barrier(stream=0)),
                       ("g.barrier", lambda: comm.cuda().barrier()),
                       ("g.synchronize", lambda: g.synchronize()),
                       ("g.check", lambda: g.check()),
                       ("g.request", lambda: g.request(t))):
        try:
            call()
            got.append(f"{name}: no error")
        except linkwise.CommAbortedError as exc:
            if "closed GPU communicator" not in str(exc):
                got.append(f"{name}: {exc}")
        except Exception as exc:  # noqa: BLE001
            got.append(f"{name}: {type(exc).__name__}: {exc}")
    return [f"rank {comm.rank} {e}" for e in got]


def test_closed_gpu_comm_refuses_every_call():
    # Before: comm.all_reduce(cuda tensor) after comm.cuda().close() died with SIGSEGV.
    _errors(run_ranks(_two_or_more(), _closed_body, env=SAFE_ENV, timeout=120))


# -- B: sendrecv with overlapping x / out ---------------------------------------------------------
OVERLAPS = {"out is x": (0, 1024, 0, 1024), "partial overlap": (0, 1024, 512, 1536),
            "one element shared": (0, 1024, 1023, 1030)}  # x's and out's slices of one buffer


def _overlap_body(comm, what):
    g, torch = _setup(comm)
    peer = (comm.rank + 1) % comm.size
    src = (comm.rank - 1) % comm.size
    buf = torch.full((2048,), float(comm.rank + 1), device="cuda")
    errors = []
    # Adjacent, not overlapping: accepted.
    comm.sendrecv(buf[:1024], peer, buf[1024:], src)
    torch.cuda.synchronize()
    g.check()
    if not bool((buf[1024:] == float(src + 1)).all()):
        errors.append(f"rank {comm.rank}: adjacent sendrecv wrong")
    x0, x1, o0, o1 = OVERLAPS[what]
    try:  # refused; and a refusal stops the GPU plane on every rank (a peer may wait for it)
        comm.sendrecv(buf[x0:x1], peer, buf[o0:o1], src)
        errors.append(f"rank {comm.rank} {what}: accepted")
    except ValueError as exc:
        if "share memory" not in str(exc) or "stopped on every rank" not in str(exc):
            errors.append(f"rank {comm.rank} {what}: {exc}")
    return errors


@pytest.mark.parametrize("what", list(OVERLAPS))
def test_sendrecv_refuses_overlapping_cuda_x_and_out(what):
    _errors(run_ranks(_two_or_more(), _overlap_body, what, env=SAFE_ENV, timeout=120))


# -- C: GpuComm.barrier(stream=<object>) ----------------------------------------------------------
def _barrier_stream_body(comm):
    g, torch = _setup(comm)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(1_000_000_000)  # ~0.5-1 s of GPU time on s
    g.barrier(stream=s)
    done = s.query()
    torch.cuda.synchronize()
    return [] if done else [f"rank {comm.rank}: work on s still pending after g.barrier(stream=s)"]


def test_gpu_barrier_takes_a_stream_object():
    _errors(run_ranks(1, _barrier_stream_body, env=SAFE_ENV, timeout=120))
    _errors(run_ranks(_two_or_more(), _barrier_stream_body, env=SAFE_ENV, timeout=120))


# -- D: element-wise all_to_all and out's dtype ---------------------------------------------------
SPLIT_REFUSALS = {  # each refused (ValueError) on every rank; one a run: a refusal stops the plane
    "all_to_all of n+1 float32": lambda comm, g, torch, n: comm.all_to_all(
        torch.ones(n + 1, device="cuda"), out=torch.zeros(n + 1, device="cuda")),
    "all_to_all int32 out": lambda comm, g, torch, n: comm.all_to_all(
        torch.ones(n, device="cuda"), out=torch.zeros(n, dtype=torch.int32, device="cuda")),
    "all_gather int32 out": lambda comm, g, torch, n: comm.all_gather(
        torch.ones(4, device="cuda"), out=torch.zeros(4 * n, dtype=torch.int32, device="cuda")),
    "all_gather float16 out of the same bytes": lambda comm, g, torch, n: g.all_gather(
        torch.ones(4, device="cuda"), torch.zeros(8 * n, dtype=torch.float16, device="cuda")),
}


def _split_checks_body(comm, what):
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    # torch's "uint8" and the CAI typestr "|u1" name one dtype.
    x = torch.full((5,), r + 1, dtype=torch.uint8, device="cuda")
    out = torch.zeros(5 * n, dtype=torch.uint8, device="cuda")
    g.all_gather(x, Cai(out))
    y = torch.arange(2 * n, dtype=torch.uint8, device="cuda") + 10 * r
    yo = torch.zeros_like(y)
    g.all_to_all(Cai(y), yo)
    torch.cuda.synchronize()
    g.check()
    want = torch.arange(1, n + 1, dtype=torch.uint8).repeat_interleave(5)
    if not torch.equal(out.cpu(), want):
        errors.append(f"rank {r}: all_gather torch uint8 into CAI |u1: {out.cpu().tolist()}")
    want = torch.tensor([2 * r + k + 10 * q for q in range(n) for k in range(2)], dtype=torch.uint8)
    if not torch.equal(yo.cpu(), want):
        errors.append(f"rank {r}: all_to_all CAI |u1 into torch uint8: {yo.cpu().tolist()}")
    try:  # last: the refusal stops the GPU plane on every rank
        SPLIT_REFUSALS[what](comm, g, torch, n)
        errors.append(f"rank {r} {what}: accepted")
    except ValueError as exc:
        if "stopped on every rank" not in str(exc):
            errors.append(f"rank {r} {what}: the plane was not stopped: {exc}")
    return errors


@pytest.mark.parametrize("what", list(SPLIT_REFUSALS))
def test_all_to_all_counts_elements_and_out_dtype_is_checked(what):
    _errors(run_ranks(_two_or_more(), _split_checks_body, what, env=SAFE_ENV, timeout=120))


# -- E: LINKWISE_DEVICE out of range --------------------------------------------------------------
def _bad_device_body(comm, only_last):
    import os
    import linkwise
    import torch
    count = torch.cuda.device_count()
    if not only_last or comm.rank == comm.size - 1:
        os.environ["LINKWISE_DEVICE"] = str(count)
    t0 = time.monotonic()
    try:
        comm.cuda()
        outcome = "made"
    except (ValueError, linkwise.BootstrapError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    os.environ.pop("LINKWISE_DEVICE", None)
    g, torch = _setup(comm)  # made on the next try
    x = torch.ones(4, device="cuda")
    g.all_reduce(x)
    g.synchronize()
    return outcome, seconds, count, float(x[0].item())


@pytest.mark.parametrize("only_last", [False, True])
def test_linkwise_device_out_of_range_is_refused(only_last):
    n = _two_or_more()
    res = run_ranks(n, _bad_device_body, only_last, env={**SAFE_ENV, "LINKWISE_TIMEOUT": "30"},
                    timeout=120)
    first_bad = n - 1 if only_last else 0
    for r, (outcome, seconds, count, total) in enumerate(res):
        if r == first_bad:
            assert outcome.startswith(f"ValueError: rank {r}: LINKWISE_DEVICE={count} is out of range"), res
            assert f"{count} CUDA device(s) visible" in outcome, res
        else:
            assert outcome.startswith(f"BootstrapError: rank {r}: rank {first_bad} could not make "
                                      "the GPU plane: LINKWISE_DEVICE"), res
        assert seconds < 15 and total == n, res


# -- F: the CAI v3 stream entry -------------------------------------------------------------------
def _cai_stream_body(comm):
    g, torch = _setup(comm)
    errors = []
    for k, how in enumerate(("pointer", "per-thread", "legacy")):
        x = torch.zeros(1 << 20, device="cuda")
        y = torch.full_like(x, -1.0)
        torch.cuda.synchronize()
        if how == "pointer":  # a non-blocking stream: only its own order protects x
            s = torch.cuda.Stream()
            handle = s.cuda_stream
        else:  # produced on the legacy stream, which the per-thread stream (2) waits for too
            s = torch.cuda.default_stream()
            handle = 2 if how == "per-thread" else 1
        with torch.cuda.stream(s):
            torch.cuda._sleep(500_000_000)
            x.fill_(7.0 + k)
        g.all_reduce(Cai(x, handle), out=Cai(y, handle))
        torch.cuda.synchronize()
        if not bool((y == (7.0 + k) * comm.size).all()):
            errors.append(f"rank {comm.rank} {how}: out = {y[:4].tolist()}")
    return errors


def test_cai_v3_stream_is_honoured():
    _errors(run_ranks(1, _cai_stream_body, env=SAFE_ENV, timeout=120))


# -- G: LINKWISE_GPU_AR_ALGO=prs / rsag at any size -----------------------------------------------
def _forced_algo_body(comm):
    g, torch = _setup(comm)
    n, r, errors = comm.size, comm.rank, []
    for count in (1, 1000, 1 << 18):
        for via in ("g", "comm"):  # comm.all_reduce: the eager fast path must not take it
            x = torch.arange(count, device="cuda", dtype=torch.float32) % 97 + r
            (g.all_reduce if via == "g" else comm.all_reduce)(x)
            want = (torch.arange(count, dtype=torch.float32) % 97) * n + sum(range(n))
            if not torch.equal(x.cpu(), want):
                errors.append(f"rank {r} {count} {via}: wrong")
    return errors, g._prs_mapped is True


@pytest.mark.parametrize("algo", ["prs", "rsag"])
def test_forced_ar_algo_applies_at_any_size(algo):
    env = {**SAFE_ENV, "LINKWISE_GPU_AR_ALGO": algo}
    res = run_ranks(_two_or_more(), _forced_algo_body, env=env, timeout=180)
    _errors([e for e, _ in res])
    assert all(prs == (algo == "prs") for _, prs in res), res


# -- H: memory CUDA IPC cannot export ----------------------------------------------------------------
def _unexportable_body(comm):
    g, torch = _setup(comm)
    n, r, errors = comm.size, comm.rank, []
    probe = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    try:
        g._engine.reg_describe(probe.data_ptr())
        exportable = True
    except Exception:  # noqa: BLE001
        exportable = False
    count = 1 << 19  # 2 MiB of float32: above the registered thresholds set below
    x = torch.full((count,), float(r + 1), device="cuda")
    out = torch.zeros(count * n, device="cuda")
    comm.all_gather(x, out=out)
    b = torch.full((count,), float(r + 1), device="cuda")
    comm.broadcast(b, root=n - 1)
    torch.cuda.synchronize()
    g.check()
    if not torch.equal(out.cpu(), torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(count)):
        errors.append(f"rank {r}: all_gather wrong")
    if not bool((b == float(n)).all()):
        errors.append(f"rank {r}: broadcast wrong")
    # send/recv around the ring, both orders of exportable / not on mixed runs
    t0 = time.monotonic()
    got = torch.zeros(count, device="cuda")
    if r % 2 == 0:
        comm.send(x, (r + 1) % n)
        comm.recv(got, (r - 1) % n)
    else:
        comm.recv(got, (r - 1) % n)
        comm.send(x, (r + 1) % n)
    torch.cuda.synchronize()
    g.check()
    if not bool((got == float((r - 1) % n + 1)).all()):
        errors.append(f"rank {r}: recv wrong")
    if time.monotonic() - t0 > 10:
        errors.append(f"rank {r}: send/recv took {time.monotonic() - t0:.1f} s")
    return errors, exportable


@pytest.mark.parametrize("who", ["every rank", "rank 0 only"])
def test_unexportable_buffers_take_the_scratch_path(who):
    n = _two_or_more()
    if n % 2:
        n += 1  # the ring's even/odd order needs an even count
    conf = "expandable_segments:True"
    env = {**SAFE_ENV, "LINKWISE_TIMEOUT": "20", "LINKWISE_GPU_REG_MIN": str(1 << 20),
           "LINKWISE_GPU_BCAST_REG_MIN": str(1 << 20),
           "PYTORCH_CUDA_ALLOC_CONF": conf if who == "every rank" else
           [conf] + ["expandable_segments:False"] * (n - 1)}
    res = run_ranks(n, _unexportable_body, env=env, timeout=180)
    if res[0][1]:
        pytest.skip("this torch exports expandable-segment memory through CUDA IPC")
    _errors([e for e, _ in res])


# -- probe_01: a host-staged sendrecv ring ----------------------------------------------------------
def _staged_ring_body(comm):
    g, torch = _setup(comm)
    assert g._staged is not None
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    errors = []
    for nbytes in (1 << 20, 32 << 20):  # 32 MiB: 8 chunks of 4 MiB, more than the 3 staging slots
        n = nbytes // 4
        x = torch.full((n,), float(comm.rank + 1), device="cuda")
        out = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()
        comm.sendrecv(x, nxt, out, prv)
        torch.cuda.synchronize()
        if not bool((out == prv + 1).all()):
            errors.append(f"rank {comm.rank}: {nbytes >> 20} MiB wrong")
    y = torch.full((8 << 20,), float(comm.rank), device="cuda")  # in place, through a copy
    comm.sendrecv_replace(y, nxt, prv)
    torch.cuda.synchronize()
    if not bool((y == prv).all()):
        errors.append(f"rank {comm.rank}: sendrecv_replace wrong")
    return errors


def test_a_host_staged_sendrecv_ring_moves_more_than_the_staging_slots():
    """Every rank's staged send blocked the host until its reader took the chunks beyond the
    3 slots, and every reader was in its own send: 32 MiB timed out on every rank."""
    env = {**SAFE_ENV, "LINKWISE_P2P_DISABLE": "1", "LINKWISE_TIMEOUT": "30"}
    t0 = time.monotonic()
    _errors(run_ranks(_two_or_more(), _staged_ring_body, env=env, timeout=120))
    assert time.monotonic() - t0 < 60

"""Closing a peer's mapping never holds up a deferred receive (csrc/cuda/ipc_closer.h).

cudaIpcCloseMemHandle waits for all earlier work of the device, our own waiting kernels
included (bench/gpu_ipc_close_sync.py), and work enqueued meanwhile does not run before it
returns. A close made while a deferred receive waited on the device therefore waited for that
receive, whose copy needed the very thread that was closing (the helper), or a peer's send
that came only after the closing thread went on (the caller's thread): both hung until the
device waits' timeout (checked with the tree before the fix: both tests failed with
TimeoutError). Moving the closes to a thread of their own was not enough (the second test
still timed out: the helper's copy, enqueued during the close, did not run); the closer now
closes only while no deferred receive is outstanding and no send or receive is pending (a
peer's send may wait for work of ours that a close would hold back).

How a close is brought about here, in the middle of a call of rank 1's, once the work that
used the mapping is done (reg_cache.h): for the helper, rank 0 frees the buffer rank 1 mapped
(torch's empty_cache hands it back to CUDA) and sends from a new one of the same size, which
CUDA places at the same address with a new IPC handle, so rank 1's cache retires the old
mapping; for the caller's thread, a cache bound of 0 entries closes the mapping of rank 0's
previous buffer when the next one is mapped.
"""
from __future__ import annotations

import time

import pytest

from multirank import run_ranks
from test_gpu_collectives import SAFE_ENV, _errors, _setup, _two_or_more

pytestmark = pytest.mark.gpu

MiB = 1 << 20
ENV = {**SAFE_ENV, "LINKWISE_TIMEOUT": "20"}
NBYTES = 8 * MiB  # above LINKWISE_GPU_REG_MIN: registered, so the receiver maps the sender's buffer


def _fresh(torch, value, freed_ptr=None):
    """A new tensor; with freed_ptr, the premise: CUDA gave it the freed buffer's address."""
    torch.cuda.empty_cache()  # the old buffer goes back to CUDA (cudaFree)
    x = torch.full((NBYTES // 4,), float(value), device="cuda")
    premise = [] if freed_ptr is None or x.data_ptr() == freed_ptr else [
        "premise: the new buffer did not reuse the freed one's address; nothing was retired"]
    return x, premise


def _wait_closed(g, errors):
    """The closes this rank's caches handed to the closer are done (within 10 s)."""
    deadline = time.monotonic() + 10
    while g._engine.reg_cache_stats()[3] and time.monotonic() < deadline:
        time.sleep(0.01)
    if g._engine.reg_cache_stats()[3]:
        errors.append(f"rank {g.rank}: closes still pending 10 s after the device was idle")


def _helper_close_body(comm):
    """The helper of a deferred receive retires (and closes) the mapping of the sender's
    freed buffer before it enqueues the copy its own receive waits for."""
    g, torch = _setup(comm)
    errors = []
    if comm.rank >= 2:
        comm.barrier(), comm.barrier()
        return errors
    if comm.rank == 0:
        x, _ = _fresh(torch, 1)
        comm.send(x, 1)
        torch.cuda.synchronize()
        old = x.data_ptr()
        del x
        comm.barrier()  # rank 1 got it and posted its next receive
        comm.barrier()
        y, premise = _fresh(torch, 2, old)
        errors += premise
        comm.send(y, 1)
        torch.cuda.synchronize()
        return errors
    got = torch.zeros(NBYTES // 4, device="cuda")
    comm.recv(got, 0)  # maps rank 0's first buffer
    torch.cuda.synchronize()
    comm.barrier()
    got2 = torch.zeros_like(got)
    t0 = time.monotonic()
    rq = comm.irecv(got2, 0)  # before rank 0 sends: deferred to the helper thread
    comm.barrier()
    rq.wait()
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    if not bool((got == 1).all()) or not bool((got2 == 2).all()):
        errors.append("rank 1: received data wrong")
    if took > 10:
        errors.append(f"rank 1: the deferred receive took {took:.1f} s")
    _wait_closed(g, errors)
    return errors


def test_a_helper_that_retires_a_mapping_finishes_its_receive():
    _errors(run_ranks(_two_or_more(), _helper_close_body, env=ENV, timeout=120))


def _caller_close_body(comm):
    """Rank 1 has a deferred receive waiting on stream a when its all_gather on stream b
    closes the mapping of rank 0's previous buffer (bound 0); rank 0 sends only after its
    all_gather, on the same stream, so the receive's data needs rank 1's all_gather first."""
    g, torch = _setup(comm)
    errors = []
    n = comm.size
    x = torch.full((NBYTES // 4,), float(10 + comm.rank), device="cuda")
    out = torch.empty(n * x.numel(), device="cuda")
    comm.all_gather(x, out=out)  # maps every peer's x
    torch.cuda.synchronize()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    got = torch.zeros(NBYTES // 4, device="cuda")
    comm.barrier()
    t0 = time.monotonic()
    rq = comm.irecv(got, 0, stream=a) if comm.rank == 1 else None
    comm.barrier()  # rank 1's receive is posted before anything of rank 0's second round
    b.wait_stream(torch.cuda.current_stream())  # out's first all_gather is done before b writes it
    with torch.cuda.stream(b):  # everything of the second round on b, in this order
        y = torch.full_like(got, float(20 + comm.rank))
        comm.all_gather(y, out=out)  # rank 1: maps rank 0's y, closes the mapping of its x
        if comm.rank == 0 and n > 1:
            comm.send(torch.full_like(y, 5.0), 1)
    if rq is not None:
        rq.wait()
    torch.cuda.synchronize()
    took = time.monotonic() - t0
    want = torch.arange(n, dtype=torch.float32, device="cuda") + 20
    if not torch.equal(out, want.repeat_interleave(y.numel())):
        errors.append(f"rank {comm.rank}: all_gather wrong")
    if comm.rank == 1 and not bool((got == 5).all()):
        errors.append("rank 1: received data wrong")
    if took > 10:
        errors.append(f"rank {comm.rank}: the second round took {took:.1f} s")
    _wait_closed(g, errors)
    # the premise: x's mappings were closed (left: y's, and rank 1's mapping of the sent buffer)
    left = g._engine.reg_cache_stats()[0]
    if left > n - 1 + (comm.rank == 1):
        errors.append(f"premise: rank {comm.rank} still has {left} mappings; none was closed")
    return errors


def test_a_collective_that_closes_a_mapping_does_not_wait_for_a_deferred_receive():
    env = {**ENV, "LINKWISE_GPU_REG_CACHE_ENTRIES": "0"}
    _errors(run_ranks(_two_or_more(), _caller_close_body, env=env, timeout=120))


def _pending_recv_body(comm):
    """Rank 1's plain (scratch) receive waits on the device for rank 0's send, which rank 0
    makes only after a host barrier; meanwhile rank 1's all_gather hands the close of a
    mapping to the closer (bound 0). A close started then would wait for the receive and hold
    back all of rank 1's GPU work enqueued after it (a peer's send may itself wait for such
    work): the closer must wait instead, and a small kernel of rank 1's must run at once."""
    g, torch = _setup(comm)
    errors = []
    n = comm.size
    # 12 MiB: torch gives it an allocation of its own (up to 10 MiB it may share one with the
    # next tensor, and y would then be mapped through x's mapping: nothing to close)
    x = torch.full((12 * MiB // 4,), float(10 + comm.rank), device="cuda")
    out = torch.empty(n * x.numel(), device="cuda")
    comm.all_gather(x, out=out)  # maps every peer's x
    small, other = torch.zeros(256, device="cuda"), torch.zeros(256, device="cuda")
    a, c = torch.cuda.Stream(), torch.cuda.Stream()
    other.add_(1)  # torch's kernel loaded now: under lazy loading a first load waits for the device
    torch.cuda.synchronize()
    comm.barrier()
    rq = comm.irecv(small, 0, stream=a) if comm.rank == 1 else None  # below REG_MIN: not deferred
    y = torch.full_like(x, float(20 + comm.rank))
    comm.all_gather(y, out=out)  # bound 0: x's mappings go to the closer
    ran = True
    if comm.rank == 1:
        time.sleep(0.05)  # a closer that does not wait has started its close by now
        done = torch.cuda.Event()
        with torch.cuda.stream(c):
            other.add_(1)
            done.record(c)
        time.sleep(0.3)
        ran = done.query()
        closing = g._engine.reg_cache_stats()[3]
    comm.barrier()
    if comm.rank == 0 and n > 1:
        comm.send(torch.full((256,), 7.0, device="cuda"), 1)
    if rq is not None:
        rq.wait()
    torch.cuda.synchronize()
    if comm.rank == 1:
        if not ran:
            errors.append("rank 1: a kernel enqueued while the receive waited did not run (a close held it back)")
        if not closing:
            errors.append("premise: rank 1 had no close to make while its receive waited")
        if not bool((small == 7).all()):
            errors.append("rank 1: received data wrong")
    want = torch.arange(n, dtype=torch.float32, device="cuda") + 20
    if not torch.equal(out, want.repeat_interleave(y.numel())):
        errors.append(f"rank {comm.rank}: all_gather wrong")
    _wait_closed(g, errors)  # and once the receive is done, the close happens
    return errors


def test_a_close_waits_for_a_pending_receive():
    env = {**ENV, "LINKWISE_GPU_REG_CACHE_ENTRIES": "0"}
    _errors(run_ranks(_two_or_more(), _pending_recv_body, env=env, timeout=120))

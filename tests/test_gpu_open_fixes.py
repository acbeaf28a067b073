"""GPU plane fixes of the open issues in bench/gpu_open_issues (a sequel to
test_gpu_review_fixes.py, which holds the review's other fixes): the IPC mapping cache is
bounded and closes a mapping only once the work that used it is done (probe_06), and an
argument refused on one rank only (the root's out, which only the root checks, probe_10; an
out of another size or dtype there) stops every rank at once instead of leaving the others'
kernels waiting until the timeout.

Multi-rank tests run several ranks on the one GPU where there is only one (_two_or_more).
The two cache tests need the GPU to themselves: one reads the device's free memory, the other
needs the GPU to fall behind the host; another process's work on the GPU reads as theirs
(bench/gpu_verify_run.sh runs this file alone, after the other groups: GROUP_SOLO).
"""
from __future__ import annotations

import time

import pytest

from multirank import run_ranks
from test_gpu_collectives import SAFE_ENV, _errors, _setup, _two_or_more

pytestmark = pytest.mark.gpu


# -- probe_06: the IPC mapping cache -------------------------------------------------------------
MiB = 1 << 20


def _cache_bound_body(comm):
    g, torch = _setup(comm)
    errors, sizes = [], []
    # Warm-up: a first registered call makes the engine's own lazily allocated buffers, which
    # must not count as lost; its x is unmapped by the first x of the loop (bound 1).
    w = torch.ones((8 * MiB) // 4, device="cuda")
    wout = torch.empty(comm.size * w.numel(), device="cuda")
    comm.all_gather(w, out=wout)
    torch.cuda.synchronize()
    del w, wout
    torch.cuda.empty_cache()
    comm._store.barrier("test/cache/start", comm.size, timeout=60)
    free0 = torch.cuda.mem_get_info()[0]
    xs = []
    for i in range(8):  # from 12 MiB (torch: an allocation of its own), each kept alive
        x = torch.full(((12 + 2 * i) * MiB // 4,), float(10 * i + comm.rank), device="cuda")
        out = torch.empty(comm.size * x.numel(), device="cuda")
        comm.all_gather(x, out=out)  # registered: maps every peer's x
        want = torch.arange(comm.size, dtype=torch.float32, device="cuda") + 10 * i
        if not torch.equal(out, want.repeat_interleave(x.numel())):
            errors.append(f"rank {comm.rank}: all_gather {i} wrong")
        xs.append(x)
        sizes.append(x.numel() * 4 // MiB)
        del out
    torch.cuda.synchronize()
    g.check()
    stats = g._engine.reg_cache_stats()
    comm._store.barrier("test/cache/used", comm.size, timeout=60)  # nobody reads our xs any more
    del xs, x
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    deadline = time.monotonic() + 30  # the closer thread has closed what the bound let go
    while g._engine.reg_cache_stats()[3] and time.monotonic() < deadline:
        time.sleep(0.01)
    comm._store.barrier("test/cache/freed", comm.size, timeout=60)
    lost = (free0 - torch.cuda.mem_get_info()[0]) / MiB
    sharing = sum(1 for r in range(comm.size) if r % torch.cuda.device_count() == g.device)
    return errors, stats, lost, sharing, sizes


def test_the_ipc_mapping_cache_is_bounded_and_freed_buffers_come_back():
    """Every peer allocation a rank mapped stayed mapped, so the peer's freed buffers stayed
    allocated on its GPU (probe_06: 252 MiB). With LINKWISE_GPU_REG_CACHE_ENTRIES=1 a rank keeps
    only the buffers its slots still reference (each peer's last x), so of the eight freed
    buffers per rank only the last stays allocated."""
    n = _two_or_more()
    env = {**SAFE_ENV, "LINKWISE_GPU_REG_CACHE_ENTRIES": "1", "LINKWISE_TIMEOUT": "30"}
    res = run_ranks(n, _cache_bound_body, env=env, timeout=180)
    _errors([e for e, *_ in res])
    for _, (entries, nbytes, retired, _closing), lost, sharing, sizes in res:
        assert entries == n - 1 and retired == 0, res  # before: 8 * (n - 1)
        assert lost < sharing * (sizes[-1] + 64), (lost, sum(sizes) * sharing, res)


def _cache_inflight_body(comm):
    g, torch = _setup(comm)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    xs, outs = [], []
    pending = 0  # the most entries open at once: more than one per peer means some waited for work
    for i in range(16):
        s, other = (a, b) if i % 2 == 0 else (b, a)
        s.wait_stream(other)  # the engine's operations stay ordered (its contract)
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time: the host runs far ahead
            x = torch.full(((12 + 2 * i) * MiB // 4,), float(10 * i + comm.rank), device="cuda")
            out = torch.empty(comm.size * x.numel(), device="cuda")
            comm.all_gather(x, out=out)
        pending = max(pending, g._engine.reg_cache_stats()[0])
        xs.append(x)
        outs.append(out)
    torch.cuda.synchronize()
    g.check()
    errors = []
    for i, out in enumerate(outs):
        want = torch.arange(comm.size, dtype=torch.float32, device="cuda") + 10 * i
        if not torch.equal(out, want.repeat_interleave(xs[i].numel())):
            errors.append(f"rank {comm.rank}: all_gather {i} wrong")
    return errors, pending


def test_mappings_still_in_use_are_not_closed_under_a_zero_bound():
    """With nothing to be kept the cache closes a mapping only once the work that used it is
    done (an event per call): the host enqueues sixteen registered all_gathers on two streams
    far ahead of the GPU, and every result must be right (a mapping closed under a pending copy
    would fault or leave out wrong)."""
    env = {**SAFE_ENV, "LINKWISE_GPU_REG_CACHE_ENTRIES": "0", "LINKWISE_GPU_REG_CACHE_BYTES": "0",
           "LINKWISE_TIMEOUT": "30"}
    res = run_ranks(_two_or_more(), _cache_inflight_body, env=env, timeout=180)
    _errors([e for e, _ in res])
    # The scenario happened: on some rank, more entries than its slots reference were open at
    # once while the GPU was behind (they waited for their work). Read after each call: read
    # only at the end it was 1 and 1 on 2xH200 (thirty-sixth session) and, with the closer
    # thread, on the H100 too: by then the entries whose work was done had been closed.
    assert any(pending > len(res) - 1 for _, pending in res), res


def _refused_then_next(comm, g, torch, name, call):
    """Every rank runs call (refused on some), then a plain all_reduce: what each raised (or "no
    error"), the seconds the first took, and the seconds both took."""
    comm._store.barrier(f"test/{name}/start", comm.size, timeout=60)
    t0 = time.monotonic()
    first = later = "no error"
    try:
        call()
        torch.cuda.synchronize()
        g.check()
    except Exception as exc:  # noqa: BLE001
        first = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    try:  # stopped on every rank: raises, and does not wait for the timeout either
        comm.all_reduce(torch.ones(4, device="cuda"))
        torch.cuda.synchronize()
        g.check()
    except Exception as exc:  # noqa: BLE001
        later = f"{type(exc).__name__}: {exc}"
    comm._store.barrier(f"test/{name}/end", comm.size, timeout=60)
    return first, seconds, later, time.monotonic() - t0


# -- probe_10: an argument refused on the root only ------------------------------------------------
def _root_refusal_body(comm, nbytes):
    g, torch = _setup(comm)
    n = nbytes // 4
    x = torch.ones(n, device="cuda")
    out = torch.empty(n + (1 if comm.rank == 0 else 0), device="cuda")  # wrong on the root only
    torch.cuda.synchronize()
    return _refused_then_next(comm, g, torch, "refusal", lambda: comm.broadcast(x, root=0, out=out))


@pytest.mark.parametrize("nbytes", [64 << 10, 2 << 20])  # LL kernel; registered chain (below)
def test_a_root_only_refusal_stops_every_rank_at_once(nbytes):
    """The root's out of another size was refused on the root after the others had enqueued
    their kernels: they waited until LINKWISE_TIMEOUT, and the GPU plane was dead after. Now the
    kernels give up at once and every rank raises; at 2 MiB (registered path, thresholds
    lowered) the others wait in the host exchange of the descriptions and get the host notice."""
    env = {**SAFE_ENV, "LINKWISE_TIMEOUT": "30", "LINKWISE_GPU_REG_MIN": str(1 << 20),
           "LINKWISE_GPU_BCAST_REG_MIN": str(1 << 20)}
    res = run_ranks(_two_or_more(), _root_refusal_body, nbytes, env=env, timeout=180)
    (root, _, root_later, _), others = res[0], res[1:]
    assert root.startswith("ValueError") and "stopped on every rank" in root, res
    assert root_later.startswith("CommAbortedError") and "this rank refused" in root_later, res
    for first, seconds, later, total in others:
        assert first.startswith(("CommAbortedError", "ValueError")) and "rank 0 refused" in first, res
        assert later.startswith("CommAbortedError") and "rank 0 refused" in later, res
        assert seconds < 10 and total < 15, res


# -- an argument every rank checks alike, wrong on one rank only -------------------------------------
def _one_rank_refusal_body(comm, kind):
    g, torch = _setup(comm)
    last = comm.size - 1  # refuses: out of another size (all_reduce) or dtype (all_gather) there
    x = torch.ones((64 << 10) // 4, device="cuda")
    if kind == "all_reduce":
        out = torch.empty(x.numel() + (1 if comm.rank == last else 0), device="cuda")
    else:
        dtype = torch.float64 if comm.rank == last else torch.float32
        out = torch.empty(comm.size * x.numel(), dtype=dtype, device="cuda")
    torch.cuda.synchronize()
    return _refused_then_next(comm, g, torch, "one_refusal", lambda: getattr(comm, kind)(x, out=out))


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
def test_an_argument_wrong_on_one_rank_only_stops_every_rank_at_once(kind):
    """An out of another size (all_reduce) or dtype (all_gather) on the last rank only was
    refused there alone: the others' kernels had been enqueued and waited until
    LINKWISE_TIMEOUT. Now every argument refusal goes through the refusal path
    (cuda/refusal.py): the others' kernels give up at once and they raise CommAbortedError
    naming the refusing rank, and so does every later call."""
    env = {**SAFE_ENV, "LINKWISE_TIMEOUT": "30"}
    res = run_ranks(_two_or_more(), _one_rank_refusal_body, kind, env=env, timeout=180)
    last = len(res) - 1
    (mine, _, my_later, _), others = res[last], res[:last]
    assert mine.startswith("ValueError") and "stopped on every rank" in mine, res
    assert my_later.startswith("CommAbortedError") and "this rank refused" in my_later, res
    for first, seconds, later, total in others:
        assert first.startswith("CommAbortedError") and f"rank {last} refused" in first, res
        assert later.startswith("CommAbortedError") and f"rank {last} refused" in later, res
        assert seconds < 10 and total < 15, res

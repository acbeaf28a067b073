"""GPU failures and async forms: a dead peer raises PeerError on the survivors (not a timeout),
a hung peer still ends in TimeoutError, and async_op=True / a* coroutines / isend / irecv of
CUDA arrays match NumPy references, on the NVLink path and the host-staged one.

Each test forks one rank per GPU (at most 4). A "victim" (the last rank) SIGKILLs itself while
the others are blocked in a GPU operation that needs it; the timeout is long (30 s), so only the
watchdog (peer_watch.h) can end their wait within the few seconds the test allows.
"""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from multirank import run_ranks
from test_gpu_collectives import SAFE_ENV, _nranks, _setup, _two_or_more

pytestmark = pytest.mark.gpu

STAGED_ENV = {**SAFE_ENV, "LINKWISE_P2P_DISABLE": "1", "LINKWISE_CHUNK_SIZE": "4096"}
DEAD_TIMEOUT = 30.0   # LINKWISE_TIMEOUT while a peer dies: PeerError must come long before
PROMPT_S = 8.0        # ... within this many seconds of the survivor starting to wait


# -- a dead peer -------------------------------------------------------------------------------
def _blocked_call(comm, g, torch, case, victim):
    """What a survivor is doing when the victim dies: one call that needs the victim."""
    x = torch.ones(1000, device="cuda")
    if case in ("all_reduce", "hang", "abort"):
        g.all_reduce(x)
        g.synchronize()
    elif case in ("recv", "staged_recv"):
        g.recv(torch.zeros(1000, device="cuda"), victim)
        g.synchronize()
    elif case == "wait":
        comm.all_reduce(x, async_op=True).wait()
    elif case == "await":
        asyncio.run(comm.aall_reduce(x))


def _dead_peer_body(comm, case):
    import signal
    import linkwise
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    victim = n - 1
    x = torch.ones(1000, device="cuda")
    g.all_reduce(x)
    g.synchronize()
    if not torch.equal(x.cpu(), torch.full((1000,), float(n))):
        return ("warm-up all_reduce wrong",)
    if case == "staged_recv":  # open the victim -> survivor channels with a first message
        if r == victim:
            for s in range(n - 1):
                g.send(x, s)
        else:
            got = torch.zeros(1000, device="cuda")
            g.recv(got, victim)
            if not torch.equal(got.cpu(), torch.full((1000,), float(n))):
                return ("staged warm-up recv wrong",)
        g.synchronize()
    comm.barrier()
    ready = time.time()  # wall clock: the test compares it across processes
    if r == victim:
        if case == "hang":  # alive but absent: the survivors must time out as before
            time.sleep(3 * float(os.environ["LINKWISE_TIMEOUT"]))
            g.abort(victim)  # this rank's GPU communicator is unusable too; close it quietly
            return ("victim slept",)
        time.sleep(0.5)  # the survivors are blocked by now
        if case == "abort":  # alive, but its GPU plane stopped (an error handler, a failed receive)
            g.abort()
            comm.barrier()  # alive until the survivors are done: its exit would stop them too
            return ("victim aborted",)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        _blocked_call(comm, g, torch, case, victim)
        first = ("no error", -1, time.monotonic() - t0)
    except linkwise.PeerError as exc:
        first = ("PeerError", exc.peer, time.monotonic() - t0)
    except linkwise.TimeoutError:
        first = ("TimeoutError", -1, time.monotonic() - t0)
    try:  # the communicator stays failed: the next call raises at once, on the host
        t1 = time.monotonic()
        g.all_reduce(x)
        later = ("no error", 0.0)
    except Exception as exc:  # noqa: BLE001
        later = (type(exc).__name__, time.monotonic() - t1)
    try:
        g.check()
        checked = "no error"
    except Exception as exc:  # noqa: BLE001
        checked = type(exc).__name__
    if case == "abort":
        comm.barrier()  # the host communicator still works; the victim waits here
    return first + later + (checked, ready)


@pytest.mark.parametrize("case", ["all_reduce", "recv", "wait", "await", "staged_recv"])
def test_dead_peer_raises_peer_error(case):
    n = _two_or_more()
    env = {**(STAGED_ENV if case.startswith("staged") else SAFE_ENV),
           "LINKWISE_TIMEOUT": str(DEAD_TIMEOUT)}
    t0 = time.time()
    res = run_ranks(n, _dead_peer_body, case, env=env, timeout=3 * DEAD_TIMEOUT, expect_fail=True)
    ended = time.time()
    assert res[-1][0] == "died", res[-1]
    assert all(kind == "ok" for kind, _ in res[:-1]), res
    # From the survivors' last barrier with the victim to their exit, teardown included: the
    # run must not have waited for LINKWISE_TIMEOUT anywhere. Their start is not counted: a
    # machine's first CUDA launch of a build without code for its GPU JIT-compiles the PTX
    # (~24 s on an H100, docs/benchmarks.md), and a cold start reads torch from disk.
    since = ended - min(v[-1] for _, v in res[:-1])
    assert since < DEAD_TIMEOUT, f"{since:.1f} s from the barrier to the end of the run: {res}"
    print(f"\n{case}: survivors' PeerError after {[round(v[2], 3) for _, v in res[:-1]]} s; run {ended - t0:.1f} s, "
          f"{since:.1f} s of it from the barrier")
    for r, (_, val) in enumerate(res[:-1]):  # every survivor "ok": asserted above
        what, peer, waited, later, later_s, checked, _ = val
        assert (what, peer) == ("PeerError", n - 1), f"rank {r}: {val}"
        assert waited < PROMPT_S, f"rank {r}: PeerError after {waited:.1f} s"
        assert later == "PeerError" and later_s < 0.5, f"rank {r}: next call {later} ({later_s:.2f} s)"
        assert checked == "PeerError", f"rank {r}: check() gave {checked}"


def test_hung_peer_still_times_out():
    n = _two_or_more()
    # The timeout also bounds setup's store waits, and creating 4 CUDA contexts beside other
    # GPU test processes took over 2 s once (the victim's setup timed out): 5 s leaves room.
    t = 5.0
    env = {**SAFE_ENV, "LINKWISE_TIMEOUT": str(t)}
    res = run_ranks(n, _dead_peer_body, "hang", env=env, timeout=90, expect_fail=True)
    assert res[-1] == ("ok", ("victim slept",)), res[-1]
    for r, (kind, val) in enumerate(res[:-1]):
        assert kind == "ok", f"rank {r}: {val}"
        what, _, waited, later, _, checked, _ = val
        assert what == "TimeoutError" and 0.5 * t < waited < 6 * t, f"rank {r}: {val}"
        assert later == "TimeoutError" and checked == "TimeoutError", f"rank {r}: {val}"


def test_a_peer_that_aborts_stops_the_others():
    """A rank whose GPU plane stops for its own failure tells its live peers (GpuEngine::abort):
    those blocked in a call that needs it raise PeerError naming it, not TimeoutError after
    LINKWISE_TIMEOUT as before."""
    n = _two_or_more()
    env = {**SAFE_ENV, "LINKWISE_TIMEOUT": str(DEAD_TIMEOUT)}
    res = run_ranks(n, _dead_peer_body, "abort", env=env, timeout=3 * DEAD_TIMEOUT, expect_fail=True)
    assert res[-1] == ("ok", ("victim aborted",)), res[-1]
    for r, (kind, val) in enumerate(res[:-1]):
        assert kind == "ok", f"rank {r}: {val}"
        what, peer, waited, later, _, checked, _ = val
        assert (what, peer) == ("PeerError", n - 1), f"rank {r}: {val}"
        assert waited < PROMPT_S, f"rank {r}: PeerError after {waited:.1f} s"
        assert later == "PeerError" and checked == "PeerError", f"rank {r}: {val}"


# -- a GPU setting refused on one rank ------------------------------------------------------------
def _bad_gpu_setting(comm):
    import linkwise
    import torch  # noqa: F401 - imported before the clock starts
    if comm.rank == comm.size - 1:
        os.environ["LINKWISE_GPU_LL_MAX"] = "256K"  # atoi in the CUDA code would take 256
    t0 = time.monotonic()
    try:
        _setup(comm)
        outcome = "made"
    except (ValueError, linkwise.BootstrapError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    os.environ.pop("LINKWISE_GPU_LL_MAX", None)
    g, torch = _setup(comm)  # made on the next try, every rank alike
    x = torch.ones(4, device="cuda")
    g.all_reduce(x)
    g.synchronize()
    return outcome, seconds, float(x[0].item())


def test_a_gpu_setting_refused_on_one_rank_fails_every_rank_at_once():
    # Before, the rank with the bad value raised alone and the others waited for it in the
    # IPC handle exchange until the timeout (30 s here).
    n = _two_or_more()
    out = run_ranks(n, _bad_gpu_setting, env={**SAFE_ENV, "LINKWISE_TIMEOUT": "30"}, timeout=120)
    for r, (outcome, seconds, total) in enumerate(out):
        expected = (f"ValueError: rank {r}: LINKWISE_GPU_LL_MAX" if r == n - 1 else
                    f"BootstrapError: rank {r}: rank {n - 1} could not make the GPU plane: LINKWISE_GPU_LL_MAX")
        assert outcome.startswith(expected), out
        assert seconds < 15 and total == n, out


# -- Ctrl-C while a GPU request waits -------------------------------------------------------------
def _interrupt_body(comm):
    """Rank 1 waits on a CUDA irecv whose message rank 0 sends only 2.5 s later, and gets SIGINT
    0.4 s in. The receive stays queued on its stream, so the data still lands."""
    import signal
    import threading
    g, torch = _setup(comm)
    x = torch.zeros(1000, device="cuda")
    if comm.rank >= 2:  # more GPUs than the pair needs
        g.close()
        return None
    if comm.rank == 0:
        time.sleep(2.5)
        comm.send(torch.arange(1000, dtype=torch.float32, device="cuda"), 1)
        torch.cuda.synchronize()
        g.close()
        return None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    req = comm.irecv(x, 0)
    threading.Timer(0.4, os.kill, (os.getpid(), signal.SIGINT)).start()
    at = time.monotonic() + 0.4
    try:
        req.wait()
        kind = "returned"
    except KeyboardInterrupt:
        kind = "KeyboardInterrupt"
    seconds = time.monotonic() - at
    torch.cuda.synchronize()
    landed = bool(torch.equal(x.cpu(), torch.arange(1000, dtype=torch.float32)))
    g.close()
    return kind, seconds, landed


def test_ctrl_c_interrupts_a_gpu_request_wait():
    res = run_ranks(_two_or_more(), _interrupt_body, env={**SAFE_ENV, "LINKWISE_TIMEOUT": "30"}, timeout=60)
    kind, seconds, landed = res[1]
    assert kind == "KeyboardInterrupt" and seconds < 1.5, res[1]
    assert landed, res[1]


# -- async forms against NumPy references --------------------------------------------------------
# Exact on both paths (the host-staged reductions run on the CPU engine, in its own order).
RED_CASES = [("float32", "max"), ("int32", "sum"), ("bfloat16", "min"), ("int64", "prod")]


def _async_body(comm, sizes):
    from gpu_util import collector, host_input, reference
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    expect = collector(r, errors)
    for i, count in enumerate(sizes):
        # Several requests in flight on one stream, waited in issue order.
        pending = []
        for j, (dtype, op) in enumerate(RED_CASES):
            ins = [host_input(q, count, dtype, op, seed=10 * i + j) for q in range(n)]
            x = ins[r].cuda()
            pending.append((f"all_reduce {count} {dtype} {op}", comm.all_reduce(x, op=op, async_op=True),
                            x, reference(ins, dtype, op)))
        root = i % n
        src = host_input(root, count, "float32", "sum", seed=50 + i)
        b = src.cuda() if r == root else torch.full((count,), -1.0, device="cuda")
        pending.append((f"broadcast {count}", comm.broadcast(b, root=root, async_op=True), b, src))
        for name, req, res, want in pending:
            got = req.wait()
            if got is not res:
                errors.append(f"rank {r} {name}: wait() returned another object")
            expect(name, res, want)
        ins = [host_input(q, count, "float16", "sum", seed=60 + i) for q in range(n)]
        req = comm.all_gather(ins[r].cuda(), async_op=True)
        while not req.test():
            time.sleep(1e-4)
        expect(f"all_gather {count}", req.wait(), torch.cat(ins))
        ins = [host_input(q, n * count, "int32", "sum", seed=70 + i) for q in range(n)]
        got = comm.reduce_scatter(ins[r].cuda(), async_op=True).wait()
        expect(f"reduce_scatter {count}", got, reference(ins, "int32", "sum")[r * count:(r + 1) * count])
        ins = [host_input(q, n * count, "int64", "sum", seed=80 + i) for q in range(n)]
        got = comm.all_to_all(ins[r].cuda(), out=torch.empty(n * count, dtype=torch.int64, device="cuda"),
                              async_op=True).wait()
        expect(f"all_to_all {count}", got, torch.cat([ins[q][r * count:(r + 1) * count] for q in range(n)]))
        # isend / irecv in pairs (0,1), (2,3): even ranks send first, odd ranks receive first.
        peer = r ^ 1
        if peer < n:
            mine = host_input(r, count, "float32", "sum", seed=90 + i).cuda()
            got = torch.full((count,), -1.0, device="cuda")
            first, second = ((comm.isend, mine), (comm.irecv, got)) if r % 2 == 0 else \
                ((comm.irecv, got), (comm.isend, mine))
            reqs = [fn(arr, peer) for fn, arr in (first, second)]
            nbytes = [q.wait() for q in reqs]
            if nbytes != [4 * count, 4 * count]:
                errors.append(f"rank {r} isend/irecv {count}: wait() gave {nbytes}")
            expect(f"isend/irecv {count}", got, host_input(peer, count, "float32", "sum", seed=90 + i))
        errors += asyncio.run(_coroutines(comm, torch, count, i))
    if g._staged is None:  # the host-staged path blocks the host in the call itself (staged.py)
        errors += _loop_not_blocked(comm, torch)
    else:  # staging channels are memfds opened through /proc: nothing in /dev/shm
        # Every rank has broadcast channels; with an odd n the last rank has no isend/irecv
        # partner, so no point-to-point channels.
        st = g._staged
        names = [ch.name for ch in list(st._out.values()) + list(st._in.values()) + list(st._bc.values())]
        if not names or not all(nm.startswith("/proc/") for nm in names):
            errors.append(f"rank {r}: staging channels {names}")
        left = [f for f in os.listdir("/dev/shm") if comm.job_id in f]
        if left:
            errors.append(f"rank {r}: left in /dev/shm: {left}")
    return errors


async def _coroutines(comm, torch, count, i):
    """The a* forms: aall_reduce, abroadcast, aall_gather, areduce_scatter, aall_to_all, asend/arecv."""
    from gpu_util import collector, host_input, reference
    n, r = comm.size, comm.rank
    errors = []
    expect = collector(r, errors, "await ")
    ins = [host_input(q, count, "int32", "sum", seed=110 + i) for q in range(n)]
    expect(f"aall_reduce {count}", await comm.aall_reduce(ins[r].cuda()), reference(ins, "int32", "sum"))
    root = (i + 1) % n
    src = host_input(root, count, "float64", "sum", seed=120 + i)
    b = src.cuda() if r == root else torch.zeros(count, dtype=torch.float64, device="cuda")
    expect(f"abroadcast {count}", await comm.abroadcast(b, root=root), src)
    ins = [host_input(q, count, "bfloat16", "sum", seed=130 + i) for q in range(n)]
    expect(f"aall_gather {count}", await comm.aall_gather(ins[r].cuda()), torch.cat(ins))
    ins = [host_input(q, n * count, "float32", "max", seed=140 + i) for q in range(n)]
    expect(f"areduce_scatter {count}", await comm.areduce_scatter(ins[r].cuda(), op="max"),
           reference(ins, "float32", "max")[r * count:(r + 1) * count])
    ins = [host_input(q, n * count, "int32", "sum", seed=150 + i) for q in range(n)]
    expect(f"aall_to_all {count}", await comm.aall_to_all(ins[r].cuda()),
           torch.cat([ins[q][r * count:(r + 1) * count] for q in range(n)]))
    peer = r ^ 1
    if peer < n:
        mine = host_input(r, count, "float32", "sum", seed=160 + i).cuda()
        got = torch.full((count,), -1.0, device="cuda")
        if r % 2 == 0:
            await comm.asend(mine, peer)
            k = await comm.arecv(got, peer)
        else:
            k = await comm.arecv(got, peer)
            await comm.asend(mine, peer)
        if k != 4 * count:
            errors.append(f"rank {r} arecv {count}: returned {k}")
        expect(f"asend/arecv {count}", got, host_input(peer, count, "float32", "sum", seed=160 + i))
    return errors


def _loop_not_blocked(comm, torch):
    """Rank 0 awaits an all_reduce that the others join 0.4 s late; meanwhile its event loop must
    keep running other tasks (the await polls the CUDA event, it never blocks the loop)."""
    x = torch.ones(4096, device="cuda")
    comm.barrier()
    if comm.rank != 0:
        time.sleep(0.4)
        comm.all_reduce(x)
        torch.cuda.synchronize()
        return []
    ticks = [0]

    async def ticker(done):
        while not done.is_set():
            ticks[0] += 1
            await asyncio.sleep(0.01)

    async def main():
        done = asyncio.Event()
        t = asyncio.ensure_future(ticker(done))
        t0 = time.monotonic()
        res = await comm.aall_reduce(x)
        waited = time.monotonic() - t0
        done.set()
        await t
        return res, waited

    res, waited = asyncio.run(main())
    errors = []
    if not torch.equal(res.cpu(), torch.full((4096,), float(comm.size))):
        errors.append("rank 0: late all_reduce wrong")
    if comm.size > 1 and (waited < 0.3 or ticks[0] < 10):
        errors.append(f"rank 0: awaited {waited:.2f} s, the loop ticked {ticks[0]} times")
    return errors


def _check(results):
    errors = [e for r in results for e in r]
    assert not errors, "\n".join(errors[:20])


def test_async_collectives_and_p2p():
    _check(run_ranks(_nranks(), _async_body, [0, 1, 7, 65537], env=SAFE_ENV, timeout=300))


def test_async_host_staged():
    n = _two_or_more()
    _check(run_ranks(n, _async_body, [0, 7, 65537], env=STAGED_ENV, timeout=300))


# -- host-staged all_reduce through shared pinned memory (stage_reduce.h) ------------------------
def _staged_reduce_body(comm, cases):
    from test_gpu_collectives import _allreduce_body
    g, torch = _setup(comm)
    x = torch.ones(3, device="cuda")
    g.all_reduce(x)
    if g._staged is None or g._staged._red is None:
        return [f"rank {comm.rank}: the shared-memory staged all_reduce was not used"]
    name = g._staged._red.name
    if not name.startswith("/proc/"):
        return [f"rank {comm.rank}: StageReduce segment {name}"]
    return _allreduce_body(comm, cases)  # bitwise against the rank-order float32 reference


def test_host_staged_all_reduce_shared_memory():
    """Every dtype and op, bitwise; 4 KiB chunks through 2-3 slots (sizes span many chunks);
    misaligned pointers; 2, 3 and 4 ranks (as many as there are GPUs)."""
    n = _two_or_more()
    dtypes = ["float32", "float16", "bfloat16", "int32", "float64", "int64"]
    ops = ["sum", "prod", "min", "max", "avg"]
    cases = [(c, d, o, "auto", j % 2) for d in dtypes for o in ops
             for j, c in enumerate([0, 1, 7, 4099, 65537])]
    _check(run_ranks(n, _staged_reduce_body, cases, env=STAGED_ENV, timeout=300))
    small = [(c, d, o, "auto", 0) for d, o in (("float32", "sum"), ("bfloat16", "avg"), ("int64", "prod"))
             for c in (1, 4099, 30001)]
    for k in range(2, n):
        _check(run_ranks(k, _staged_reduce_body, small, env={**STAGED_ENV, "LINKWISE_STAGED_BUFFERS": "2"},
                         timeout=300))

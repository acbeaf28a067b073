"""CUDA graph capture of small GPU collectives, and the shared-memory host-staged path.

Graph test: every rank captures several all_reduce (one-shot and two-shot, in place and out=)
and broadcast calls into one torch.cuda.graph, replays it with new inputs each time (eager
calls in between, so device-side epochs must stay in step), and checks against NumPy.
Operations that cannot be captured must raise under capture rather than hang.
"""
from __future__ import annotations

import numpy as np
import pytest

from multirank import run_ranks
from test_gpu_collectives import SAFE_ENV, _check, _nranks, _setup, _two_or_more

pytestmark = pytest.mark.gpu


def _graph_body(comm, _):
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    counts = [1, 7, 1000, 65536]  # float32 all_reduce, one-shot (auto) sizes
    xs = [torch.zeros(c, device="cuda") for c in counts]
    y2 = torch.zeros(40001, device="cuda")           # two-shot, in place
    ym, ymo = torch.zeros(513, device="cuda"), torch.zeros(513, device="cuda")  # max, out=
    bx = torch.zeros(4099, device="cuda")            # broadcast from the last rank

    def fill(it):
        for x in xs:
            x.copy_(torch.arange(x.numel(), device="cuda") % 13 + (r + 1) * (it + 1))
        y2.copy_(torch.arange(y2.numel(), device="cuda") % 5 * (r + 2) - it)
        ym.copy_((torch.arange(ym.numel(), device="cuda") * (r + 3) + it) % 17)
        bx.copy_(torch.arange(bx.numel(), device="cuda") + it * 1000 if r == n - 1 else
                 torch.full_like(bx, -1.0))

    def ops():
        for x in xs:
            g.all_reduce(x)
        g.all_reduce(y2, algo="twoshot")
        g.all_reduce(ym, op="max", out=ymo)
        g.broadcast(bx, root=n - 1)

    def check(it, tag):
        for x in xs:
            a = np.arange(x.numel()) % 13
            want = sum(a + (q + 1) * (it + 1) for q in range(n))
            if not np.array_equal(x.cpu().numpy(), want.astype(np.float32)):
                errors.append(f"rank {r} {tag} it {it}: all_reduce {x.numel()} wrong")
        a = np.arange(y2.numel()) % 5
        if not np.array_equal(y2.cpu().numpy(), sum(a * (q + 2) - it for q in range(n)).astype(np.float32)):
            errors.append(f"rank {r} {tag} it {it}: two-shot all_reduce wrong")
        a = np.arange(ym.numel())
        want = np.max([(a * (q + 3) + it) % 17 for q in range(n)], axis=0).astype(np.float32)
        if not np.array_equal(ymo.cpu().numpy(), want):
            errors.append(f"rank {r} {tag} it {it}: max all_reduce wrong")
        if not np.array_equal(bx.cpu().numpy(), (np.arange(bx.numel()) + it * 1000).astype(np.float32)):
            errors.append(f"rank {r} {tag} it {it}: broadcast wrong")

    fill(0)
    ops()  # eager warm-up (loads the kernels before capture)
    torch.cuda.synchronize()
    check(0, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops()
    for it in range(1, 7):
        fill(it)
        graph.replay()
        torch.cuda.synchronize()
        check(it, "replay")
        if it % 2:  # eager calls between replays advance the same device-side epochs
            fill(it)
            ops()
            torch.cuda.synchronize()
            check(it, "eager")
    # 100 back-to-back replays of captured all_reduces with no host sync in between: rank 0
    # counts k = 1..100 and every rank sums the reduced counter (stale data would show).
    z, zo, w = (torch.zeros(64, device="cuda") for _ in range(3))
    inc = 1.0 if r == 0 else 0.0
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        for _ in range(10):
            z.add_(inc)
            g.all_reduce(z, out=zo)
            w.add_(zo)
    for _ in range(10):
        g2.replay()
    torch.cuda.synchronize()
    if not torch.equal(w.cpu(), torch.full((64,), 5050.0)):
        errors.append(f"rank {r}: 100 replayed all_reduces summed to {w[0].item()}, not 5050")
    # Not capturable: raises at once under capture (nothing was enqueued).
    if n > 1:
        g3 = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g3):
                g.send(z, (r + 1) % n)
            errors.append(f"rank {r}: send under capture did not raise")
        except RuntimeError as e:
            if "cannot be captured" not in str(e):
                errors.append(f"rank {r}: unexpected error under capture: {e}")
    torch.cuda.synchronize()
    comm.barrier()
    g.close()
    return errors


def test_graph_capture_small_allreduce_broadcast():
    n = _nranks()
    if n < 1:
        pytest.skip("no GPU")
    _check(run_ranks(n, _graph_body, None, env=SAFE_ENV, timeout=300))


def _staged_shm_body(comm, sizes):
    """send/recv ring and broadcast through the shared-memory StageChannels."""
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    if g._staged is None or len(g._staged._local) != n - 1:
        return [f"rank {r}: expected the staged path with {n - 1} local peers"]
    for count in sizes:
        for it in range(2):  # the second round reuses the channels (chunk numbering goes on)
            mine = torch.arange(count, device="cuda", dtype=torch.float32) + 1000 * r + it
            got = torch.full((count,), -1.0, device="cuda")
            dst, src = (r + 1) % n, (r - 1) % n
            if r % 2 == 0:
                g.send(mine, dst)
                g.recv(got, src)
            else:
                g.recv(got, src)
                g.send(mine, dst)
            want = np.arange(count, dtype=np.float32) + 1000 * src + it
            if not np.array_equal(got.cpu().numpy(), want):
                errors.append(f"rank {r} send/recv {count} round {it}: wrong")
            for root in range(n):
                x = (torch.arange(count, device="cuda", dtype=torch.float32) * (root + 1) + it
                     if r == root else torch.full((count,), -1.0, device="cuda"))
                g.broadcast(x, root=root)
                want = np.arange(count, dtype=np.float32) * (root + 1) + it
                if not np.array_equal(x.cpu().numpy(), want):
                    errors.append(f"rank {r} broadcast {count} root {root} round {it}: wrong")
    import os
    left = [f for f in os.listdir("/dev/shm") if "-stg" in f and comm.job_id in f]
    if left:
        errors.append(f"rank {r}: staging segments left in /dev/shm: {left}")
    g.close()
    return errors


def test_host_staged_shared_memory_channels():
    n = _two_or_more()
    env = {**SAFE_ENV, "LINKWISE_P2P_DISABLE": "1", "LINKWISE_CHUNK_SIZE": "8192",
           "LINKWISE_STAGED_BUFFERS": "3"}
    # odd sizes, more chunks than slots, and a size that is not a multiple of the chunk
    _check(run_ranks(n, _staged_shm_body, [0, 1, 7, 2048, 100003, (1 << 20) + 5], env=env,
                     timeout=300))

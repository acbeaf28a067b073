"""Large all_reduce / reduce_scatter reading peers' registered user buffers directly
(reg_reduce.cu, ``LINKWISE_GPU_REG_REDUCE_MIN``), against NumPy references.

With ``LINKWISE_GPU_REG_REDUCE_MIN=1`` every size takes the registered path, so odd and tiny
sizes (chunks of 0 elements on some ranks), every dtype and op, misaligned buffers, in place
and out= are checked cheaply; one test uses the default threshold at 64 MiB and above. Results
must equal the rank-order reference bitwise and be identical on every rank. Capture of a
reduction on the registered path's sizes falls back to the scratch kernels (still capturable).
"""
from __future__ import annotations

import pytest

from multirank import run_ranks
from test_gpu_collectives import DTYPES, OPS, SAFE_ENV, _check, _nranks, _same_everywhere, _setup

pytestmark = pytest.mark.gpu

REG_RED_ENV = {**SAFE_ENV, "LINKWISE_GPU_REG_REDUCE_MIN": "1"}


def _body(comm, cases):
    """cases: ("ar" | "rs", count, dtype, op, offset, inplace)."""
    from gpu_util import host_input, mismatch, reference
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    for i, (kind, count, dtype, op, offset, inplace) in enumerate(cases):
        tdt = getattr(torch, dtype)
        total = count if kind == "ar" else count * n
        ins = [host_input(q, total, dtype, op, seed=700 + i) for q in range(n)]
        want = reference(ins, dtype, op)
        buf = torch.empty(total + offset, dtype=tdt, device="cuda")
        x = buf[offset:]
        x.copy_(ins[r])
        if kind == "ar":
            out = None if inplace else torch.full_like(x, 7)
            g.all_reduce(x, op=op, out=out)
            got = (x if out is None else out).cpu()
        else:
            want = want[r * count:(r + 1) * count]
            out = x[r * count:(r + 1) * count] if inplace else torch.full((count,), 3, dtype=tdt, device="cuda")
            g.reduce_scatter(x, out, op=op)
            got = out.cpu()
        tag = f"{kind} {count} {dtype} {op} +{offset} {'in place' if inplace else 'out='}"
        bad = mismatch(got, want)
        if bad:
            errors.append(f"rank {r} {tag}: {bad}")
        if kind == "ar" and not _same_everywhere(comm, f"large{i}", got):
            errors.append(f"{tag}: ranks differ")
    if cases and g._engine.reg_cached() == 0 and n > 1:
        errors.append(f"rank {r}: no peer buffer mapped: the registered path was not taken")
    g.close()
    return errors


SMALL = [1, 7, 1000, 65537, 300001]


def test_reg_all_reduce_dtypes_ops_sizes():
    cases = [("ar", c, d, o, 0, j % 2 == 0) for d in DTYPES for o in OPS
             for j, c in enumerate(SMALL)]
    cases += [("ar", c, "float32", "sum", 1, ip) for c in (5, 300001) for ip in (True, False)]
    _check(run_ranks(_nranks(), _body, cases, env=REG_RED_ENV, timeout=300))


def test_reg_all_reduce_rsag():
    """all_reduce as registered reduce_scatter + all_gather (LINKWISE_GPU_AR_ALGO=rsag, the
    default from LINKWISE_GPU_AR_RSAG_MIN) gives the rank-order reference bitwise: every dtype,
    sum / max / avg / prod, in place and out=, misaligned; counts not divisible by the ranks
    take the one-kernel form; on 3 ranks too."""
    cases = [("ar", c, d, o, 0, j % 2 == 0) for d in DTYPES for o in ("sum", "max", "avg")
             for j, c in enumerate((12, 7, 120000, 300000))]
    cases += [("ar", c, d, "prod", 1, ip) for d in ("float32", "int64") for c in (24, 100008)
              for ip in (True, False)]
    env = {**REG_RED_ENV, "LINKWISE_GPU_AR_ALGO": "rsag"}
    _check(run_ranks(_nranks(), _body, cases, env=env, timeout=300))
    if _nranks() >= 4:
        _check(run_ranks(3, _body, cases[:12], env=env, timeout=300))


def test_reg_reduce_scatter_dtypes_ops_sizes():
    cases = [("rs", c, d, o, 0, False) for d in DTYPES for o in OPS for c in (1, 7, 65537)]
    cases += [("rs", c, "bfloat16", "sum", o, ip) for c in (3, 40001) for o in (0, 1) for ip in (True, False)]
    _check(run_ranks(_nranks(), _body, cases, env=REG_RED_ENV, timeout=300))
    if _nranks() >= 3:  # chunking for a rank count that is not a power of two
        mixed = [("ar", c, "float16", "sum", 0, True) for c in (1, 7, 300001)]
        mixed += [("rs", 1001, "int64", "prod", 0, False), ("rs", 5, "float32", "avg", 0, False)]
        _check(run_ranks(3, _body, mixed, env=REG_RED_ENV, timeout=300))


def test_reg_default_threshold_large():
    """At and above the default 64 MiB threshold, in place and out=, float32 and bfloat16."""
    cases = [("ar", (16 << 20) + 3, "float32", "sum", 0, True),
             ("ar", (32 << 20) + 5, "bfloat16", "sum", 0, False),
             ("rs", (4 << 20) + 1, "float32", "sum", 0, False),
             ("ar", 1 << 20, "float32", "max", 0, True)]  # below: scratch path
    _check(run_ranks(_nranks(), _body, cases, env=SAFE_ENV, timeout=300))


def _capture_body(comm, _):
    """On a capturing stream the registered path is not taken: the scratch kernels are captured
    and replay correctly; eager registered calls interleave with replays."""
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    x = torch.zeros(40001, device="cuda")
    y = torch.zeros(20000 * n, device="cuda")
    yo = torch.zeros(20000, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        g.all_reduce(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.all_reduce(x)
        g.reduce_scatter(y, yo)
    for it in range(3):
        x.copy_(torch.arange(x.numel(), device="cuda") % 7 + r + it)
        y.copy_(torch.arange(y.numel(), device="cuda") % 5 * (r + 1))
        graph.replay()
        e = torch.full((50000,), float(r + it), device="cuda")
        g.all_reduce(e)  # eager: registered path
        torch.cuda.synchronize()
        a = torch.arange(x.numel()) % 7
        if not torch.equal(x.cpu(), sum(a + q + it for q in range(n)).float()):
            errors.append(f"rank {r} it {it}: captured all_reduce wrong")
        b = torch.arange(y.numel()) % 5
        want = sum(b * (q + 1) for q in range(n)).float()[r * 20000:(r + 1) * 20000]
        if not torch.equal(yo.cpu(), want):
            errors.append(f"rank {r} it {it}: captured reduce_scatter wrong")
        if not torch.equal(e.cpu(), torch.full((50000,), float(sum(q + it for q in range(n))))):
            errors.append(f"rank {r} it {it}: eager registered all_reduce wrong")
    g.close()
    return errors


def test_reg_path_capture_falls_back():
    _check(run_ranks(_nranks(), _capture_body, None, env=REG_RED_ENV, timeout=300))


def _bcast_capture_body(comm, _):
    """A broadcast at a registered size on a capturing stream takes the scratch kernel."""
    g, torch = _setup(comm)
    r, errors = comm.rank, []
    x = torch.zeros(40001, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        g.broadcast(x, root=1 % comm.size)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.broadcast(x, root=1 % comm.size)
    for it in range(2):
        want = (torch.arange(x.numel()) * 3 + it) % 251
        x.copy_(want.to(torch.uint8) if r == 1 % comm.size else torch.zeros_like(want).to(torch.uint8))
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(x.cpu(), want.to(torch.uint8)):
            errors.append(f"rank {r} replay {it}: captured broadcast wrong")
    g.close()
    return errors


def test_reg_broadcast_capture_falls_back():
    env = {**SAFE_ENV, "LINKWISE_GPU_REG_MIN": "1", "LINKWISE_GPU_BCAST_REG_MIN": "1"}
    _check(run_ranks(_nranks(), _bcast_capture_body, None, env=env, timeout=300))


def test_reg_reduce_kernel_variants():
    """The tuning variants of reg_reduce_kernel (LINKWISE_GPU_REG_REDUCE_UNROLL 1 and 4; float32,
    float16, bfloat16 sum) give the reference bitwise, aligned or not, in place or not."""
    cases = [(k, c, d, "sum", off, ip) for k in ("ar", "rs") for d in ("float32", "float16", "bfloat16")
             for c, off, ip in ((1, 0, True), (7, 1, False), (65537, 0, False), (300001, 1, True))]
    for variant in ("1", "4"):
        env = {**REG_RED_ENV, "LINKWISE_GPU_REG_REDUCE_UNROLL": variant,
               "LINKWISE_GPU_REG_REDUCE_BLOCKS": "7"}
        _check(run_ranks(_nranks(), _body, cases, env=env, timeout=300))


def _bcast_body(comm, sizes):
    """Registered broadcast (the form the environment selects) from every root, odd byte
    counts, misaligned starts, twice in place in a row, then once out of place (into a fresh
    out, misaligned differently; the root's x must stay as it was); x is a fresh tensor each
    time."""
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    errors = []
    for i, nbytes in enumerate(sizes):
        for root in range(n):
            off = (i + root) % 3
            src = (torch.arange(nbytes, dtype=torch.int64) * 13 + 7 * root + i) % 251
            buf = torch.zeros(nbytes + off, dtype=torch.uint8, device="cuda")
            x = buf[off:]
            for rep in range(2):  # the second call overwrites the first's result everywhere
                want = ((src + rep) % 251).to(torch.uint8)
                if r == root:
                    x.copy_(want)
                g.broadcast(x, root=root)
                if not torch.equal(x.cpu(), want):
                    errors.append(f"rank {r} broadcast {nbytes} B root {root} +{off} call {rep}: wrong")
            if not torch.equal(buf[:off].cpu(), torch.zeros(off, dtype=torch.uint8)):
                errors.append(f"rank {r} broadcast {nbytes} B root {root}: wrote before x")
            want = ((src + 2) % 251).to(torch.uint8)
            if r == root:
                x.copy_(want)
            obuf = torch.zeros(nbytes + 2 - off % 2, dtype=torch.uint8, device="cuda")
            out = obuf[2 - off % 2:]
            g.broadcast(x, root=root, out=out)
            if not torch.equal(out.cpu(), want):
                errors.append(f"rank {r} broadcast {nbytes} B root {root} out of place: wrong")
            if r == root and not torch.equal(x.cpu(), want):
                errors.append(f"rank {r} broadcast {nbytes} B root {root} out of place: x changed")
            if obuf[:2 - off % 2].any().item():
                errors.append(f"rank {r} broadcast {nbytes} B root {root} out of place: wrote before out")
    if n > 1 and g._engine.reg_cached() == 0:
        errors.append(f"rank {r}: the registered path was not taken")
    g.close()
    return errors


BCAST_SIZES = [1, 5, 4095, 4097, 123457, (3 << 20) + 1]


_PUSH = {"LINKWISE_GPU_BCAST_ALGO": "push"}
_PULL = {"LINKWISE_GPU_BCAST_ALGO": "pull"}
BCAST_FORMS = {
    "push-r1-b3-u8": {**_PUSH, "LINKWISE_GPU_BCAST_ROUNDS": "1", "LINKWISE_GPU_BCAST_BLOCKS": "3",
                      "LINKWISE_GPU_BCAST_UNROLL": "8"},
    "push-r3-b7": {**_PUSH, "LINKWISE_GPU_BCAST_ROUNDS": "3", "LINKWISE_GPU_BCAST_BLOCKS": "7"},
    "push-r64-b256": {**_PUSH, "LINKWISE_GPU_BCAST_ROUNDS": "64", "LINKWISE_GPU_BCAST_BLOCKS": "256"},
    "push": _PUSH,
    "pull-r1": {**_PULL, "LINKWISE_GPU_BCAST_ROUNDS": "1"},
    "pull-r3": {**_PULL, "LINKWISE_GPU_BCAST_ROUNDS": "3"},
    "chain-4k": {"LINKWISE_GPU_BCAST_ALGO": "chain", "LINKWISE_GPU_CHAIN_PIECE": "4096"},
    "chain": {"LINKWISE_GPU_BCAST_ALGO": "chain"},  # in one piece on 2 ranks
    "pchain": {"LINKWISE_GPU_BCAST_ALGO": "pchain"},
    "default": {},  # the work-claiming chain
    "pchain-b3-s4k": {"LINKWISE_GPU_BCAST_ALGO": "pchain", "LINKWISE_GPU_PCHAIN_BLOCKS": "3",
                      "LINKWISE_GPU_PCHAIN_SLICE": "4096"},
    "pchain-b256-u8": {"LINKWISE_GPU_BCAST_ALGO": "pchain", "LINKWISE_GPU_PCHAIN_BLOCKS": "300",
                       "LINKWISE_GPU_BCAST_UNROLL": "8"},
    "pchain-t1024": {"LINKWISE_GPU_BCAST_ALGO": "pchain", "LINKWISE_GPU_PCHAIN_BLOCKS": "5",
                     "LINKWISE_GPU_PCHAIN_SLICE": "8192", "LINKWISE_GPU_PCHAIN_THREADS": "1024"},
    "dchain": {"LINKWISE_GPU_BCAST_ALGO": "dchain"},
    "dchain-b3-i4k-t512": {"LINKWISE_GPU_BCAST_ALGO": "dchain", "LINKWISE_GPU_DCHAIN_BLOCKS": "3",
                           "LINKWISE_GPU_DCHAIN_ITEM": "4096", "LINKWISE_GPU_DCHAIN_THREADS": "512"},
    "dchain-b300": {"LINKWISE_GPU_BCAST_ALGO": "dchain", "LINKWISE_GPU_DCHAIN_BLOCKS": "300",
                    "LINKWISE_GPU_DCHAIN_ITEM": "8192"},
}


@pytest.mark.parametrize("form", list(BCAST_FORMS))
def test_reg_broadcast_forms(form):
    """Registered broadcast, every form: the one-kernel push scatter-allgather (bcast_push.cu)
    with 1 to 64 rounds (clamped to the piece limit; more pieces than bytes at the small sizes),
    3 to 256 blocks and both unrolls, the two-stream pull scatter-allgather, the copy-engine
    chain with 4 KiB pieces, the push chain (bcast_chain.cu) with 3 blocks x 4 KiB slices
    (hundreds of pieces), the default geometry, and 300 blocks (clamped to 256; most slices
    empty); on 4 ranks, then (push, pull, chains) on 3 and (the chains, the copy-engine chain
    in one piece, the default) on 2."""
    env = {**SAFE_ENV, "LINKWISE_GPU_REG_MIN": "1", "LINKWISE_GPU_BCAST_REG_MIN": "1", **BCAST_FORMS[form]}
    _check(run_ranks(_nranks(), _bcast_body, BCAST_SIZES, env=env, timeout=300))
    if _nranks() >= 4 and form in ("push-r3-b7", "pull-r3", "pchain-b3-s4k", "pchain", "dchain",
                                   "dchain-b3-i4k-t512"):  # 3 ranks
        _check(run_ranks(3, _bcast_body, BCAST_SIZES, env=env, timeout=300))
    if _nranks() >= 3 and form in ("pchain-b3-s4k", "dchain-b3-i4k-t512", "chain", "default"):  # 2 ranks too
        _check(run_ranks(2, _bcast_body, BCAST_SIZES, env=env, timeout=300))


def _bcast_queue_body(comm, sizes):
    """Chain broadcasts (LINKWISE_GPU_BCAST_ALGO: pchain or dchain) queued back to back on one stream with no host sync between them:
    root, size and the kernel's geometry (blocks, slice bytes) change from call to call, and
    consecutive calls reuse one buffer (its result cloned on the stream before the next call).
    Everything is checked after one synchronize at the end."""
    import os
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    geometries = [("3", "4096"), ("0", "0"), ("64", "65536"), ("7", "12288")]
    knobs = {"pchain": ("LINKWISE_GPU_PCHAIN_BLOCKS", "LINKWISE_GPU_PCHAIN_SLICE"),
             "dchain": ("LINKWISE_GPU_DCHAIN_BLOCKS", "LINKWISE_GPU_DCHAIN_ITEM")}[os.environ["LINKWISE_GPU_BCAST_ALGO"]]
    plan = []
    for k in range(9):
        nbytes = sizes[k % len(sizes)]
        src = (torch.arange(nbytes, dtype=torch.int64) * 29 + 11 * k) % 251
        plan.append(((k * 2 + 1) % n, src.to(torch.uint8).cuda()))
    shared = torch.zeros(max(w.numel() for _, w in plan), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    results = []
    try:
        for k, (root, want) in enumerate(plan):
            blocks, slice_bytes = geometries[k % len(geometries)]
            os.environ[knobs[0]] = blocks
            os.environ[knobs[1]] = slice_bytes
            reuse = k % 3 != 0  # calls 1-2, 4-5, 7-8 broadcast into the same buffer
            x = shared[:want.numel()] if reuse else torch.zeros_like(want)
            if r == root:
                x.copy_(want)
            g.broadcast(x, root=root)
            results.append(x.clone() if reuse else x)
    finally:
        for k in knobs:
            os.environ.pop(k, None)
    torch.cuda.synchronize()
    errors = [f"rank {r} call {k} ({want.numel()} B, root {root}): wrong"
              for k, ((root, want), got) in enumerate(zip(plan, results)) if not torch.equal(got, want)]
    g.close()
    return errors


@pytest.mark.parametrize("algo", ["pchain", "dchain"])
def test_reg_broadcast_queued_back_to_back(algo):
    """The chains' hand-offs between calls: a rank may store into its successor's buffer
    only once the successor's previous call is done with it (not covered by the per-call
    checks above, which read each result on the host before the next call); for the
    work-claiming chain also the claim counter and item flags across calls of changing size
    and block count."""
    env = {**SAFE_ENV, "LINKWISE_GPU_REG_MIN": "1", "LINKWISE_GPU_BCAST_REG_MIN": "1",
           "LINKWISE_GPU_BCAST_ALGO": algo}
    _check(run_ranks(_nranks(), _bcast_queue_body, BCAST_SIZES + [(1 << 20) + 3, 77], env=env, timeout=300))


PRS_GEOMS = {
    "default": {},
    "b3-i4k-lag0": {"LINKWISE_GPU_PRS_BLOCKS": "3", "LINKWISE_GPU_PRS_ITEM": "4096", "LINKWISE_GPU_PRS_LAG": "0"},
    "b300-i8k-lag4": {"LINKWISE_GPU_PRS_BLOCKS": "300", "LINKWISE_GPU_PRS_ITEM": "5000", "LINKWISE_GPU_PRS_LAG": "4"},
}


@pytest.mark.parametrize("geom", list(PRS_GEOMS))
def test_reg_all_reduce_prs(geom):
    """The push reduce-scatter all_reduce (LINKWISE_GPU_AR_ALGO=prs, reg_prs.cu) gives the
    rank-order reference bitwise on every rank: default geometry with every dtype and op, odd
    and tiny counts (chunks of 0 elements), misaligned x, in place and out=; with 4 KiB items
    (hundreds per chunk: every scratch slot reused many times, sizes not multiples of items)
    on 3 blocks and no lag, and 300 blocks (most units claimed by few) with 8 KiB items
    (5000 rounded up) and the largest lag; on 4 ranks, then 3."""
    if geom == "default":
        cases = [("ar", c, d, o, j % 2, j % 3 == 0) for d in DTYPES for o in OPS
                 for j, c in enumerate((1, 7, 65537, 300001))]
    else:
        cases = [("ar", c, d, o, off, ip) for c, d, o, off, ip in (
            (300001, "float32", "sum", 0, True), (300001, "float32", "avg", 1, False),
            (3000017, "float32", "sum", 0, False), (1000003, "bfloat16", "sum", 0, True),
            (777777, "float16", "max", 1, True), (250001, "int64", "prod", 0, False),
            (5, "float64", "min", 0, True))]
    env = {**REG_RED_ENV, "LINKWISE_GPU_AR_ALGO": "prs", **PRS_GEOMS[geom]}
    _check(run_ranks(_nranks(), _body, cases, env=env, timeout=300))
    if _nranks() >= 4 and geom != "b300-i8k-lag4":
        _check(run_ranks(3, _body, cases[::3], env=env, timeout=300))


def _prs_queue_body(comm, _):
    """prs all_reduces queued back to back with no host sync: sizes, item bytes and blocks
    change between calls (so scratch slots and flags carry over between calls of different
    geometry), some calls in place on one reused buffer (cloned on the stream in between),
    some out=. Checked after one synchronize, bitwise against the rank-order reference."""
    import os
    from gpu_util import host_input, mismatch, reference
    g, torch = _setup(comm)
    n, r = comm.size, comm.rank
    geoms = [("3", "4096"), ("32", "131072"), ("7", "12288"), ("64", "65536")]
    counts = [300001, 5, 1 << 20, 123457, 3000017, 77, 65536]
    shared = torch.empty(max(counts), device="cuda")
    plan, results = [], []
    try:
        for k, count in enumerate(counts):
            os.environ["LINKWISE_GPU_PRS_BLOCKS"], os.environ["LINKWISE_GPU_PRS_ITEM"] = geoms[k % 4]
            ins = [host_input(q, count, "float32", "sum", seed=900 + k) for q in range(n)]
            plan.append(reference(ins, "float32", "sum"))
            if k % 2 == 0:  # in place on the shared buffer
                x = shared[:count]
                x.copy_(ins[r])
                g.all_reduce(x)
                results.append(x.clone())
            else:
                x = ins[r].cuda()
                out = torch.full_like(x, 7)
                g.all_reduce(x, out=out)
                results.append(out)
    finally:
        os.environ.pop("LINKWISE_GPU_PRS_BLOCKS", None)
        os.environ.pop("LINKWISE_GPU_PRS_ITEM", None)
    torch.cuda.synchronize()
    errors = []
    for k, (want, got) in enumerate(zip(plan, results)):
        bad = mismatch(got.cpu(), want)
        if bad:
            errors.append(f"rank {r} call {k} ({counts[k]}): {bad}")
    g.close()
    return errors


def test_reg_all_reduce_prs_queued_back_to_back():
    env = {**REG_RED_ENV, "LINKWISE_GPU_AR_ALGO": "prs"}
    _check(run_ranks(_nranks(), _prs_queue_body, None, env=env, timeout=300))


def _prs_default_body(comm, _):
    """With no LINKWISE_GPU_AR_ALGO, a 2-rank all_reduce from LINKWISE_GPU_AR_PRS_MIN takes the
    prs kernel (its scratch gets mapped) and a smaller one does not; both exact."""
    g, torch = _setup(comm)
    r, errors = comm.rank, []
    for count, want_prs in ((1000, False), (300001, True)):
        x = torch.arange(count, device="cuda", dtype=torch.float32) % 97 + r
        g.all_reduce(x)
        want = (torch.arange(count, dtype=torch.float32) % 97) * comm.size + sum(range(comm.size))
        if not torch.equal(x.cpu(), want):
            errors.append(f"rank {r} {count}: wrong")
        if bool(g._prs_mapped) != want_prs:
            errors.append(f"rank {r} {count}: prs taken = {bool(g._prs_mapped)}, expected {want_prs}")
    g.close()
    return errors


def test_reg_all_reduce_prs_default_on_two_ranks():
    env = {**REG_RED_ENV, "LINKWISE_GPU_AR_PRS_MIN": str(1 << 20)}
    env.pop("LINKWISE_GPU_AR_ALGO", None)
    _check(run_ranks(2, _prs_default_body, None, env=env, timeout=300))

"""Sweeps of bench/gpu_tune.py for the fourth session's large forms (--pchain, --ar-forms):
the push-chain broadcast (csrc/cuda/bcast_chain.cu) and the large all_reduce forms (the
one-kernel form, registered reduce_scatter + all_gather; DCHAIN_SWEEP adds the work-claiming
chain broadcast), each against NCCL called directly (cupy) on the same tensors
and stream, and checked bitwise in the same run."""
from __future__ import annotations

import os

PCHAIN_KNOBS = ("LINKWISE_GPU_BCAST_ALGO", "LINKWISE_GPU_PCHAIN_BLOCKS", "LINKWISE_GPU_PCHAIN_SLICE",
                "LINKWISE_GPU_BCAST_UNROLL", "LINKWISE_GPU_PCHAIN_THREADS", "LINKWISE_GPU_DCHAIN_BLOCKS",
                "LINKWISE_GPU_DCHAIN_ITEM", "LINKWISE_GPU_DCHAIN_THREADS")
# (blocks, slice KiB, unroll[, threads]); overridable with PCHAIN_SWEEP="b:s:u[:t],b:s:u"
PCHAIN_SWEEP = [(32, 64, 4), (64, 32, 4), (64, 64, 4), (64, 128, 4), (128, 32, 4), (128, 64, 8)]


def _sweep():
    """PCHAIN_SWEEP (env) or the default, as (blocks, slice KiB, unroll, threads) tuples."""
    sweep = PCHAIN_SWEEP
    if os.environ.get("PCHAIN_SWEEP"):
        sweep = [tuple(int(v) for v in t.split(":")) for t in os.environ["PCHAIN_SWEEP"].split(",")]
    return [tuple(t) + (512,) * (4 - len(t)) for t in sweep]


def _geom_env(b, s, u, t):
    return {"LINKWISE_GPU_BCAST_ALGO": "pchain", "LINKWISE_GPU_PCHAIN_BLOCKS": str(b),
            "LINKWISE_GPU_PCHAIN_SLICE": str(s << 10), "LINKWISE_GPU_BCAST_UNROLL": str(u),
            "LINKWISE_GPU_PCHAIN_THREADS": str(t)}


def _sizes(a):
    from linkwise.bench import common
    return [common.parse_size(v) for v in a.sizes.split(",")]


def _direct(comm, g):
    from linkwise.bench.backends import LinkwiseBackend
    from linkwise.bench.gpu_nccl import NcclDirectBackend
    helper = LinkwiseBackend(comm)
    return helper, NcclDirectBackend(helper, g.device)


def sweep_bcast_forms(a, comm, g, torch, t_us, say, what, knobs, forms_of) -> None:
    """For each size of --sizes: NCCL's broadcast (called directly), then every (name, env) of
    forms_of(size) with its knobs set: every root once on fresh data, checked bitwise on every
    rank, then the time of a root-0 broadcast. "scratch" forces the scratch kernel."""
    helper, direct = _direct(comm, g)
    c, rank, n = direct.c, comm.rank, comm.size
    st = torch.cuda.current_stream().cuda_stream  # the bench stream (made current)
    saved = g._bcast_reg_min, g._chain_piece
    for size in _sizes(a):
        cnt = size // 4
        it = max(5, min(20, int(4e9 / size)))
        x = torch.empty(cnt, device="cuda")
        torch.manual_seed(size)
        xr = torch.randn(cnt, device="cuda")
        nc = t_us(lambda: c.broadcast(x.data_ptr(), x.data_ptr(), cnt, 7, 0, st), it)
        for name, env in forms_of(size):
            for k in knobs:
                os.environ.pop(k, None)
            os.environ.update(env)
            g._bcast_reg_min = 1 << 62 if name == "scratch" else 0
            g._chain_piece = int(env.get("LINKWISE_GPU_CHAIN_PIECE", 0))
            ok = True
            for root in range(n):
                if rank == root:
                    x.copy_(xr)
                else:
                    x.zero_()
                g.broadcast(x, root=root)
                torch.cuda.synchronize()
                ok &= bool(torch.equal(x, xr))
            ok = helper.max_over_ranks(0.0 if ok else 1.0) == 0.0  # right on every rank
            us = t_us(lambda: g.broadcast(x, root=0), it)
            say({"what": what, "op": "broadcast", "algo": name, "bytes": size, "us": round(us, 1), "ok": ok,
                 "busbw": round(size / us / 1e3, 1), "nccl_cupy_busbw": round(size / nc / 1e3, 1),
                 "ratio": round(nc / us, 3)})
        for k in knobs:
            os.environ.pop(k, None)
        x = xr = None  # free this size's tensors before the next size allocates
    g._bcast_reg_min, g._chain_piece = saved
    direct.close()


def pchain_forms(a, comm, g, torch, t_us, say) -> None:
    """--pchain: the push chain at several block counts / slice sizes against the chain."""
    sweep = _sweep()

    def forms_of(size):
        forms = [("chain", {"LINKWISE_GPU_BCAST_ALGO": "chain"})] if os.environ.get("PCHAIN_CE") else []
        forms += [(f"pchain b{b} s{s}K u{u} t{t}", _geom_env(b, s, u, t)) for b, s, u, t in sweep]
        # DCHAIN_SWEEP="blocks:item KiB:threads,...": the work-claiming chain (bcast_dchain.cu)
        for d in filter(None, os.environ.get("DCHAIN_SWEEP", "").split(",")):
            b, i, t = (int(v) for v in d.split(":"))
            forms.append((f"dchain b{b} i{i}K t{t}", {
                "LINKWISE_GPU_BCAST_ALGO": "dchain", "LINKWISE_GPU_DCHAIN_BLOCKS": str(b),
                "LINKWISE_GPU_DCHAIN_ITEM": str(i << 10), "LINKWISE_GPU_DCHAIN_THREADS": str(t)}))
        if size < 128 << 20:
            forms.append(("scratch", {}))
        return forms
    sweep_bcast_forms(a, comm, g, torch, t_us, say, "pchain", PCHAIN_KNOBS, forms_of)


def ar_forms(a, comm, g, torch, t_us, say) -> None:
    helper, direct = _direct(comm, g)
    c, rank, n = direct.c, comm.rank, comm.size
    st = torch.cuda.current_stream().cuda_stream
    for size in _sizes(a):
        cnt = size // 4
        it = max(5, min(20, int(4e9 / size)))
        x = torch.empty(cnt, device="cuda")
        torch.manual_seed(size + rank)
        xr = torch.randn(cnt, device="cuda")
        nc = t_us(lambda: c.allReduce(x.data_ptr(), x.data_ptr(), cnt, 7, 0, st), it)
        m = cnt // n

        def rsag():
            xs = x[rank * m:(rank + 1) * m]
            comm.reduce_scatter(x, out=xs)
            comm.all_gather(xs, out=x)
        forms = [("direct", {"LINKWISE_GPU_AR_ALGO": "direct"}, None),
                 ("rsag (engine)", {"LINKWISE_GPU_AR_ALGO": "rsag"}, None),
                 ("rs+ag (two calls)", {"LINKWISE_GPU_AR_ALGO": "direct"}, rsag)]
        if os.environ.get("AR_FORMS_SKIP_OLD"):  # only the one-kernel form (the bitwise reference)
            forms = forms[:1]
        # PRS_SWEEP="blocks:item KiB:lag,...": the push reduce-scatter all_reduce (reg_prs.cu)
        for d in filter(None, os.environ.get("PRS_SWEEP", "").split(",")):
            b, i, lag = (int(v) for v in d.split(":"))
            forms.append((f"prs b{b} i{i}K lag{lag}", {
                "LINKWISE_GPU_AR_ALGO": "prs", "LINKWISE_GPU_PRS_BLOCKS": str(b),
                "LINKWISE_GPU_PRS_ITEM": str(i << 10), "LINKWISE_GPU_PRS_LAG": str(lag)}, None))
        want = None
        for name, env, fn in forms:
            os.environ.update(env)
            fn = fn or (lambda: comm.all_reduce(x))
            x.copy_(xr)
            fn()
            torch.cuda.synchronize()
            if want is None:
                want = x.clone()
            ok = helper.max_over_ranks(0.0 if torch.equal(x, want) else 1.0) == 0.0
            us = t_us(fn, it)
            f = 2 * (n - 1) / n
            say({"what": "ar-forms", "algo": name, "bytes": size, "us": round(us, 1), "ok": ok,
                 "busbw": round(f * size / us / 1e3, 1), "nccl_cupy_busbw": round(f * size / nc / 1e3, 1),
                 "ratio": round(nc / us, 3)})
        for k in ("LINKWISE_GPU_AR_ALGO", "LINKWISE_GPU_PRS_BLOCKS", "LINKWISE_GPU_PRS_ITEM", "LINKWISE_GPU_PRS_LAG"):
            os.environ.pop(k, None)
        nc2 = t_us(lambda: c.allReduce(x.data_ptr(), x.data_ptr(), cnt, 7, 0, st), it)  # drift check
        say({"what": "ar-forms", "algo": "nccl again (after the forms)", "bytes": size,
             "nccl_cupy_busbw": round(2 * (n - 1) / n * size / nc2 / 1e3, 1)})
    direct.close()


def pchain_trace(a, comm, g, torch, t_us, say) -> None:
    """--pchain-trace: where a push-chain broadcast's time goes. For each size and geometry of
    PCHAIN_SWEEP: 8 back-to-back root-0 broadcasts with LINKWISE_GPU_PCHAIN_TRACE=1, then the
    last call's per-block %globaltimer stamps (bcast_chain.cu g_pchain_trace) of every rank, in
    µs from the root's earliest block start: block start (min / max), piece 0 ready (median /
    max), last piece ready (median / max), block done (min / median / max)."""
    import numpy as np
    sweep = _sweep()
    saved = g._bcast_reg_min
    g._bcast_reg_min = 0
    for size in _sizes(a):
        x = torch.ones(size // 4, device="cuda")
        for b, s, u, t in sweep:
            os.environ.update(_geom_env(b, s, u, t))
            us = t_us(lambda: g.broadcast(x, root=0), 10)
            os.environ["LINKWISE_GPU_PCHAIN_TRACE"] = "1"
            for _ in range(8):
                g.broadcast(x, root=0)
            torch.cuda.synchronize()
            os.environ.pop("LINKWISE_GPU_PCHAIN_TRACE")
            tr = np.array(g._engine.pchain_trace(), dtype=np.int64).reshape(-1, 4)[:b]
            allt = np.asarray(comm.all_gather(tr.reshape(-1))).reshape(comm.size, b, 4)
            t0 = allt[0, :, 0].min()
            rel = (allt - t0) / 1e3
            row = {"what": "pchain-trace", "bytes": size, "geom": f"b{b} s{s}K u{u} t{t}", "us": round(us, 1),
                   "busbw": round(size / us / 1e3, 1)}
            for r in range(comm.size):
                q = rel[r]
                row[f"r{r}"] = [round(float(v), 1) for v in (
                    q[:, 0].min(), q[:, 0].max(), np.median(q[:, 1]), q[:, 1].max(),
                    np.median(q[:, 2]), q[:, 2].max(), q[:, 3].min(), np.median(q[:, 3]), q[:, 3].max())]
            say(row)
        x = None
    for k in PCHAIN_KNOBS:
        os.environ.pop(k, None)
    g._bcast_reg_min = saved

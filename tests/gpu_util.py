"""Helpers for the GPU tests: per-rank inputs and NumPy references (float16/bfloat16 reduced
in float32, in rank order, as the kernels do)."""
from __future__ import annotations

import numpy as np

NP = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "float64": np.float64,
      "int64": np.int64}
ACC = {"float32": np.float32, "float16": np.float32, "bfloat16": np.float32, "int32": np.int32,
       "float64": np.float64, "int64": np.int64}


def host_input(rank: int, count: int, dtype: str, op: str, seed: int):
    """The CPU torch tensor rank `rank` contributes (same on every process)."""
    import torch
    rng = np.random.default_rng([seed, rank, count])
    if dtype.startswith("int"):
        lo, hi = (-2, 3) if op == "prod" else (-1000, 1000)
        a = rng.integers(lo, hi, count)
    elif op == "prod":
        a = rng.uniform(0.5, 1.5, count)
    else:
        a = rng.standard_normal(count)
    return torch.from_numpy(a).to(getattr(torch, dtype))


def to_numpy(t, acc: bool = True):
    import torch
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def reference(inputs, dtype: str, op: str):
    """Reduce the per-rank CPU tensors in rank order; returns a CPU torch tensor of dtype."""
    import torch
    acc_t = ACC[dtype]
    arrs = [to_numpy(t).astype(acc_t) for t in inputs]
    acc = arrs[0].copy()
    with np.errstate(over="ignore"):
        for a in arrs[1:]:
            if op in ("sum", "avg"):
                acc = (acc + a).astype(acc_t)
            elif op == "prod":
                acc = (acc * a).astype(acc_t)
            elif op == "min":
                acc = np.where(a < acc, a, acc)
            elif op == "max":
                acc = np.where(acc < a, a, acc)
    if op == "avg":
        n = len(inputs)
        if dtype.startswith("int"):
            acc = (np.sign(acc) * (np.abs(acc) // n)).astype(acc_t)
        else:
            acc = (acc / acc_t(n)).astype(acc_t)
    return torch.from_numpy(np.ascontiguousarray(acc)).to(getattr(torch, dtype))


def mismatch(got, want) -> str:
    """'' when equal (bitwise for floats, NaN never), else a short description."""
    import torch
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if torch.equal(got, want):
        return ""
    g, w = got.double(), want.double()
    err = ((g - w).abs() / w.abs().clamp_min(1e-30)).max().item() if g.numel() else 0.0
    bad = (got != want).nonzero()
    return f"{len(bad)} of {got.numel()} differ (first at {bad[0].tolist()}), max rel err {err:.3g}"


def collector(rank: int, errors: list, prefix: str = ""):
    """expect(name, got, want): appends "rank <rank> <prefix><name>: <mismatch>" to errors
    when the CUDA tensor got differs from the host reference want (mismatch's rules)."""
    def expect(name, got, want):
        bad = mismatch(got.cpu(), want)
        if bad:
            errors.append(f"rank {rank} {prefix}{name}: {bad}")
    return expect

"""Measured bandwidth and latency between every pair of devices (host and GPUs).

``probe()`` times copies with CUDA events through PyTorch: GPU->GPU as peer copies
(``dst.copy_(src)`` between devices, which uses cudaMemcpyPeerAsync with peer access on when
the pair allows it), host<->GPU from and to pinned host memory. ``reference_peer_bandwidth``
times cudaMemcpyPeerAsync directly through CuPy, to check the probe against.

Contracts
- Bandwidth is in GB/s (1e9 bytes per second) of one direction; latency in microseconds,
  the mean GPU time of back-to-back ``latency_bytes`` copies (launch overhead included).
- ``result.bandwidth_gbs[s][d]`` is for copies from ``devices[s]`` to ``devices[d]``;
  the diagonal is None. ``devices`` is ``["host", <one name per CUDA device>]``, in CUDA
  order: ``GPU<index>`` with the index of this machine's topology (NVML's, as the matrix
  names it) where CUDA's devices map to it (``CUDA_VISIBLE_DEVICES`` applied), else
  ``cuda<ordinal>`` (MIG instances, no NVML): never a CUDA ordinal that reads as another
  GPU's matrix name.
- With no CUDA device (or no torch) ``probe`` returns None and says why in ``reason``; it
  never raises for that. Buffers that cannot be allocated (a ``size_bytes`` larger than a
  GPU's memory) raise :class:`ProbeError` with one line. It is a measurement, not a test:
  numbers vary run to run.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional


class ProbeError(RuntimeError):
    """The probe could not run as asked (its buffers could not be allocated)."""


@dataclass
class ProbeResult:
    devices: list[str]
    bandwidth_gbs: list[list[Optional[float]]]
    latency_us: list[list[Optional[float]]]
    size_bytes: int
    iters: int
    latency_bytes: int
    backend: str
    peer_access: list[list[bool]] = field(default_factory=list)  # GPU x GPU
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def no_probe_reason() -> Optional[str]:
    """None when probing can run here, else a sentence saying why it cannot."""
    try:
        import torch  # type: ignore
    except ImportError:
        return "PyTorch is not installed: nothing to probe"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "no CUDA GPU visible: nothing to probe"
    return None


def _time_copies(torch, stream_device: int, fn: Callable[[], None], iters: int) -> float:
    """Seconds per call of ``fn`` (mean of ``iters`` after one warm-up), timed by events on
    ``stream_device``'s current stream (where torch enqueues a copy from that device)."""
    with torch.cuda.device(stream_device):
        fn()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters


def cuda_device_names(count: int, topology=None) -> list[str]:
    """Names of CUDA devices 0..count-1 as the topology matrix names them: ``GPU<index>``
    when the GPUs CUDA sees (``CUDA_VISIBLE_DEVICES`` applied, see
    ``affinity.visible_gpus``) are ``count`` GPUs of ``topology`` (default: this
    machine's), else ``cuda<ordinal>``."""
    from .affinity import visible_gpus
    if topology is None:
        from . import load_or_discover
        topology = load_or_discover()
    seen = visible_gpus(topology)
    if seen is None:
        seen = sorted(g.index for g in topology.gpus)
    if len(seen) == count:
        return [f"GPU{i}" for i in seen]
    return [f"cuda{i}" for i in range(count)]


def probe(size_bytes: int = 256 << 20, iters: int = 10, latency_bytes: int = 8,
          latency_iters: int = 200, progress: bool = True,
          gpus: Optional[list[int]] = None, topology=None) -> Optional[ProbeResult]:
    """``gpus``: CUDA ordinals to measure (default all); ``topology``: this machine's, to
    name them by (default: ``load_or_discover()``)."""
    if no_probe_reason() is not None:
        return None
    import torch  # type: ignore

    count = torch.cuda.device_count()
    names = cuda_device_names(count, topology)
    ids = list(range(count)) if gpus is None else list(gpus)
    devices = ["host"] + [names[i] if 0 <= i < count else f"cuda{i}" for i in ids]
    n = len(devices)
    bw: list[list[Optional[float]]] = [[None] * n for _ in range(n)]
    lat: list[list[Optional[float]]] = [[None] * n for _ in range(n)]
    peer = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in ids] for i in ids]

    try:
        big = {i: torch.empty(size_bytes, dtype=torch.uint8, device=f"cuda:{i}") for i in ids}
        big2 = {i: torch.empty(size_bytes, dtype=torch.uint8, device=f"cuda:{i}") for i in ids}
        small = {i: torch.empty(latency_bytes, dtype=torch.uint8, device=f"cuda:{i}")
                 for i in ids}
        host = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
        host_small = torch.empty(latency_bytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one; so is a pinning failure
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ProbeError(f"cannot allocate two {_bytes_text(size_bytes)} buffers per GPU "
                         f"and one in pinned host memory ({why})") from None

    # (src slot, dst slot, timing device, big copy, small copy)
    jobs = []
    for a, i in enumerate(ids, start=1):
        jobs.append((0, a, i, lambda i=i: big[i].copy_(host, non_blocking=True),
                     lambda i=i: small[i].copy_(host_small, non_blocking=True)))
        jobs.append((a, 0, i, lambda i=i: host.copy_(big[i], non_blocking=True),
                     lambda i=i: host_small.copy_(small[i], non_blocking=True)))
        for b, j in enumerate(ids, start=1):
            if i != j:
                jobs.append((a, b, i, lambda i=i, j=j: big2[j].copy_(big[i], non_blocking=True),
                             lambda i=i, j=j: small[j].copy_(small[i], non_blocking=True)))
    t0 = time.perf_counter()
    bar = _progress(progress, len(jobs))
    for src, dst, dev, copy_big, copy_small in jobs:
        sec = _time_copies(torch, dev, copy_big, iters)
        bw[src][dst] = size_bytes / sec / 1e9
        lat[src][dst] = _time_copies(torch, dev, copy_small, latency_iters) * 1e6
        if bar is not None:
            bar[0].update(bar[1], advance=1, description=f"{devices[src]} -> {devices[dst]}")
    if bar is not None:
        bar[0].stop()
    del big, big2, small, host, host_small
    return ProbeResult(devices=devices, bandwidth_gbs=bw, latency_us=lat,
                       size_bytes=size_bytes, iters=iters, latency_bytes=latency_bytes,
                       backend=f"torch {torch.__version__} copy_ + CUDA events",
                       peer_access=peer, seconds=time.perf_counter() - t0)


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    except ImportError:
        return None
    bar = Progress(TextColumn("probe {task.description:<14}"), BarColumn(),
                   MofNCompleteColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task("", total=total)
    bar.start()
    return bar, task


def reference_peer_bandwidth(src: int, dst: int, size_bytes: int = 256 << 20,
                             iters: int = 10) -> Optional[float]:
    """GB/s of cudaMemcpyPeerAsync from GPU ``src`` to GPU ``dst`` through CuPy's runtime
    bindings, peer access enabled both ways when possible; None when CuPy is missing."""
    try:
        import cupy as cp  # type: ignore
    except ImportError:
        return None
    rt = cp.cuda.runtime
    for a, b in ((src, dst), (dst, src)):
        with cp.cuda.Device(a):
            if rt.deviceCanAccessPeer(a, b):
                try:
                    rt.deviceEnablePeerAccess(b)
                except cp.cuda.runtime.CUDARuntimeError:
                    pass  # already enabled
    with cp.cuda.Device(dst):
        out = cp.empty(size_bytes, dtype=cp.uint8)
    with cp.cuda.Device(src):
        inp = cp.empty(size_bytes, dtype=cp.uint8)
        stream = cp.cuda.Stream(non_blocking=True)
        copy = lambda: rt.memcpyPeerAsync(out.data.ptr, dst, inp.data.ptr, src,  # noqa: E731
                                          size_bytes, stream.ptr)
        copy()
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(iters):
            copy()
        end.record(stream)
        end.synchronize()
        ms = cp.cuda.get_elapsed_time(start, end)
    return size_bytes * iters / (ms / 1e3) / 1e9


def render_probe(result: ProbeResult) -> str:
    """Two matrices, rows = source, columns = destination."""
    w = max(9, max(len(d) for d in result.devices) + 2)

    def table(title: str, m: list[list[Optional[float]]], fmt: str) -> list[str]:
        out = [title, "src\\dst".ljust(w) + "".join(d.rjust(w) for d in result.devices)]
        for s, row in enumerate(m):
            out.append(result.devices[s].ljust(w) + "".join(
                ("-" if v is None else format(v, fmt)).rjust(w) for v in row))
        return out

    lines = table(f"bandwidth GB/s ({_bytes_text(result.size_bytes)} copies, "
                  f"mean of {result.iters})", result.bandwidth_gbs, ".1f")
    lines += [""] + table(f"latency us ({result.latency_bytes} B copies)",
                          result.latency_us, ".2f")
    lines.append(f"backend: {result.backend}; {result.seconds:.1f} s")
    return "\n".join(lines)


def plot_bandwidth(result: ProbeResult, path: str) -> None:
    """Heat map of the bandwidth matrix, values written in the cells, saved to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    m = np.array([[np.nan if v is None else v for v in row] for row in result.bandwidth_gbs])
    n = len(result.devices)
    fig, ax = plt.subplots(figsize=(1.2 * n + 2, 1.0 * n + 1.5))
    im = ax.imshow(m, cmap="viridis")
    ax.set_xticks(range(n), result.devices)
    ax.set_yticks(range(n), result.devices)
    ax.set_xlabel("destination")
    ax.set_ylabel("source")
    ax.set_title(f"copy bandwidth, GB/s ({_bytes_text(result.size_bytes)})")
    mid = (np.nanmin(m) + np.nanmax(m)) / 2 if np.isfinite(m).any() else 0.0
    for s in range(n):
        for d in range(n):
            if not np.isnan(m[s, d]):
                ax.text(d, s, f"{m[s, d]:.0f}", ha="center", va="center",
                        color="k" if m[s, d] > mid else "w")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bytes_text(n: int) -> str:
    """256 MiB, 64 KiB, 100 B: the largest unit that divides n (a 1 KiB probe said 0 MiB)."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"

"""GPUs, NVLinks and GPU-GPU PCIe classes through NVML (the ``pynvml`` module of
nvidia-ml-py).

Contract: :func:`read_gpus` never raises. When pynvml is missing or NVML will not start
(no driver, no GPU) it returns no GPUs and a note saying why; a query that one GPU does not
support is skipped with a warning and the rest carry on; a GPU NVML will not open at all
(NoPermission in a container, GPU lost) is left out with a warning and the others keep
their NVML indices. NVML is shut down before return.

``Gpu.numa_node`` is left for the caller (sysfs's PCI ``numa_node`` is preferred): NVML's
own NUMA id goes to ``NvmlResult.numa_ids`` since on Grace Hopper/Blackwell it is the GPU's
CPU-less memory node, not the CPUs' node the GPU hangs off.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .model import Gpu
from .sysfs import normalize_bus_id

# nvmlDeviceGetTopologyCommonAncestor levels -> nvidia-smi classes.
_ANCESTOR = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# nvmlDeviceGetNvLinkRemoteDeviceType values (nvml.h: NVML_NVLINK_DEVICE_TYPE_*).
_NVLINK_DEVICE_GPU = 0
_NVLINK_DEVICE_CPU = 1        # IBMNPU: an NVLink to a CPU (POWER9)
_NVLINK_DEVICE_SWITCH = 2


@dataclass
class NvmlResult:
    gpus: list[Gpu] = field(default_factory=list)
    nvlinks: dict[tuple[int, int], int] = field(default_factory=dict)   # i < j
    pcie: dict[tuple[int, int], str] = field(default_factory=dict)      # i < j
    p2p_ok: dict[tuple[int, int], bool] = field(default_factory=dict)
    numa_ids: dict[int, int] = field(default_factory=dict)   # GPU index -> NVML's NUMA id
    driver: Optional[str] = None
    available: bool = False


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_gpus(ncpus: int, warnings: list[str], notes: list[str]) -> NvmlResult:
    res = NvmlResult()
    try:
        import pynvml  # type: ignore
    except ImportError:
        notes.append("pynvml (nvidia-ml-py) not installed: no GPU information")
        return res
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        notes.append(f"NVML unavailable ({type(exc).__name__}): no GPU information")
        return res
    try:
        res.available = True
        try:
            res.driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except Exception:
            pass
        handles: dict[int, Any] = {}   # NVML index -> handle, for the GPUs NVML opened
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
            except Exception as exc:
                warnings.append(f"NVML: GPU{i} cannot be opened ({type(exc).__name__}); "
                                f"left out, the other GPUs keep their indices")
                continue
            handles[i] = h
            res.gpus.append(_gpu(pynvml, i, h, ncpus, res, warnings))
        _links(pynvml, handles, res, warnings, notes)
    except Exception as exc:
        warnings.append(f"NVML query failed part way ({type(exc).__name__}: {exc})")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return res


def _try(warnings: list[str], what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        warnings.append(f"NVML: {what} failed ({type(exc).__name__})")
        return None


def _gpu(nv, index: int, h, ncpus: int, res: NvmlResult, warnings: list[str]) -> Gpu:
    g = Gpu(index=index, name=_text(_try(warnings, f"GPU{index} name", nv.nvmlDeviceGetName, h)
                                     or "unknown"))
    pci = _try(warnings, f"GPU{index} PCI info", nv.nvmlDeviceGetPciInfo, h)
    if pci is not None:
        g.pci_bus_id = normalize_bus_id(_text(pci.busId))
    uuid = _try(warnings, f"GPU{index} UUID", nv.nvmlDeviceGetUUID, h)
    g.uuid = _text(uuid) if uuid is not None else None
    mem = _try(warnings, f"GPU{index} memory", nv.nvmlDeviceGetMemoryInfo, h)
    g.memory_bytes = int(mem.total) if mem is not None else None
    words = max(1, (ncpus + 63) // 64)
    mask = _try(warnings, f"GPU{index} CPU affinity", nv.nvmlDeviceGetCpuAffinity, h, words)
    if mask is not None:
        g.cpu_affinity = [w * 64 + b for w, word in enumerate(mask) for b in range(64)
                          if (int(word) >> b) & 1]
    if hasattr(nv, "nvmlDeviceGetNumaNodeId"):
        try:
            node = int(nv.nvmlDeviceGetNumaNodeId(h))
            if node >= 0:
                res.numa_ids[index] = node
        except Exception:
            pass  # older drivers; sysfs gives it
    return g


def _links(nv, handles: dict[int, Any], res: NvmlResult, warnings: list[str],
           notes: list[str]) -> None:
    """NVLink counts per GPU pair (keys are NVML indices) and the PCIe class NVML reports
    for each pair.

    A link whose far end is another listed GPU counts for that pair. A link to an NVSwitch
    counts as a switch link, and two GPUs that both have switch links get min(switch links)
    between them (NVSwitch systems show NV18). A link of unknown remote type whose far end
    is not a listed GPU also counts as a switch link (a VM's NVSwitch that NVML cannot
    name). A link to a GPU this NVML does not list (a container given some of a box's GPUs)
    or to a CPU counts for no pair."""
    bus_to_index = {g.pci_bus_id: g.index for g in res.gpus if g.pci_bus_id}
    direct: dict[tuple[int, int], int] = {}
    switch_links = {i: 0 for i in handles}
    unseen_peers = {i: 0 for i in handles}
    max_links = getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)
    for i, h in handles.items():
        for link in range(max_links):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != 1:  # NVML_FEATURE_ENABLED
                    continue
            except Exception:
                break  # no NVLink on this GPU, or past its last link
            try:
                kind = int(nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link))
            except Exception:
                kind = None
            if kind == _NVLINK_DEVICE_SWITCH:
                switch_links[i] += 1
                continue
            if kind == _NVLINK_DEVICE_CPU:
                continue
            peer: Optional[int] = None
            try:
                remote = nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
                peer = bus_to_index.get(normalize_bus_id(_text(remote.busId)))
            except Exception:
                peer = None
            if peer is not None and peer != i:
                key = (min(i, peer), max(i, peer))
                direct[key] = direct.get(key, 0) + 1
            elif kind == _NVLINK_DEVICE_GPU:
                unseen_peers[i] += 1
            else:
                switch_links[i] += 1
    unseen = [f"GPU{i}" for i, n in unseen_peers.items() if n]
    if unseen:
        notes.append(f"NVLinks of {', '.join(unseen)} lead to GPUs NVML does not list "
                     "here; not counted")
    indices = sorted(handles)
    for a, i in enumerate(indices):
        for j in indices[a + 1:]:
            # a direct link is seen from both ends: count it once
            count = (direct.get((i, j), 0) + 1) // 2 if direct.get((i, j)) else 0
            if switch_links[i] and switch_links[j]:
                count += min(switch_links[i], switch_links[j])
            res.nvlinks[(i, j)] = count
            try:
                level = int(nv.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]))
                res.pcie[(i, j)] = _ANCESTOR.get(level, "SYS")
            except Exception:
                pass  # filled from sysfs paths by the caller
            try:
                status = nv.nvmlDeviceGetP2PStatus(handles[i], handles[j],
                                                   nv.NVML_P2P_CAPS_INDEX_READ)
                res.p2p_ok[(i, j)] = status == nv.NVML_P2P_STATUS_OK
            except Exception:
                pass

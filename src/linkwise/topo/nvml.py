"""GPUs, NVLinks and GPU-GPU PCIe classes through NVML (the ``pynvml`` module of
nvidia-ml-py).

Contract: :func:`read_gpus` never raises. When pynvml is missing or NVML will not start
(no driver, no GPU) it returns no GPUs and a note saying why; a query that one GPU does not
support is skipped with a warning and the rest carry on. NVML is shut down before return.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .model import Gpu
from .sysfs import normalize_bus_id

# nvmlDeviceGetTopologyCommonAncestor levels -> nvidia-smi classes.
_ANCESTOR = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_NVLINK_DEVICE_SWITCH = 2


@dataclass
class NvmlResult:
    gpus: list[Gpu] = field(default_factory=list)
    nvlinks: dict[tuple[int, int], int] = field(default_factory=dict)   # i < j
    pcie: dict[tuple[int, int], str] = field(default_factory=dict)      # i < j
    p2p_ok: dict[tuple[int, int], bool] = field(default_factory=dict)
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
        handles = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            handles.append(h)
            res.gpus.append(_gpu(pynvml, i, h, ncpus, warnings))
        _links(pynvml, handles, res, warnings)
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


def _gpu(nv, index: int, h, ncpus: int, warnings: list[str]) -> Gpu:
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
            g.numa_node = node if node >= 0 else None
        except Exception:
            pass  # older drivers; sysfs fills it in
    return g


def _links(nv, handles: list, res: NvmlResult, warnings: list[str]) -> None:
    """NVLink counts per GPU pair and the PCIe class NVML reports for each pair.

    A link whose far end is another GPU counts for that pair; a link to an NVSwitch (or to
    a device NVML cannot name, as in a VM) counts as a switch link, and two GPUs that both
    have switch links get min(switch links) between them - NVSwitch systems show NV18."""
    n = len(handles)
    bus_to_index = {g.pci_bus_id: g.index for g in res.gpus if g.pci_bus_id}
    direct: dict[tuple[int, int], int] = {}
    switch_links = [0] * n
    max_links = getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)
    for i, h in enumerate(handles):
        for link in range(max_links):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != 1:  # NVML_FEATURE_ENABLED
                    continue
            except Exception:
                break  # no NVLink on this GPU, or past its last link
            peer: Optional[int] = None
            try:
                kind = nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
            except Exception:
                kind = None
            if kind != _NVLINK_DEVICE_SWITCH:
                try:
                    remote = nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
                    peer = bus_to_index.get(normalize_bus_id(_text(remote.busId)))
                except Exception:
                    peer = None
            if peer is not None and peer != i:
                key = (min(i, peer), max(i, peer))
                direct[key] = direct.get(key, 0) + 1
            else:
                switch_links[i] += 1
    for i in range(n):
        for j in range(i + 1, n):
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

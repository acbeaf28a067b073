"""Discovery: sysfs + /proc + NVML -> :class:`Topology`.

Contract: ``discover()`` never raises for a missing, partial or odd sysfs/proc tree or for a
missing GPU stack; it returns what it saw and lists what it could not see in
``Topology.warnings`` (things a user may want to fix or know) and ``Topology.notes`` (plain
facts about the sources, e.g. "no NVML"). It does no I/O besides reading those files and
calling NVML, and it needs no root and no native linkwise module.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

from .model import Link, Topology
from .nvml import read_gpus
from .sysfs import classify_pcie, pci_device, read_cores, read_cpus, read_nics, read_text


def discover(sysfs_root: str = "/sys", proc_root: str = "/proc", *,
             use_nvml: bool = True) -> Topology:
    """Discover this machine's topology (see module docstring for the contract)."""
    warnings: list[str] = []
    notes: list[str] = []
    topo = Topology(source="discovered")
    topo.hostname = (read_text(os.path.join(proc_root, "sys/kernel/hostname"))
                     or socket.gethostname())
    try:
        topo.sockets, topo.numa_nodes, topo.cpus_allowed = read_cpus(
            sysfs_root, proc_root, warnings)
        topo.cores = read_cores(sysfs_root, topo.cpus)
    except Exception as exc:  # belt and braces: discovery must not raise
        warnings.append(f"CPU discovery failed ({type(exc).__name__}: {exc})")
    try:
        topo.nics = read_nics(sysfs_root, warnings, notes)
    except Exception as exc:
        warnings.append(f"NIC discovery failed ({type(exc).__name__}: {exc})")

    nv = None
    if use_nvml:
        ncpus = max(topo.cpus or [0]) + 1
        nv = read_gpus(max(ncpus, os.cpu_count() or 1), warnings, notes)
        topo.gpus = nv.gpus
        if nv.driver:
            notes.append(f"NVML driver {nv.driver}")
    else:
        notes.append("NVML not used (use_nvml=False)")

    # Devices that report no NUMA node go on the one node with CPUs, when there is one
    # (CPU-less memory nodes - CXL, HBM, a Grace Hopper GPU's memory - do not count).
    cpu_nodes = [n.id for n in topo.numa_nodes if n.cpus]
    single_node = cpu_nodes[0] if len(cpu_nodes) == 1 else None
    _place_gpus(topo, sysfs_root, single_node, nv.numa_ids if nv else {}, warnings, notes)
    _place_nics(topo, single_node, notes)
    _build_links(topo, nv)
    topo.warnings, topo.notes = warnings, notes
    return topo


def _place_gpus(topo: Topology, sysfs: str, single_node: Optional[int],
                nvml_numa: dict[int, int], warnings: list[str], notes: list[str]) -> None:
    """PCI path, NUMA node and CPU affinity of each GPU.

    NUMA node: the PCI device's sysfs ``numa_node``; else NVML's NUMA id when that node has
    CPUs (on Grace Hopper/Blackwell NVML gives the GPU's own CPU-less memory node, which
    says nothing about the CPUs and NICs near it); else the one node with CPUs if there is
    only one; else None."""
    unknown_numa = []
    for g in topo.gpus:
        if g.pci_bus_id:
            path, node, found = pci_device(sysfs, g.pci_bus_id)
            if found:
                g.pci_path = path
                g.numa_node = node
            else:
                warnings.append(f"GPU{g.index} ({g.pci_bus_id}) not found under "
                                f"{sysfs}/bus/pci/devices: PCIe path unknown")
        nv_node = nvml_numa.get(g.index)
        if g.numa_node is None and nv_node is not None and topo.numa_cpus(nv_node):
            g.numa_node = nv_node
        if g.numa_node is None:
            if single_node is not None:
                g.numa_node = single_node
            else:
                unknown_numa.append(g.label)
        if not g.cpu_affinity and g.numa_node is not None:
            g.cpu_affinity = topo.numa_cpus(g.numa_node)
    if topo.gpus and single_node is not None:
        notes.append(f"one NUMA node with CPUs: GPUs placed on node {single_node}")
    if unknown_numa:
        warnings.append(f"NUMA node unknown (sysfs numa_node -1) for {', '.join(unknown_numa)}"
                        "; CPU affinity from NVML only")


def _place_nics(topo: Topology, single_node: Optional[int], notes: list[str]) -> None:
    for nic in topo.real_nics():
        if nic.numa_node is None and single_node is not None and nic.pci_path:
            nic.numa_node = single_node
    virtual = [n.name for n in topo.nics if n.virtual]
    if virtual:
        notes.append(f"virtual interfaces, not used for traffic: {', '.join(virtual)}")


def _build_links(topo: Topology, nv) -> None:
    """One Link per pair of matrix devices (GPUs, then real NICs)."""
    items: list[tuple[str, list[str], Optional[int]]] = (
        [(g.label, g.pci_path, g.numa_node) for g in topo.gpus]
        + [(n.name, n.pci_path, n.numa_node) for n in topo.real_nics()])
    links: list[Link] = []
    for a in range(len(items)):
        for b in range(a + 1, len(items)):
            name_a, path_a, node_a = items[a]
            name_b, path_b, node_b = items[b]
            pcie = classify_pcie(path_a, path_b, node_a, node_b)
            nvl = 0
            if nv is not None and a < len(topo.gpus) and b < len(topo.gpus):
                i, j = topo.gpus[a].index, topo.gpus[b].index
                key = (min(i, j), max(i, j))
                nvl = nv.nvlinks.get(key, 0)
                pcie = nv.pcie.get(key, pcie)
            links.append(Link(a=name_a, b=name_b, pcie=pcie, nvlinks=nvl))
    topo.links = links

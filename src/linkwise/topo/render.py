"""Text views of a Topology: the ``nvidia-smi topo -m`` matrix and a binding table.

Contract: pure functions of a Topology (no I/O). ``render_matrix`` prints one header row and
one row per matrix device (GPUs, then real NICs); the first 1 + N whitespace-separated
tokens of each device row are its name and its N link classes, so the output can be compared
cell for cell with nvidia-smi's. GPU rows end with CPU affinity and NUMA affinity columns.
"""
from __future__ import annotations

from typing import Optional

from .model import LEGEND, Topology, format_cpulist


def render_matrix(topo: Topology, legend: bool = True) -> str:
    devices = topo.devices()
    if not devices:
        lines = ["(no GPUs and no real NICs: nothing to put in a matrix)"]
    else:
        width = max(6, max(len(d) for d in devices) + 2)
        gpu_by_label = {g.label: g for g in topo.gpus}
        affinity = {g.label: format_cpulist(topo.gpu_cpus(g.index)) or "N/A" for g in topo.gpus}
        # Wide enough for the longest CPU list and a space: the NUMA column stays a token of its own.
        cpu_width = max([16] + [len(a) + 2 for a in affinity.values()])
        head = " " * width + "".join(d.ljust(width) for d in devices)
        lines = [head + "CPU Affinity".ljust(cpu_width) + "NUMA Affinity"]
        nic_by_name = {n.name: n for n in topo.real_nics()}
        for a in devices:
            row = a.ljust(width) + "".join(topo.link_class(a, b).ljust(width) for b in devices)
            if a in gpu_by_label:
                g = gpu_by_label[a]
                numa = "N/A" if g.numa_node is None else str(g.numa_node)
                row += affinity[a].ljust(cpu_width) + numa
            else:
                node = nic_by_name[a].numa_node
                row += "".ljust(cpu_width) + ("" if node is None else str(node))
            lines.append(row.rstrip())
    if legend:
        lines += ["", "Legend:", ""]
        lines += [f"  {key:<4} = {text}" for key, text in LEGEND.items()]
    return "\n".join(lines)


def render_summary(topo: Topology) -> str:
    """A few lines on CPUs, GPUs and NICs, then notes and warnings."""
    lines = [f"host {topo.hostname or '?'} ({topo.source}): {len(topo.sockets)} socket(s), "
             f"{len(topo.numa_nodes)} NUMA node(s), {len(topo.cpus)} CPUs "
             f"({len(topo.cpus_allowed)} allowed)"]
    for n in topo.numa_nodes:
        lines.append(f"  NUMA {n.id}: CPUs {format_cpulist(n.cpus)}"
                     + ("" if n.socket is None else f" (socket {n.socket})"))
    for g in topo.gpus:
        mem = f", {g.memory_bytes / 2**30:.0f} GiB" if g.memory_bytes else ""
        lines.append(f"  {g.label}: {g.name}{mem}, PCI {g.pci_bus_id or '?'}, "
                     f"nearest NIC {topo.nearest_nic(g.index) or '-'}")
    for nic in topo.nics:
        speed = f"{nic.speed_mbps / 1000:g} Gb/s" if nic.speed_mbps else "speed ?"
        tag = "virtual" if nic.virtual else nic.kind
        node = "" if nic.numa_node is None else f", NUMA {nic.numa_node}"
        lines.append(f"  {nic.name}: {tag}, {speed}, PCI {nic.pci_bus_id or '-'}{node}")
    lines += [f"note: {t}" for t in topo.notes]
    lines += [f"warning: {t}" for t in topo.warnings]
    return "\n".join(lines)


def render_bindings(topo: Topology, nranks: int, visible: Optional[list[int]] = None) -> str:
    """The binding ``linkwise launch --bind auto`` would give ``nranks`` local ranks (GPUs as
    ``binding_for``'s ``visible`` leaves them)."""
    from .affinity import binding_for
    lines = [f"{'rank':<6}{'GPU':<6}{'NIC':<10}CPUs"]
    for r in range(nranks):
        b = binding_for(r, nranks, topo, visible)
        gpu = "-" if b.gpu is None else str(b.gpu)
        lines.append(f"{r:<6}{gpu:<6}{(b.nic or '-'):<10}{format_cpulist(b.cpus)}")
    return "\n".join(lines)

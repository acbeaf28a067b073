"""Reading the CPU, NUMA, PCI and NIC layout out of Linux sysfs and /proc.

Contract: every function here takes the roots it reads (so tests point them at a fake tree),
never raises on a missing or unreadable file, and reports what it could not see by
appending a sentence to the ``warnings`` list it is given. Nothing here needs root.
"""
from __future__ import annotations

import os
import re
from typing import Optional

from .model import Nic, NumaNode, Socket, parse_cpulist

# PCI domains are printed with at least 4 hex digits: 0000, and 10000 and up behind Intel
# VMD controllers.
_BDF = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}$")
# Interface name prefixes that are never a real NIC even when sysfs gives them a device.
_VIRTUAL_PREFIXES = ("lo", "ifb", "docker", "veth", "virbr", "br-", "cni", "flannel",
                     "cali", "tun", "tap", "dummy")


def read_text(path: str) -> Optional[str]:
    """File contents stripped, or None when it is missing or unreadable (EINVAL included:
    /sys/class/net/*/speed raises it for interfaces that are down or virtual)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def read_int(path: str) -> Optional[int]:
    text = read_text(path)
    try:
        return int(text, 0) if text is not None else None
    except ValueError:
        return None


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def normalize_bus_id(bus_id: str) -> str:
    """NVML's bus id (8-digit domain) -> the sysfs name, lower case, the domain with at least
    4 digits as the kernel prints it: ``00000000:18:00.0`` -> ``0000:18:00.0``,
    ``00010000:E1:00.0`` (behind VMD) -> ``10000:e1:00.0``."""
    bus_id = bus_id.strip().lower()
    dom, _, rest = bus_id.partition(":")
    try:
        dom = f"{int(dom, 16):04x}"
    except ValueError:
        pass  # not hex: left as it is, and found nowhere in sysfs
    return f"{dom}:{rest}"


# ----- CPUs and NUMA nodes --------------------------------------------------------------
def read_cpus(sysfs: str, proc: str, warnings: list[str]
              ) -> tuple[list[Socket], list[NumaNode], list[int]]:
    """Sockets, NUMA nodes and the CPUs this process may run on."""
    cpu_dir = os.path.join(sysfs, "devices/system/cpu")
    online_text = read_text(os.path.join(cpu_dir, "online"))
    cpuinfo = _parse_cpuinfo(read_text(os.path.join(proc, "cpuinfo")) or "")
    if online_text:
        online = parse_cpulist(online_text)
    elif cpuinfo:
        online = sorted(cpuinfo)
        warnings.append(f"{cpu_dir}/online unreadable; CPUs taken from {proc}/cpuinfo")
    else:
        online = list(range(os.cpu_count() or 1))
        warnings.append(f"neither {cpu_dir}/online nor {proc}/cpuinfo readable; "
                        f"assuming CPUs 0-{len(online) - 1}")

    # NUMA nodes
    node_dir = os.path.join(sysfs, "devices/system/node")
    nodes: list[NumaNode] = []
    online_set = set(online)
    for entry in listdir(node_dir):
        m = re.fullmatch(r"node(\d+)", entry)
        if not m:
            continue
        cpulist = read_text(os.path.join(node_dir, entry, "cpulist"))
        cpus = [c for c in parse_cpulist(cpulist or "") if c in online_set]
        nodes.append(NumaNode(id=int(m.group(1)), cpus=cpus,
                              memory_bytes=_node_memory(os.path.join(node_dir, entry))))
    nodes.sort(key=lambda n: n.id)
    if not nodes:
        warnings.append(f"no NUMA nodes under {node_dir}; assuming one node holding every CPU")
        nodes = [NumaNode(id=0, cpus=list(online))]

    # Sockets: physical_package_id per CPU, else /proc/cpuinfo "physical id".
    package: dict[int, int] = {}
    for cpu in online:
        pid = read_int(os.path.join(cpu_dir, f"cpu{cpu}/topology/physical_package_id"))
        if pid is None or pid < 0:  # -1: not reported (arm64 without ACPI PPTT)
            pid = cpuinfo.get(cpu)
        if pid is not None and pid >= 0:
            package[cpu] = pid
    if len(package) < len(online):
        warnings.append(f"socket of {len(online) - len(package)} CPU(s) unknown "
                        f"(no topology/physical_package_id, or -1); counted in socket 0")
    by_socket: dict[int, list[int]] = {}
    for cpu in online:
        by_socket.setdefault(package.get(cpu, 0), []).append(cpu)
    sockets = [Socket(id=s, cpus=sorted(c)) for s, c in sorted(by_socket.items())]
    for node in nodes:
        if node.cpus:
            node.socket = package.get(node.cpus[0], 0)
    for s in sockets:
        s.numa_nodes = [n.id for n in nodes if n.socket == s.id]

    allowed = _allowed_cpus(proc, online)
    return sockets, nodes, allowed


def read_cores(sysfs: str, online: list[int]) -> list[list[int]]:
    """Physical cores as lists of their online hardware threads, ordered by first CPU:
    ``topology/thread_siblings_list`` (``core_cpus_list`` on newer kernels) of each online
    CPU, else CPUs grouped by (``physical_package_id``, ``core_id``). ``[]`` when no CPU
    says (callers then take each CPU as a core of its own); a CPU that alone does not say
    is a core of its own."""
    cpu_dir = os.path.join(sysfs, "devices/system/cpu")
    online_set = set(online)
    cores: dict[int, tuple[int, ...]] = {}   # CPU -> its core's threads
    known = False
    for cpu in online:
        if cpu in cores:
            continue
        topo_dir = os.path.join(cpu_dir, f"cpu{cpu}/topology")
        text = (read_text(os.path.join(topo_dir, "thread_siblings_list"))
                or read_text(os.path.join(topo_dir, "core_cpus_list")))
        try:
            threads = [c for c in parse_cpulist(text or "") if c in online_set]
        except ValueError:
            threads = []
        if cpu not in threads:
            continue
        known = True
        for c in threads:
            cores[c] = tuple(threads)
    if not known:  # no sibling lists: core_id within each package
        by_core: dict[tuple[int, int], list[int]] = {}
        for cpu in online:
            core = read_int(os.path.join(cpu_dir, f"cpu{cpu}/topology/core_id"))
            pkg = read_int(os.path.join(cpu_dir, f"cpu{cpu}/topology/physical_package_id"))
            if core is not None:
                by_core.setdefault((pkg if pkg is not None else -1, core), []).append(cpu)
        for threads in by_core.values():
            known = True
            for c in threads:
                cores[c] = tuple(threads)
    if not known:
        return []
    groups = {cores.get(c, (c,)) for c in online}
    return sorted((list(g) for g in groups), key=lambda g: g[0])


def _parse_cpuinfo(text: str) -> dict[int, Optional[int]]:
    """processor -> physical id (None when absent) from /proc/cpuinfo."""
    out: dict[int, Optional[int]] = {}
    proc_id: Optional[int] = None
    for line in text.splitlines() + [""]:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            proc_id = int(value)
            out[proc_id] = None
        elif key == "physical id" and proc_id is not None:
            out[proc_id] = int(value)
    return out


def _node_memory(node_path: str) -> Optional[int]:
    text = read_text(os.path.join(node_path, "meminfo")) or ""
    m = re.search(r"MemTotal:\s+(\d+)\s*kB", text)
    return int(m.group(1)) * 1024 if m else None


def _allowed_cpus(proc: str, online: list[int]) -> list[int]:
    """The online CPUs this process may run on. ``Cpus_allowed_list`` is the raw mask and
    may name offline CPUs (and ones never present), which a rank cannot be bound to; with
    none of its CPUs online (a mask that cannot be right), every online CPU."""
    status = read_text(os.path.join(proc, "self/status")) or ""
    m = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
    if m:
        try:
            mask = set(parse_cpulist(m.group(1)))
        except ValueError:
            mask = set()
        return [c for c in online if c in mask] or list(online)
    if proc == "/proc" and hasattr(os, "sched_getaffinity"):
        mine = os.sched_getaffinity(0)
        return [c for c in online if c in mine] or sorted(mine)
    return list(online)


# ----- PCI ------------------------------------------------------------------------------
def pci_path_of(real: str) -> list[str]:
    """Host bridge and PCI functions along a resolved sysfs device path, outermost first:
    ``/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/net/eth0`` ->
    ``["pci0000:00", "0000:00:01.0", "0000:01:00.0"]``. Non-PCI tails are dropped; a path
    with no host bridge (virtio-mmio, platform devices) gives ``[]``."""
    parts = real.split(os.sep)
    out: list[str] = []
    for p in parts:
        if _HOST_BRIDGE.match(p):
            out = [p.lower()]
        elif _BDF.match(p) and out:
            out.append(p.lower())
    return out if len(out) >= 2 else []


def pci_device(sysfs: str, bus_id: str) -> tuple[list[str], Optional[int], bool]:
    """(pci path, NUMA node or None, found) of a PCI function by bus id."""
    link = os.path.join(sysfs, "bus/pci/devices", bus_id)
    if not os.path.exists(link):
        return [], None, False
    path = pci_path_of(os.path.realpath(link))
    return path, numa_of(link), True


def numa_of(dev_path: str) -> Optional[int]:
    node = read_int(os.path.join(dev_path, "numa_node"))
    return node if node is not None and node >= 0 else None


def classify_pcie(path_a: list[str], path_b: list[str],
                  numa_a: Optional[int], numa_b: Optional[int]) -> str:
    """nvidia-smi's class of the PCIe path between two devices.

    Paths are host bridge first, device last. Under different host bridges: NODE on one
    NUMA node (unknown counts as equal: a VM reporting -1 everywhere has one), else SYS.
    Under one host bridge: PHB when they part at the root complex, PIX when each side then
    crosses at most one switch port, PXB when more. No path known: NODE/SYS by NUMA."""
    same_node = numa_a == numa_b
    if not path_a or not path_b or path_a[0] != path_b[0]:
        return "NODE" if same_node else "SYS"
    bridges_a, bridges_b = path_a[1:-1], path_b[1:-1]
    common = 0
    while (common < min(len(bridges_a), len(bridges_b))
           and bridges_a[common] == bridges_b[common]):
        common += 1
    if common == 0:
        return "PHB"
    below = max(len(bridges_a), len(bridges_b)) - common
    return "PIX" if below <= 1 else "PXB"


# ----- NICs -----------------------------------------------------------------------------
def read_nics(sysfs: str, warnings: list[str], notes: list[str]) -> list[Nic]:
    """Interfaces of /sys/class/net merged with RDMA devices of /sys/class/infiniband."""
    net_dir = os.path.join(sysfs, "class/net")
    nics: dict[str, Nic] = {}
    names = listdir(net_dir)
    if not names:
        warnings.append(f"no network interfaces readable under {net_dir}")
    for name in names:
        base = os.path.join(net_dir, name)
        if not os.path.isdir(base):  # bonding_masters and the like: files, not interfaces
            continue
        real = os.path.realpath(base)
        ntype = read_int(os.path.join(base, "type"))
        kind = {1: "ethernet", 32: "infiniband", 772: "loopback"}.get(ntype or -1, "other")
        has_device = os.path.exists(os.path.join(base, "device"))
        virtual = (not has_device or "/devices/virtual/" in real
                   or name.startswith(_VIRTUAL_PREFIXES) or kind == "loopback")
        speed = read_int(os.path.join(base, "speed"))
        nic = Nic(name=name, kind=kind, virtual=virtual,
                  speed_mbps=speed if speed is not None and speed > 0 else None,
                  netdev=name)
        if has_device:
            dev_real = os.path.realpath(os.path.join(base, "device"))
            nic.pci_path = pci_path_of(dev_real)
            if nic.pci_path:
                nic.pci_bus_id = nic.pci_path[-1]
                nic.numa_node = numa_of(_pci_dir(dev_real, nic.pci_bus_id))
        nics[name] = nic

    ib_dir = os.path.join(sysfs, "class/infiniband")
    ib_names = listdir(ib_dir)
    if not ib_names:
        notes.append(f"no RDMA devices ({ib_dir} absent or empty)")
    for rdma in ib_names:
        base = os.path.join(ib_dir, rdma)
        dev_real = os.path.realpath(os.path.join(base, "device"))
        path = pci_path_of(dev_real)
        speed, link_layer = _rdma_ports(os.path.join(base, "ports"))
        netdevs = [n for n in listdir(os.path.join(base, "device/net")) if n in nics]
        if netdevs:
            nic = nics[netdevs[0]]
        else:
            nic = nics[rdma] = Nic(name=rdma, kind="infiniband")
        nic.rdma_device = rdma
        if link_layer == "infiniband":
            nic.kind = "infiniband"
        nic.speed_mbps = nic.speed_mbps or speed
        if path and not nic.pci_path:
            nic.pci_path, nic.pci_bus_id = path, path[-1]
            nic.numa_node = numa_of(_pci_dir(dev_real, path[-1]))
        if not path:
            warnings.append(f"RDMA device {rdma}: PCI path unreadable")
    return list(nics.values())


def _pci_dir(dev_real: str, bus_id: str) -> str:
    """The sysfs directory of PCI function ``bus_id`` on the resolved path ``dev_real``."""
    idx = dev_real.rfind(os.sep + bus_id)
    return dev_real[: idx + 1 + len(bus_id)] if idx >= 0 else dev_real


def _rdma_ports(ports_dir: str) -> tuple[Optional[int], Optional[str]]:
    """Fastest port rate in Mb/s ("100 Gb/sec (4X EDR)" -> 100000) and its link layer."""
    best: Optional[int] = None
    layer: Optional[str] = None
    for port in listdir(ports_dir):
        rate = read_text(os.path.join(ports_dir, port, "rate")) or ""
        m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate)
        if m:
            mbps = int(float(m.group(1)) * 1000)
            if best is None or mbps > best:
                best = mbps
                layer = (read_text(os.path.join(ports_dir, port, "link_layer")) or "").lower()
    return best, layer

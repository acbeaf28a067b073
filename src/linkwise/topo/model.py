"""The topology of one machine, as plain data.

A :class:`Topology` is a value: dataclasses of ints, strings and lists, with no handles to the
hardware. It is produced by :func:`linkwise.topo.discover`, loaded from a JSON file or a
shipped fixture, and consumed by planning, affinity and the ``linkwise topo`` CLI.

Contracts
- ``Topology.from_json(t.to_json()) == t`` and ``from_json(s).to_json() == s`` for any ``s``
  produced by ``to_json`` (exact round trip; tested).
- Device names: GPUs are ``"GPU<index>"``; NICs are named by their interface (``ib0``,
  ``eth0``) or, for an RDMA device with no interface, by its RDMA name (``mlx5_0``).
- ``links`` holds one :class:`Link` per unordered pair of matrix devices (GPUs and real
  NICs) whose path is known; ``pcie`` is the nvidia-smi class of the PCIe path (PIX, PXB,
  PHB, NODE, SYS) and ``nvlinks`` the number of NVLinks between two GPUs (0 for none).
- Unknown numbers are ``None`` (never -1): a NUMA node of ``None`` means "not reported".
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

# PCIe path classes, nearest first (the order nvidia-smi's legend implies).
PCIE_CLASSES = ("PIX", "PXB", "PHB", "NODE", "SYS")
# One-line meanings, printed as the legend of ``linkwise topo`` (our wording).
LEGEND = {
    "X": "the device itself",
    "NV#": "a bonded set of # NVLinks (directly or through NVSwitch)",
    "PIX": "at most one PCIe switch between the two",
    "PXB": "several PCIe switches, no host bridge",
    "PHB": "through a PCIe host bridge (usually the CPU's root complex)",
    "NODE": "across host bridges within one NUMA node",
    "SYS": "across the SMP interconnect between NUMA nodes (QPI/UPI/xGMI)",
}


def class_rank(cls: str) -> int:
    """Distance rank of a link class: NV# < PIX < PXB < PHB < NODE < SYS < unknown."""
    if cls.startswith("NV"):
        return 0
    try:
        return 1 + PCIE_CLASSES.index(cls)
    except ValueError:
        return 1 + len(PCIE_CLASSES)


def format_cpulist(cpus: list[int]) -> str:
    """``[0,1,2,5,7,8]`` -> ``"0-2,5,7-8"`` (the kernel's cpulist syntax)."""
    out: list[str] = []
    s = sorted(set(cpus))
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def parse_cpulist(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``; empty text gives ``[]``. Raises ValueError."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return sorted(set(cpus))


@dataclass
class NumaNode:
    id: int
    cpus: list[int]
    socket: Optional[int] = None
    memory_bytes: Optional[int] = None


@dataclass
class Socket:
    id: int
    cpus: list[int]
    numa_nodes: list[int] = field(default_factory=list)


@dataclass
class Gpu:
    index: int
    name: str
    pci_bus_id: Optional[str] = None       # sysfs form, "0000:18:00.0"
    uuid: Optional[str] = None
    memory_bytes: Optional[int] = None
    numa_node: Optional[int] = None
    cpu_affinity: list[int] = field(default_factory=list)
    pci_path: list[str] = field(default_factory=list)  # host bridge first, device last

    @property
    def label(self) -> str:
        return f"GPU{self.index}"


@dataclass
class Nic:
    name: str
    kind: str                  # "infiniband", "ethernet", "loopback", "other"
    virtual: bool = False      # lo, ifb*, bridges, veth: not for traffic between hosts
    speed_mbps: Optional[int] = None
    numa_node: Optional[int] = None
    pci_bus_id: Optional[str] = None
    pci_path: list[str] = field(default_factory=list)
    rdma_device: Optional[str] = None    # "mlx5_0" when the NIC has an RDMA side
    netdev: Optional[str] = None          # interface name, when it has one


@dataclass
class Link:
    a: str
    b: str
    pcie: str = "SYS"
    nvlinks: int = 0


@dataclass
class Topology:
    hostname: str = ""
    source: str = "discovered"        # "discovered", "fixture:<name>", "file:<path>"
    sockets: list[Socket] = field(default_factory=list)
    numa_nodes: list[NumaNode] = field(default_factory=list)
    cpus_allowed: list[int] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    nics: list[Nic] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # where the data came from
    warnings: list[str] = field(default_factory=list)   # what could not be seen

    # ----- queries ---------------------------------------------------------------------
    @property
    def cpus(self) -> list[int]:
        """All CPUs the machine has online (union of the NUMA nodes, else of sockets)."""
        src = self.numa_nodes or self.sockets
        return sorted({c for n in src for c in n.cpus})

    def real_nics(self) -> list[Nic]:
        """NICs that can carry traffic between hosts (not loopback, ifb, bridges...)."""
        return [n for n in self.nics if not n.virtual]

    def devices(self) -> list[str]:
        """Names of the devices in the link matrix: GPUs, then real NICs."""
        return [g.label for g in self.gpus] + [n.name for n in self.real_nics()]

    def link(self, a: str, b: str) -> Optional[Link]:
        for ln in self.links:
            if (ln.a, ln.b) in ((a, b), (b, a)):
                return ln
        return None

    def link_class(self, a: str, b: str) -> str:
        """The class nvidia-smi prints for a pair: X, NV#, PIX, PXB, PHB, NODE, SYS."""
        if a == b:
            return "X"
        ln = self.link(a, b)
        if ln is None:
            return "SYS"
        return f"NV{ln.nvlinks}" if ln.nvlinks > 0 else ln.pcie

    def nvlink_count(self, i: int, j: int) -> int:
        ln = self.link(f"GPU{i}", f"GPU{j}")
        return ln.nvlinks if ln else 0

    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU{index} in this topology")

    def numa_cpus(self, node: int) -> list[int]:
        for n in self.numa_nodes:
            if n.id == node:
                return list(n.cpus)
        return []

    def gpu_cpus(self, index: int) -> list[int]:
        """CPUs nearest a GPU: its NVML CPU affinity, else its NUMA node's CPUs, else all."""
        g = self.gpu(index)
        if g.cpu_affinity:
            return list(g.cpu_affinity)
        if g.numa_node is not None and self.numa_cpus(g.numa_node):
            return self.numa_cpus(g.numa_node)
        return self.cpus

    def nearest_nic(self, index: int) -> Optional[str]:
        """The real NIC closest to GPU ``index`` by link class, then speed, then order."""
        label = f"GPU{index}"
        best: Optional[tuple] = None
        for pos, nic in enumerate(self.real_nics()):
            key = (class_rank(self.link_class(label, nic.name)), -(nic.speed_mbps or 0), pos)
            if best is None or key < best[0]:
                best = (key, nic.name)
        return best[1] if best else None

    # ----- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": "linkwise-topology", "version": 1, **asdict(self)}

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Topology":
        """Raises ValueError for anything that is not a saved topology (wrong format, or
        fields of the wrong shape), never another error."""
        if not isinstance(d, dict):
            raise ValueError(f"not a linkwise topology (a JSON {type(d).__name__}, not an object)")
        if d.get("format", "linkwise-topology") != "linkwise-topology":
            raise ValueError(f"not a linkwise topology (format={d.get('format')!r})")
        try:
            return cls._from_fields(d)
        except (TypeError, AttributeError, KeyError) as exc:
            raise ValueError(f"not a linkwise topology ({exc})") from None

    @classmethod
    def _from_fields(cls, d: dict[str, Any]) -> "Topology":
        kinds = {"sockets": Socket, "numa_nodes": NumaNode, "gpus": Gpu, "nics": Nic,
                 "links": Link}
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        for key, value in d.items():
            if key not in names:
                continue  # "format", "version", or keys from a newer writer
            if key in kinds:
                sub = kinds[key]
                allowed = {f.name for f in fields(sub)}
                value = [sub(**{k: v for k, v in item.items() if k in allowed})
                         for item in value]
            kw[key] = value
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "Topology":
        """Exactly what was saved (linkwise.topo.load also notes where it came from)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

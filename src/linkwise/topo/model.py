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
- ``cores`` lists the physical cores as their online hardware threads (hyperthread
  siblings); ``[]`` means not known, and then every CPU counts as a core of its own. Files
  written before the field existed load with ``[]`` (format version 1 either way: a reader
  ignores keys it does not know).
- ``from_dict``/``from_json``/``load`` raise :class:`TopologyFormatError` (a ValueError) with
  one line for anything that is not a saved topology: no ``"format": "linkwise-topology"``,
  a field of the wrong type, a missing required field, invalid JSON; ``load`` names the file.
"""
from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, Optional, Union

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
    # Physical cores, each as its online hardware threads, by first CPU; [] = unknown.
    cores: list[list[int]] = field(default_factory=list)
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
    def from_dict(cls, d: Any) -> "Topology":
        """Raises TopologyFormatError (a ValueError) for anything that is not a saved
        topology (other format, fields of the wrong type), never another error."""
        if not isinstance(d, dict):
            raise TopologyFormatError(f"a JSON {_json_kind(d)}, not an object")
        if d.get("format") != "linkwise-topology":
            why = "no \"format\" key" if "format" not in d else f"format={d['format']!r}"
            raise TopologyFormatError(why)
        return _build(cls, d, "")

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        try:
            d = json.loads(text)
        except RecursionError:
            raise TopologyFormatError("JSON nested too deeply") from None
        except ValueError as exc:  # json.JSONDecodeError: truncated, not JSON at all
            raise TopologyFormatError(f"invalid JSON: {exc}") from None
        return cls.from_dict(d)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "Topology":
        """Exactly what was saved (linkwise.topo.load also notes where it came from).
        OSError when the file cannot be read; TopologyFormatError naming ``path`` when it
        is not a saved topology."""
        with open(path, encoding="utf-8") as f:
            try:
                return cls.from_json(f.read())
            except UnicodeDecodeError:
                raise TopologyFormatError("not UTF-8 text", path) from None
            except TopologyFormatError as exc:
                raise TopologyFormatError(exc.reason, path) from None


class TopologyFormatError(ValueError):
    """Not a saved topology: one line, ``not a linkwise topology[: <path>] (<reason>)``."""

    def __init__(self, reason: str, path: Optional[str] = None):
        self.reason, self.path = reason, path
        where = f": {path}" if path else ""
        super().__init__(f"not a linkwise topology{where} ({reason})")


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _build(cls: type, d: Any, where: str) -> Any:
    """An instance of dataclass ``cls`` from the JSON object ``d``, every field checked
    against its annotation; keys the class does not have are ignored (a newer writer's)."""
    if not isinstance(d, dict):
        raise TopologyFormatError(f"{where or 'top level'}: an object expected, "
                                  f"not a {_json_kind(d)}")
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in fields(cls):
        at = f"{where}.{f.name}" if where else f.name
        if f.name in d:
            kw[f.name] = _check(d[f.name], hints[f.name], at)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise TopologyFormatError(f"{at}: missing")
    return cls(**kw)


def _check(value: Any, tp: Any, where: str) -> Any:
    """``value`` (parsed JSON) as type ``tp``: int, str, bool, Optional[...], list[...] or
    a dataclass; TopologyFormatError naming ``where`` when it is not one."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):  # Optional[X]
        if value is None:
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            raise TopologyFormatError(f"{where}: an array expected, not a {_json_kind(value)}")
        (item,) = typing.get_args(tp)
        return [_check(v, item, f"{where}[{k}]") for k, v in enumerate(value)]
    if is_dataclass(tp):
        return _build(tp, value, where)
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool)}[tp]
    if not ok(value):
        want = {int: "an integer", str: "a string", bool: "true or false"}[tp]
        raise TopologyFormatError(f"{where}: {want} expected, not a {_json_kind(value)}")
    return value

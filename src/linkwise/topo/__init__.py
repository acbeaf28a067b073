"""What the machine is: CPUs, NUMA nodes, GPUs, NVLinks, PCIe paths and NICs.

Public API::

    topo = linkwise.topo.discover()            # this machine (never raises; see .warnings)
    topo = linkwise.topo.fixture("dgx1")        # shipped: dgx1, epyc-a100-pcie, hgx-h200-4
    topo = linkwise.topo.load_or_discover()     # LINKWISE_TOPO_FILE if set, else discover()
    text = linkwise.topo.render_matrix(topo)    # as `nvidia-smi topo -m`
    b = linkwise.topo.affinity.binding_for(local_rank, local_size, topo)

Topology is plain data; ``to_json``/``from_json`` round-trip exactly.
"""
from __future__ import annotations

import os
import socket
from importlib import resources
from typing import Optional

from .discover import discover
from .model import (LEGEND, PCIE_CLASSES, Gpu, Link, Nic, NumaNode, Socket, Topology,
                    TopologyFormatError, class_rank, format_cpulist, parse_cpulist)
from .render import render_bindings, render_matrix, render_summary

__all__ = [
    "Topology", "TopologyFormatError", "Gpu", "Nic", "NumaNode", "Socket", "Link", "PCIE_CLASSES", "LEGEND",
    "discover", "load", "load_or_discover", "fixture", "fixture_names", "render_matrix",
    "render_bindings", "render_summary", "class_rank", "format_cpulist", "parse_cpulist",
]

_cache: dict[str, Topology] = {}


def load(path: str) -> Topology:
    """A topology saved with ``Topology.save`` / ``linkwise topo --save``, its source now
    ``file:<path>``. Saved on this host, its allowed CPUs become this process's: they were
    the saving process's, which a taskset or a cgroup may have narrowed (two ranks bound to
    the one CPU a `taskset -c 0 linkwise topo --save` saw). A file from another host keeps
    its own."""
    topo = Topology.load(path)
    topo.source = f"file:{path}"
    if topo.hostname == socket.gethostname() and hasattr(os, "sched_getaffinity"):
        topo.cpus_allowed = sorted(set(topo.cpus) & os.sched_getaffinity(0)) or list(topo.cpus)
    return topo


def fixture_names() -> list[str]:
    """Names of the topologies shipped with the package."""
    root = resources.files(__name__).joinpath("fixtures")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def fixture(name: str) -> Topology:
    """A shipped topology by name (``dgx1``, ``epyc-a100-pcie``, ``hgx-h200-4``)."""
    res = resources.files(__name__).joinpath("fixtures", f"{name}.json")
    if not res.is_file():
        raise KeyError(f"no topology fixture {name!r}; have {', '.join(fixture_names())}")
    return Topology.from_json(res.read_text(encoding="utf-8"))


def load_or_discover(refresh: bool = False) -> Topology:
    """The topology to plan with: ``LINKWISE_TOPO_FILE`` when set, else this machine's.

    The result is cached per source within the process (discovery starts NVML, which can
    take a second); ``refresh=True`` reads again. Callers must not mutate the result."""
    path = _topo_file()
    key = f"file:{path}" if path else "discovered"
    if refresh or key not in _cache:
        _cache[key] = load(path) if path else discover()
    return _cache[key]


def _topo_file() -> Optional[str]:
    try:
        from .. import config
        value = config.get("LINKWISE_TOPO_FILE")
    except (ImportError, KeyError):
        value = os.environ.get("LINKWISE_TOPO_FILE", "")
    return value or None

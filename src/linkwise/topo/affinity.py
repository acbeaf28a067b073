"""Which GPU, CPU cores and NIC each local rank should use, and applying it.

``binding_for`` is pure (a function of the topology and the two numbers); the launcher calls
it for ``--bind auto``. ``bind`` applies it to the calling process, for processes started by
another launcher (torchrun, mpirun, srun, Dask).

Rules
- GPU: ``local_rank % ngpus`` over the GPUs CUDA can see: with ``CUDA_VISIBLE_DEVICES`` set
  (indices or ``GPU-<uuid>`` prefixes), those, in its order; ``Binding.gpu`` is then the
  GPU's index in the topology (NVML's) and ``Binding.device`` its CUDA ordinal, which
  ``LINKWISE_DEVICE`` gets. The variable is read for this machine's topology (none passed);
  ``visible=`` gives the list for any other.
- CPUs: the GPU's CPU affinity (NVML), else its NUMA node's CPUs, else all CPUs; ranks that
  share one GPU split that list into disjoint slices (one CPU at least each).
- No GPU: the allowed CPUs are split into ``local_size`` disjoint slices.
- Slicing: the CPUs are put in order by NUMA node, then physical core (``Topology.cores``;
  each CPU is a core of its own where that is unknown), then hardware thread, and each rank
  takes a contiguous run of whole cores; only with fewer cores than ranks are a core's
  threads split between ranks. So a slice stays within one NUMA node where the counts
  allow, and ranks never share a core they could have had apart. ``Binding.cpus`` is
  sorted.
- NIC: the GPU's nearest real NIC (link class, then speed); with no GPU, a real NIC on the
  slice's NUMA node, else the fastest real NIC; None when the machine has none.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .model import Topology


@dataclass(frozen=True)
class Binding:
    gpu: Optional[int]                  # the GPU's index in the topology (NVML's order)
    cpus: list[int] = field(default_factory=list)
    nic: Optional[str] = None
    device: Optional[int] = None        # its CUDA ordinal (= gpu unless CUDA_VISIBLE_DEVICES reorders)


def _cores_in_order(topo: Topology, cpus: list[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (``topo.cores``; a CPU no core lists is a core of
    its own), ordered by NUMA node (CPUs of no node last), then the core's first CPU."""
    want = set(cpus)
    groups: list[list[int]] = []
    for core in topo.cores:
        threads = sorted(c for c in core if c in want)
        if threads:
            groups.append(threads)
            want.difference_update(threads)
    groups += [[c] for c in sorted(want)]
    node_of = {c: n.id for n in topo.numa_nodes for c in n.cpus}
    last = max(node_of.values(), default=0) + 1
    return sorted(groups, key=lambda g: (node_of.get(g[0], last), g[0]))


def _slice(cores: list[list[int]], k: int, n: int) -> list[int]:
    """The k-th of n disjoint slices of the CPUs of ``cores`` (ordered core groups), sorted:
    contiguous runs of near-equal numbers of whole cores when there are at least n cores,
    else contiguous runs of the CPUs in core order; with fewer CPUs than slices, slice k is
    the single CPU ``cpus[k % len(cpus)]`` of that order."""
    flat = [c for core in cores for c in core]
    if not flat:
        return []
    if n <= 1:
        return sorted(flat)
    if len(cores) >= n:
        lo, hi = k * len(cores) // n, (k + 1) * len(cores) // n
        return sorted(c for core in cores[lo:hi] for c in core)
    if len(flat) < n:
        return [flat[k % len(flat)]]
    lo, hi = k * len(flat) // n, (k + 1) * len(flat) // n
    return sorted(flat[lo:hi])


def slice_cpus(topo: Topology, cpus: list[int], k: int, n: int) -> list[int]:
    """The k-th of n disjoint slices of ``cpus``, by the rules above (node, core, thread):
    what ranks without a GPU get, and `linkwise launch --bind cpu`."""
    return _slice(_cores_in_order(topo, cpus), k, n)


def binding_for(local_rank: int, local_size: int, topology: Optional[Topology] = None,
                visible: Optional[list[int]] = None) -> Binding:
    """See the module docstring. ``visible``: the topology indices of the GPUs CUDA sees, in
    CUDA's order (None: every GPU; read from CUDA_VISIBLE_DEVICES when topology is None)."""
    if local_size < 1 or not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank {local_rank} not in [0, local_size={local_size})")
    if topology is None:
        from . import load_or_discover
        topology = load_or_discover()
        if visible is None:
            visible = visible_gpus(topology)
    topo = topology
    allowed = sorted(topo.cpus_allowed or topo.cpus)
    gpus = sorted(g.index for g in topo.gpus) if visible is None else list(visible)
    if gpus:
        gpu = gpus[local_rank % len(gpus)]
        sharers = [r for r in range(local_size) if gpus[r % len(gpus)] == gpu]
        near = sorted(topo.gpu_cpus(gpu))
        allowed_set = set(allowed)
        usable = [c for c in near if c in allowed_set] if allowed else near
        cpus = _slice(_cores_in_order(topo, usable or near), sharers.index(local_rank),
                      len(sharers))
        return Binding(gpu=gpu, cpus=cpus, nic=topo.nearest_nic(gpu), device=gpus.index(gpu))
    cpus = _slice(_cores_in_order(topo, allowed), local_rank, local_size)
    return Binding(gpu=None, cpus=cpus, nic=_nic_for_cpus(topo, cpus))


def visible_gpus(topo: Topology, env: Optional[dict] = None) -> Optional[list[int]]:
    """The topology indices of the GPUs ``CUDA_VISIBLE_DEVICES`` leaves CUDA, in its order;
    None when it is unset (all) or names what cannot be mapped here (MIG instances). As CUDA
    does, the list ends at the first entry that names no GPU. Integer entries are taken as
    NVML's (PCI bus) order, which is CUDA's on machines of one GPU model."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    out: list[int] = []
    for item in (v.strip() for v in value.split(",")):
        if item.startswith("MIG-"):
            return None
        if item.lstrip("-").isdigit():
            idx = int(item)
            match = [g.index for g in topo.gpus if g.index == idx]
        else:
            match = [g.index for g in topo.gpus if g.uuid and item and g.uuid.startswith(item)]
        if len(match) != 1 or match[0] in out:
            break
        out.append(match[0])
    return out


def _nic_for_cpus(topo: Topology, cpus: list[int]) -> Optional[str]:
    real = topo.real_nics()
    if not real:
        return None
    node = None
    if cpus:
        for n in topo.numa_nodes:
            if cpus[0] in n.cpus:
                node = n.id
    local = [n for n in real if n.numa_node == node] or real
    return max(local, key=lambda n: n.speed_mbps or 0).name


def _local_size_from_env() -> Optional[int]:
    for var in ("LINKWISE_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                "MV2_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def bind(local_rank: int, local_size: Optional[int] = None,
         topology: Optional[Topology] = None) -> Binding:
    """Bind the calling process as ``binding_for`` says and return the binding.

    Sets the CPU affinity of the calling thread's process (``os.sched_setaffinity``; CPUs
    this process may not use are dropped, and if none remain the affinity is left alone),
    sets ``LINKWISE_DEVICE`` to the GPU's CUDA ordinal, and sets ``LINKWISE_SOCKET_IFNAME`` to
    ``=<nic>`` unless the user has already set it. ``local_size`` defaults to the launcher's
    variable (LINKWISE_LOCAL_SIZE, LOCAL_WORLD_SIZE, OMPI/MVAPICH/Slurm), else the count of
    GPUs CUDA sees, else ``local_rank + 1``. Without ``topology``, this machine's, and
    CUDA_VISIBLE_DEVICES applies."""
    visible = None
    if topology is None:
        from . import load_or_discover
        topology = load_or_discover()
        visible = visible_gpus(topology)
    if local_size is None:
        seen = len(topology.gpus) if visible is None else len(visible)
        local_size = _local_size_from_env() or max(seen, local_rank + 1)
    b = binding_for(local_rank, local_size, topology, visible)
    if b.cpus and hasattr(os, "sched_setaffinity"):
        mine = os.sched_getaffinity(0)
        cpus = [c for c in b.cpus if c in mine]
        if cpus:
            os.sched_setaffinity(0, cpus)
        else:
            print(f"linkwise.bind: CPUs {b.cpus} not allowed here; affinity unchanged",
                  file=sys.stderr)
    os.environ.update(binding_env(b, topology))
    return b


def binding_env(b: Binding, topology: Optional[Topology] = None,
                environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables a process bound as ``b`` gets (bind() sets them here, ``linkwise launch
    --bind auto`` in each rank): LINKWISE_DEVICE, the GPU's CUDA ordinal; and
    LINKWISE_SOCKET_IFNAME, the NIC's interface (socket_ifname), unless the user set one in
    ``environ`` (default os.environ; a nested launch passes it without its outer launcher's)."""
    env = {}
    if b.gpu is not None:
        env["LINKWISE_DEVICE"] = str(b.gpu if b.device is None else b.device)
    ifname = socket_ifname(b.nic, topology)
    if ifname and not (os.environ if environ is None else environ).get("LINKWISE_SOCKET_IFNAME"):
        env["LINKWISE_SOCKET_IFNAME"] = "=" + ifname
    return env


def socket_ifname(nic_name: Optional[str], topology: Optional[Topology] = None) -> Optional[str]:
    """The interface name of a Binding's NIC, for LINKWISE_SOCKET_IFNAME; None when there is
    no NIC, it has no interface (an RDMA device without a netdev), or its interface is not up
    with an IPv4 address here (a bond's member port: the address is the bond's, which the
    default selection finds), since TCP could not use it."""
    if not nic_name:
        return None
    if topology is None:
        from . import load_or_discover
        topology = load_or_discover()
    nic = next((n for n in topology.nics if n.name == nic_name), None)
    if nic is None or not nic.netdev:
        return None
    from ..netif import list_interfaces
    usable = {i.name for i in list_interfaces() if i.address and i.up}
    return nic.netdev if nic.netdev in usable else None

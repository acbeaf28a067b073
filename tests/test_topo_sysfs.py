"""Discovery against fake sysfs/proc trees and a fake NVML: partial trees, the GPU VM
(numa_node -1 everywhere, no /sys/class/infiniband, eth0/ifb0/ifb1/lo), and an IB host."""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from linkwise.topo import discover, render_matrix
from linkwise.topo.affinity import binding_for


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def link(at: Path, target: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(target)


def cpus(sys_root: Path, n: int, nodes: dict[int, str] | None = None, sockets=None) -> None:
    write(sys_root / "devices/system/cpu/online", f"0-{n - 1}\n")
    for c in range(n):
        pkg = 0 if sockets is None else sockets[c]
        write(sys_root / f"devices/system/cpu/cpu{c}/topology/physical_package_id", f"{pkg}\n")
    for node, cpulist in (nodes or {}).items():
        write(sys_root / f"devices/system/node/node{node}/cpulist", cpulist + "\n")
        write(sys_root / f"devices/system/node/node{node}/meminfo",
              f"Node {node} MemTotal:       1048576 kB\n")


def pci(sys_root: Path, chain: list[str], numa: int = -1) -> Path:
    """Create devices/<chain...> with numa_node files and a bus/pci/devices link."""
    d = sys_root / "devices"
    for part in chain:
        d = d / part
        if not part.startswith("pci"):
            write(d / "numa_node", f"{numa}\n")
            bus = sys_root / "bus/pci/devices" / part
            if not bus.exists():
                link(bus, d)
    return d


def netdev(sys_root: Path, name: str, dev: Path | None, ntype: int, speed: str | None) -> None:
    real = (dev / "net" / name) if dev else sys_root / "devices/virtual/net" / name
    write(real / "type", f"{ntype}\n")
    if speed is not None:
        write(real / "speed", speed + "\n")
    if dev:
        link(real / "device", dev)
    link(sys_root / "class/net" / name, real)


def proc(proc_root: Path, allowed: str) -> None:
    write(proc_root / "self/status", f"Name:\tpython\nCpus_allowed_list:\t{allowed}\n")
    write(proc_root / "sys/kernel/hostname", "fakehost\n")


def gpu_vm_tree(tmp_path: Path) -> tuple[str, str]:
    """The device VM as the design describes it, with 8 CPUs."""
    s, p = tmp_path / "sys", tmp_path / "proc"
    cpus(s, 8, {0: "0-7"})
    proc(p, "0-7")
    eth_pci = pci(s, ["pci0000:00", "0000:00:03.0"])
    virtio = eth_pci / "virtio2"
    virtio.mkdir(parents=True)
    netdev(s, "eth0", virtio, 1, "-1")
    netdev(s, "ifb0", None, 1, None)
    netdev(s, "ifb1", None, 1, None)
    netdev(s, "lo", None, 772, None)
    for i in range(4):
        pci(s, ["pci0000:00", f"0000:00:{5 + i:02x}.0"])
    return str(s), str(p)


def test_empty_tree_warns_and_still_gives_cpus(tmp_path):
    t = discover(str(tmp_path / "sys"), str(tmp_path / "proc"), use_nvml=False)
    assert t.cpus and t.numa_nodes and t.sockets
    text = " ".join(t.warnings)
    assert "NUMA" in text and "network interfaces" in text
    assert binding_for(0, 1, t).cpus


def test_partial_tree_warns_and_is_usable(tmp_path):
    s, p = tmp_path / "sys", tmp_path / "proc"
    write(s / "devices/system/cpu/online", "0-3\n")          # no node/, no topology/
    write(p / "cpuinfo", "".join(f"processor\t: {c}\nphysical id\t: {c // 2}\n\n"
                                 for c in range(4)))
    write(s / "class/net/README", "")                        # not an interface dir
    t = discover(str(s), str(p), use_nvml=False)
    assert t.cpus == [0, 1, 2, 3]
    assert [x.id for x in t.sockets] == [0, 1]               # from /proc/cpuinfo
    assert any("NUMA" in w for w in t.warnings)
    bs = [binding_for(r, 2, t) for r in range(2)]
    assert bs[0].cpus == [0, 1] and bs[1].cpus == [2, 3]
    print(render_matrix(t))


def test_gpu_vm_without_nvml(tmp_path):
    s, p = gpu_vm_tree(tmp_path)
    t = discover(s, p, use_nvml=False)
    assert t.hostname == "fakehost"
    assert t.cpus == list(range(8)) and t.cpus_allowed == list(range(8))
    by = {n.name: n for n in t.nics}
    assert set(by) == {"eth0", "ifb0", "ifb1", "lo"}
    assert not by["eth0"].virtual and by["eth0"].pci_bus_id == "0000:00:03.0"
    assert by["eth0"].speed_mbps is None                      # virtio reports -1
    assert by["ifb0"].virtual and by["ifb1"].virtual and by["lo"].virtual
    assert by["lo"].kind == "loopback"
    assert [n.name for n in t.real_nics()] == ["eth0"]
    assert binding_for(0, 2, t).nic == "eth0"
    assert any("infiniband" in n for n in t.notes)


class FakeNvml(types.ModuleType):
    """Just enough of pynvml for 4 H200 behind NVSwitch in a VM: 18 links per GPU, each to
    a switch; NUMA id -1; CPU affinity = all 8 CPUs; GPUs at 0000:00:05.0 .. 08.0."""
    NVML_P2P_CAPS_INDEX_READ = 0
    NVML_P2P_STATUS_OK = 0
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, n=4, fail_uuid=False):
        super().__init__("pynvml")
        self.n, self.fail_uuid, self.shut = n, fail_uuid, False

    def nvmlInit(self): pass
    def nvmlShutdown(self): self.shut = True
    def nvmlSystemGetDriverVersion(self): return "580.159.04"
    def nvmlDeviceGetCount(self): return self.n
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        if self.fail_uuid:
            raise RuntimeError("not supported")
        return f"GPU-{h}"

    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=f"00000000:00:{5 + h:02X}.0".encode())

    def nvmlDeviceGetMemoryInfo(self, h): return types.SimpleNamespace(total=143771 << 20)
    def nvmlDeviceGetCpuAffinity(self, h, words): return [0xFF] + [0] * (words - 1)
    def nvmlDeviceGetNumaNodeId(self, h): return -1
    def nvmlDeviceGetNvLinkState(self, h, link): return 1
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link): return 2   # NVSwitch
    def nvmlDeviceGetTopologyCommonAncestor(self, a, b): return 30     # host bridge
    def nvmlDeviceGetP2PStatus(self, a, b, idx): return 0


def test_gpu_vm_with_fake_nvml(tmp_path, monkeypatch):
    s, p = gpu_vm_tree(tmp_path)
    fake = FakeNvml(fail_uuid=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    t = discover(s, p)
    assert fake.shut
    assert [g.name for g in t.gpus] == ["NVIDIA H200"] * 4
    assert [g.pci_bus_id for g in t.gpus] == [f"0000:00:{5 + i:02x}.0" for i in range(4)]
    assert all(g.numa_node == 0 for g in t.gpus)             # one node: inferred
    assert all(g.cpu_affinity == list(range(8)) for g in t.gpus)
    assert all(t.link_class(f"GPU{i}", f"GPU{j}") == "NV18"
               for i in range(4) for j in range(4) if i != j)
    assert t.link_class("GPU0", "eth0") == "PHB"
    assert any("UUID" in w for w in t.warnings)              # partial NVML: warned, went on
    assert [t.nearest_nic(i) for i in range(4)] == ["eth0"] * 4
    out = render_matrix(t)
    assert "NV18" in out and "ifb0" not in out
    assert [binding_for(r, 4, t).gpu for r in range(4)] == [0, 1, 2, 3]


def test_nvml_init_failure_is_a_note(tmp_path, monkeypatch):
    s, p = gpu_vm_tree(tmp_path)
    fake = FakeNvml()

    def boom():
        raise RuntimeError("driver not loaded")
    fake.nvmlInit = boom
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    t = discover(s, p)
    assert t.gpus == [] and any("NVML unavailable" in n for n in t.notes)


def test_two_socket_ib_host(tmp_path):
    """Two NUMA nodes; an IB NIC (mlx5_0 / ib0) under a PCIe switch on node 1, an Ethernet
    NIC on node 0, a docker bridge; RDMA rate gives the speed."""
    s, p = tmp_path / "sys", tmp_path / "proc"
    cpus(s, 8, {0: "0-3", 1: "4-7"}, sockets=[0, 0, 0, 0, 1, 1, 1, 1])
    proc(p, "0-7")
    sw = ["pci0000:80", "0000:80:01.0", "0000:81:00.0"]
    ib_dev = pci(s, sw + ["0000:82:00.0", "0000:83:00.0"], numa=1)
    eth_dev = pci(s, ["pci0000:00", "0000:00:02.0", "0000:01:00.0"], numa=0)
    netdev(s, "ib0", ib_dev, 32, "100000")
    netdev(s, "enp1s0", eth_dev, 1, "25000")
    netdev(s, "docker0", None, 1, None)
    ib = s / "class/infiniband/mlx5_0"
    link(ib / "device", ib_dev)
    write(ib / "ports/1/rate", "200 Gb/sec (4X HDR)\n")
    write(ib / "ports/1/link_layer", "InfiniBand\n")
    t = discover(str(s), str(p), use_nvml=False)
    assert t.warnings == []
    by = {n.name: n for n in t.nics}
    assert by["ib0"].rdma_device == "mlx5_0" and by["ib0"].kind == "infiniband"
    assert by["ib0"].numa_node == 1 and by["ib0"].speed_mbps == 100000
    assert by["ib0"].pci_path == sw + ["0000:82:00.0", "0000:83:00.0"]
    assert by["enp1s0"].numa_node == 0 and by["docker0"].virtual
    assert t.link_class("ib0", "enp1s0") == "SYS"
    assert [n.socket for n in t.numa_nodes] == [0, 1]
    # no GPU: rank slices follow NUMA; NIC on the slice's node
    assert binding_for(0, 2, t).nic == "enp1s0" and binding_for(1, 2, t).nic == "ib0"


@pytest.mark.skipif(not os.path.isdir("/sys/class/net"), reason="needs Linux sysfs")
def test_real_sysfs_has_no_traceback():
    t = discover()
    assert t.cpus


def test_one_cpu_node_and_a_memory_only_node_places_devices(tmp_path, monkeypatch):
    """A CPU-less memory node (CXL, HBM, GPU memory) beside the one node with CPUs: devices
    reporting numa_node -1 still go on the CPU node, as with one node."""
    s, p = gpu_vm_tree(tmp_path)
    write(Path(s) / "devices/system/node/node1/cpulist", "\n")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(n=2))
    t = discover(s, p)
    assert [n.id for n in t.numa_nodes] == [0, 1]
    assert [g.numa_node for g in t.gpus] == [0, 0]
    assert [n.numa_node for n in t.real_nics()] == [0]
    assert not any("NUMA node unknown" in w for w in t.warnings)


def test_offline_cpus_are_not_allowed(tmp_path):
    """Cpus_allowed_list is the raw mask: it names CPUs 4-7 and 12-15, offline here."""
    s, p = tmp_path / "sys", tmp_path / "proc"
    online = [0, 1, 2, 3, 8, 9, 10, 11]
    write(s / "devices/system/cpu/online", "0-3,8-11\n")
    for c in online:
        write(s / f"devices/system/cpu/cpu{c}/topology/physical_package_id", "0\n")
    write(s / "devices/system/node/node0/cpulist", "0-15\n")
    proc(p, "0-15")
    t = discover(str(s), str(p), use_nvml=False)
    assert t.cpus == online and t.cpus_allowed == online
    bound = [c for r in range(4) for c in binding_for(r, 4, t).cpus]
    assert sorted(bound) == online


def test_vmd_domains_of_five_digits(tmp_path, monkeypatch):
    """A NIC and a GPU behind an Intel VMD controller, in PCI domain 10000."""
    from linkwise.topo.sysfs import normalize_bus_id
    assert normalize_bus_id("00010000:E2:00.0") == "10000:e2:00.0"
    assert normalize_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert normalize_bus_id("0000:18:00.0") == "0000:18:00.0"
    s, p = tmp_path / "sys", tmp_path / "proc"
    cpus(s, 4, {0: "0-3"})
    proc(p, "0-3")
    vmd = ["pci0000:00", "0000:00:0e.0", "pci10000:e0"]
    nic_dev = pci(s, vmd + ["10000:e0:1d.0", "10000:e1:00.0"], numa=0)
    netdev(s, "enp225s0", nic_dev, 1, "100000")
    pci(s, vmd + ["10000:e0:1e.0", "10000:e2:00.0"], numa=0)

    class Nvml(FakeNvml):
        def nvmlDeviceGetPciInfo(self, h):
            return types.SimpleNamespace(busId=b"00010000:E2:00.0")

        def nvmlDeviceGetNvLinkState(self, h, link):
            raise RuntimeError("not supported")
    monkeypatch.setitem(sys.modules, "pynvml", Nvml(n=1))
    t = discover(str(s), str(p))
    [nic] = t.real_nics()
    assert nic.pci_bus_id == "10000:e1:00.0"
    assert nic.pci_path == ["pci10000:e0", "10000:e0:1d.0", "10000:e1:00.0"]
    assert t.gpus[0].pci_bus_id == "10000:e2:00.0"
    assert t.gpus[0].pci_path == ["pci10000:e0", "10000:e0:1e.0", "10000:e2:00.0"]
    assert not any("not found" in w for w in t.warnings)
    assert t.link_class("GPU0", "enp225s0") == "PHB"   # two root ports of one VMD domain


def test_package_id_minus_one_is_unknown_not_socket_minus_one(tmp_path):
    """arm64 without ACPI PPTT reports physical_package_id -1."""
    s, p = tmp_path / "sys", tmp_path / "proc"
    cpus(s, 4, {0: "0-3"}, sockets=[-1] * 4)
    proc(p, "0-3")
    t = discover(str(s), str(p), use_nvml=False)
    assert [x.id for x in t.sockets] == [0] and t.numa_nodes[0].socket == 0
    assert t.sockets[0].numa_nodes == [0]
    assert any("socket of 4 CPU(s) unknown" in w for w in t.warnings)

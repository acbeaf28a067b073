"""NVML readings against fake pynvml modules: where GPUs sit (Grace Hopper's GPU memory
nodes), NVLinks whose far end is not a listed GPU, and GPUs NVML will not open."""
from __future__ import annotations

import sys
import types
from pathlib import Path

from linkwise.topo import discover
from linkwise.topo.affinity import binding_for
from test_topo_sysfs import FakeNvml, cpus, gpu_vm_tree, netdev, pci, proc

NVLINK_GPU, NVLINK_CPU, NVLINK_SWITCH, NVLINK_UNKNOWN = 0, 1, 2, 0xFF


def _grace_tray(tmp_path: Path) -> tuple[str, str]:
    """2 Grace CPU nodes (0: CPUs 0-7, 1: CPUs 8-15) and 4 CPU-less GPU memory nodes 2-5;
    GPU0/1 and ib0/ib1 on node 0, GPU2/3 and ib2/ib3 on node 1 (sysfs numa_node), each on
    its own host bridge."""
    s, p = tmp_path / "sys", tmp_path / "proc"
    cpus(s, 16, {0: "0-7", 1: "8-15", 2: "", 3: "", 4: "", 5: ""}, sockets=[0] * 8 + [1] * 8)
    proc(p, "0-15")
    for g in range(4):
        pci(s, [f"pci000{g}:00", f"000{g}:00:00.0", f"000{g}:01:00.0"], numa=g // 2)
    for k in range(4):
        d = pci(s, [f"pci000{k + 4}:00", f"000{k + 4}:00:00.0", f"000{k + 4}:01:00.0"],
                numa=k // 2)
        netdev(s, f"ib{k}", d, 32, "400000")
    return str(s), str(p)


class GraceNvml(FakeNvml):
    """NVML on the tray: each GPU's NUMA id is its own memory node (2 + index)."""
    def nvmlDeviceGetPciInfo(self, h):
        return types.SimpleNamespace(busId=f"0000000{h}:01:00.0".encode())

    def nvmlDeviceGetNumaNodeId(self, h): return 2 + h
    def nvmlDeviceGetCpuAffinity(self, h, words): return [0x00FF if h < 2 else 0xFF00]

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 40 if a // 2 == b // 2 else 50


def test_gpu_memory_nodes_do_not_place_the_gpus(tmp_path, monkeypatch):
    s, p = _grace_tray(tmp_path)
    monkeypatch.setitem(sys.modules, "pynvml", GraceNvml(n=4))
    t = discover(s, p)
    assert [g.numa_node for g in t.gpus] == [0, 0, 1, 1]       # sysfs, not NVML's 2..5
    assert [t.nearest_nic(i) for i in range(4)] == ["ib0", "ib0", "ib2", "ib2"]
    assert [binding_for(r, 4, t).nic for r in range(4)] == ["ib0", "ib0", "ib2", "ib2"]
    assert t.link_class("GPU0", "ib1") == "NODE" and t.link_class("GPU0", "ib2") == "SYS"


def test_nvml_numa_id_fills_in_only_a_node_with_cpus(tmp_path, monkeypatch):
    s, p = _grace_tray(tmp_path)
    for g in range(4):  # as in a VM: sysfs knows no node
        (Path(s) / f"bus/pci/devices/000{g}:01:00.0/numa_node").write_text("-1\n")

    class Nvml(GraceNvml):
        def nvmlDeviceGetNumaNodeId(self, h): return [1, 0, 4, -1][h]
    monkeypatch.setitem(sys.modules, "pynvml", Nvml(n=4))
    t = discover(s, p)
    # GPU2's NVML node 4 has no CPUs, GPU3's is unknown: two CPU nodes, so no guess
    assert [g.numa_node for g in t.gpus] == [1, 0, None, None]
    assert any("GPU2, GPU3" in w for w in t.warnings)


def test_nvlinks_to_gpus_not_listed_here_are_not_switch_links(tmp_path, monkeypatch):
    """A container given host GPUs 0 and 2 of a box whose NVLink bridges pair 0-1 and 2-3:
    each GPU's links lead to a GPU this NVML cannot see; nvidia-smi shows no NVLink."""
    s, p = gpu_vm_tree(tmp_path)
    bus = ["05", "07"]
    peer_bus = {"05": "06", "07": "08"}

    class Nvml(FakeNvml):
        def nvmlDeviceGetPciInfo(self, h):
            return types.SimpleNamespace(busId=f"00000000:00:{bus[h]}.0".encode())

        def nvmlDeviceGetNvLinkState(self, h, link):
            if link >= 12:
                raise RuntimeError("invalid argument")
            return 1

        def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link): return NVLINK_GPU

        def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
            return types.SimpleNamespace(busId=f"00000000:00:{peer_bus[bus[h]]}.0".encode())

        def nvmlDeviceGetTopologyCommonAncestor(self, a, b): return 50
    monkeypatch.setitem(sys.modules, "pynvml", Nvml(n=2))
    t = discover(s, p)
    assert t.nvlink_count(0, 1) == 0 and t.link_class("GPU0", "GPU1") == "SYS"
    assert any("GPU0, GPU1" in n and "not counted" in n for n in t.notes)


def test_nvlink_kinds(tmp_path, monkeypatch):
    """Per link: to a CPU - none; unknown type, far end a listed GPU - direct; unknown type,
    far end unresolvable - a switch link (a VM's NVSwitch); NVSwitch - a switch link."""
    s, p = gpu_vm_tree(tmp_path)
    # GPU -> link -> (remote type, remote bus or None)
    plan = {0: [(NVLINK_CPU, None), (NVLINK_UNKNOWN, "06"), (NVLINK_SWITCH, None)],
            1: [(NVLINK_UNKNOWN, "05"), (NVLINK_CPU, None), (NVLINK_SWITCH, None)],
            2: [(NVLINK_SWITCH, None), (NVLINK_UNKNOWN, None), (NVLINK_CPU, None)],
            3: [(NVLINK_CPU, None)] * 3}

    class Nvml(FakeNvml):
        def nvmlDeviceGetNvLinkState(self, h, link):
            if link >= 3:
                raise RuntimeError("invalid argument")
            return 1

        def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link): return plan[h][link][0]

        def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
            remote = plan[h][link][1]
            if remote is None:
                raise RuntimeError("not supported")
            return types.SimpleNamespace(busId=f"00000000:00:{remote}.0".encode())
    monkeypatch.setitem(sys.modules, "pynvml", Nvml(n=4))
    t = discover(s, p)
    # 0-1: one direct (seen from both ends) + min(1, 1) through the switch
    assert t.nvlink_count(0, 1) == 2
    assert t.nvlink_count(0, 2) == 1 and t.nvlink_count(1, 2) == 1   # switch: min(1, 2)
    assert all(t.nvlink_count(i, 3) == 0 for i in range(3))          # GPU3: CPU links only


def test_a_gpu_nvml_cannot_open_leaves_out_only_that_gpu(tmp_path, monkeypatch):
    """GPU0 refuses (NoPermission); GPU1-GPU2 have 2 direct NVLinks; GPU3 none."""
    s, p = gpu_vm_tree(tmp_path)

    class NVMLError_NoPermission(Exception):
        pass

    class Nvml(FakeNvml):
        def nvmlDeviceGetHandleByIndex(self, i):
            if i == 0:
                raise NVMLError_NoPermission("Insufficient Permissions")
            return i

        def nvmlDeviceGetNvLinkState(self, h, link):
            if h == 3 or link >= 2:
                raise RuntimeError("invalid argument")
            return 1

        def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link): return NVLINK_GPU

        def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
            return types.SimpleNamespace(busId=f"00000000:00:{5 + {1: 2, 2: 1}[h]:02X}.0".encode())

        def nvmlDeviceGetTopologyCommonAncestor(self, a, b): return 30 if 3 in (a, b) else 20
    fake = Nvml(n=4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    t = discover(s, p)
    assert fake.shut
    assert [(g.index, g.pci_bus_id) for g in t.gpus] == [
        (i, f"0000:00:{5 + i:02x}.0") for i in (1, 2, 3)]
    assert t.devices()[:3] == ["GPU1", "GPU2", "GPU3"]
    assert t.link_class("GPU1", "GPU2") == "NV2"
    assert t.link_class("GPU1", "GPU3") == "PHB" and t.link_class("GPU2", "GPU3") == "PHB"
    assert any("GPU0 cannot be opened" in w for w in t.warnings)
    assert [binding_for(r, 3, t).gpu for r in range(3)] == [1, 2, 3]

"""Topology model, fixtures, the nvidia-smi matrix, JSON round trip and affinity (no GPU)."""
from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import linkwise.topo as topo_mod
from linkwise.topo import (Topology, discover, fixture, fixture_names, format_cpulist,
                           parse_cpulist, render_matrix)
from linkwise.netif import select_interface
from linkwise.topo.affinity import Binding, binding_for
from linkwise.topo.model import Link, Nic, NumaNode, Socket
from linkwise.topo.sysfs import classify_pcie

# Seed 000 (DGX-1), `nvidia-smi topo -m`, copied cell for cell.
SEED_000_MATRIX = """\
GPU0 GPU1 GPU2 GPU3 GPU4 GPU5 GPU6 GPU7 ib0 ib1 ib2 ib3
GPU0 X NV1 NV1 NV2 NV2 SYS SYS SYS PIX SYS PHB SYS
GPU1 NV1 X NV2 NV1 SYS NV2 SYS SYS PIX SYS PHB SYS
GPU2 NV1 NV2 X NV2 SYS SYS NV1 SYS PHB SYS PIX SYS
GPU3 NV2 NV1 NV2 X SYS SYS SYS NV1 PHB SYS PIX SYS
GPU4 NV2 SYS SYS SYS X NV1 NV1 NV2 SYS PIX SYS PHB
GPU5 SYS NV2 SYS SYS NV1 X NV2 NV1 SYS PIX SYS PHB
GPU6 SYS SYS NV1 SYS NV1 NV2 X NV2 SYS PHB SYS PIX
GPU7 SYS SYS SYS NV1 NV2 NV1 NV2 X SYS PHB SYS PIX
ib0 PIX PIX PHB PHB SYS SYS SYS SYS X SYS PHB SYS
ib1 SYS SYS SYS SYS PIX PIX PHB PHB SYS X SYS PHB
ib2 PHB PHB PIX PIX SYS SYS SYS SYS PHB SYS X SYS
ib3 SYS SYS SYS SYS PHB PHB PIX PIX SYS PHB SYS X"""
SEED_000_AFFINITY = {f"GPU{i}": "0-19,40-59" if i < 4 else "20-39,60-79" for i in range(8)}


def test_discover_gives_cpu_topology():
    t = discover()
    assert t.numa_nodes and t.sockets
    assert t.cpus and set(t.cpus_allowed) <= set(t.cpus) | set(t.cpus_allowed)
    assert set(os.sched_getaffinity(0)) == set(t.cpus_allowed)
    assert all(isinstance(w, str) for w in t.warnings)
    assert Topology.from_json(t.to_json()) == t


def test_fixture_names_and_shapes():
    assert {"dgx1", "epyc-a100-pcie", "hgx-h200-4"} <= set(fixture_names())
    dgx = fixture("dgx1")
    assert len(dgx.gpus) == 8 and len(dgx.sockets) == 2 and len(dgx.numa_nodes) == 2
    assert [n.name for n in dgx.real_nics()] == ["ib0", "ib1", "ib2", "ib3"]
    assert all(n.kind == "infiniband" for n in dgx.real_nics())
    # hybrid cube-mesh: every GPU has NVLinks to exactly 4 others, 6 links in all
    for g in range(8):
        peers = [h for h in range(8) if h != g and dgx.nvlink_count(g, h)]
        assert len(peers) == 4
        assert sum(dgx.nvlink_count(g, h) for h in peers) == 6

    epyc = fixture("epyc-a100-pcie")
    assert len(epyc.gpus) == 8 and len(epyc.sockets) == 2
    assert all(epyc.nvlink_count(i, j) == 0 for i in range(8) for j in range(8))
    assert epyc.link_class("GPU5", "GPU6") == "PHB"
    assert epyc.link_class("GPU4", "GPU5") == "NODE"
    assert epyc.link_class("GPU0", "GPU7") == "SYS"
    [ib] = epyc.real_nics()
    assert ib.speed_mbps == 200_000 and ib.numa_node == 1
    assert sum(1 for g in epyc.gpus if g.numa_node != ib.numa_node) >= 4

    hgx = fixture("hgx-h200-4")
    assert len(hgx.gpus) == 4 and all("H200" in g.name for g in hgx.gpus)
    assert all(hgx.link_class(f"GPU{i}", f"GPU{j}") == "NV18"
               for i in range(4) for j in range(4) if i != j)
    assert [n.name for n in hgx.real_nics()] == ["eth0"]


def test_unknown_fixture_raises_keyerror():
    with pytest.raises(KeyError):
        fixture("no-such-machine")


def _rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in text.splitlines()[1:] if line.strip()}


def test_dgx1_matrix_matches_seed_000_cell_for_cell():
    out = render_matrix(fixture("dgx1"))
    lines = out.splitlines()
    expected_head = SEED_000_MATRIX.splitlines()[0].split()
    assert lines[0].split()[: len(expected_head)] == expected_head
    expected = _rows(SEED_000_MATRIX)
    got = {line.split()[0]: line.split() for line in lines[1:13]}
    assert set(got) == set(expected)
    for name, row in expected.items():
        assert got[name][: len(row)] == row, name
        if name in SEED_000_AFFINITY:   # then CPU affinity and NUMA affinity
            assert got[name][len(row)] == SEED_000_AFFINITY[name]
            assert got[name][len(row) + 1] == ("0" if int(name[3:]) < 4 else "1")
    assert "Legend:" in out


def test_fixture_classes_agree_with_seed_for_every_pair():
    t = fixture("dgx1")
    names = SEED_000_MATRIX.splitlines()[0].split()
    for row in SEED_000_MATRIX.splitlines()[1:]:
        a, *cells = row.split()
        for b, cell in zip(names, cells):
            assert t.link_class(a, b) == cell


@pytest.mark.parametrize("name", ["dgx1", "epyc-a100-pcie", "hgx-h200-4"])
def test_json_round_trip_exact(name, tmp_path):
    t = fixture(name)
    text = t.to_json()
    back = Topology.from_json(text)
    assert back == t
    assert back.to_json() == text
    path = tmp_path / "t.json"
    t.save(str(path))
    assert Topology.load(str(path)) == t


_cls = st.sampled_from(["PIX", "PXB", "PHB", "NODE", "SYS"])


@settings(max_examples=50, deadline=None)
@given(ncpus=st.integers(1, 16), speeds=st.lists(st.one_of(st.none(), st.integers(1, 10**6)),
                                                 max_size=3),
       classes=st.lists(_cls, min_size=3, max_size=3), nv=st.integers(0, 18))
def test_json_round_trip_random(ncpus, speeds, classes, nv):
    cpus = list(range(ncpus))
    t = Topology(hostname="h", sockets=[Socket(0, cpus, [0])], numa_nodes=[NumaNode(0, cpus)],
                 cpus_allowed=cpus,
                 nics=[Nic(name=f"eth{i}", kind="ethernet", speed_mbps=s)
                       for i, s in enumerate(speeds)],
                 links=[Link("a", "b", c, nv) for c in classes], warnings=["w"])
    assert Topology.from_json(t.to_json()) == t
    assert Topology.from_json(t.to_json(indent=None)).to_json(indent=None) == t.to_json(None)


def test_from_json_rejects_other_formats():
    with pytest.raises(ValueError):
        Topology.from_json('{"format": "something-else"}')


def test_dgx1_binding_matches_seed_000():
    t = fixture("dgx1")
    low = parse_cpulist("0-19,40-59")
    high = parse_cpulist("20-39,60-79")
    for r in range(8):
        b = binding_for(r, 8, t)
        assert b.gpu == r
        assert b.cpus == (low if r < 4 else high)
    assert [binding_for(r, 8, t).nic for r in range(8)] == \
        ["ib0", "ib0", "ib2", "ib2", "ib1", "ib1", "ib3", "ib3"]


def test_ranks_sharing_a_gpu_split_its_cores():
    t = fixture("hgx-h200-4")
    bs = [binding_for(r, 8, t) for r in range(8)]
    assert [b.gpu for b in bs] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert bs[0].cpus == list(range(32)) and bs[4].cpus == list(range(32, 64))
    assert not set(bs[0].cpus) & set(bs[4].cpus)
    assert all(b.nic == "eth0" for b in bs)


def test_no_gpu_binding_gives_disjoint_slices():
    cpus = list(range(10))
    t = Topology(sockets=[Socket(0, cpus, [0])], numa_nodes=[NumaNode(0, cpus, 0)],
                 cpus_allowed=cpus)
    bs = [binding_for(r, 3, t) for r in range(3)]
    assert all(b.gpu is None and b.nic is None for b in bs)
    assert sorted(c for b in bs for c in b.cpus) == cpus
    assert all(b.cpus for b in bs)
    # more ranks than cores: one core each, reused round-robin
    assert binding_for(11, 12, t) == Binding(gpu=None, cpus=[1], nic=None)
    with pytest.raises(ValueError):
        binding_for(3, 3, t)


def test_topo_file_env_is_used(tmp_path, monkeypatch):
    path = tmp_path / "saved.json"
    fixture("epyc-a100-pcie").save(str(path))
    monkeypatch.setenv("LINKWISE_TOPO_FILE", str(path))
    got = topo_mod.load_or_discover(refresh=True)
    assert got.source == f"file:{path}"
    assert dataclasses.replace(got, source="") == dataclasses.replace(fixture("epyc-a100-pcie"), source="")
    assert binding_for(5, 8).gpu == 5       # binding_for(topology=None) follows the file
    monkeypatch.delenv("LINKWISE_TOPO_FILE")
    assert topo_mod.load_or_discover(refresh=True).source == "discovered"


def test_bind_applies_affinity_and_env(monkeypatch):
    from linkwise.topo.affinity import bind
    before = os.sched_getaffinity(0)
    monkeypatch.delenv("LINKWISE_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("LINKWISE_DEVICE", raising=False)
    cpus = sorted(before)
    here = select_interface().name  # an interface that is up with an IPv4 address
    nic = Nic(name=here, kind="ethernet", netdev=here, numa_node=0)
    t = Topology(sockets=[Socket(0, cpus, [0])], numa_nodes=[NumaNode(0, cpus, 0)],
                 cpus_allowed=cpus, nics=[nic])
    # A faster NIC whose interface has no address here (a bond's member port): chosen as the
    # binding's NIC, but TCP could not use it, so the default selection is left to choose.
    bonded = Topology(sockets=t.sockets, numa_nodes=t.numa_nodes, cpus_allowed=cpus,
                      nics=[nic, Nic(name="bondslave9", kind="ethernet", netdev="bondslave9",
                                     numa_node=0, speed_mbps=100000)])
    try:
        b = bind(0, 1, topology=bonded)
        assert b.nic == "bondslave9" and "LINKWISE_SOCKET_IFNAME" not in os.environ
        b = bind(0, 1, topology=t)
        assert os.sched_getaffinity(0) == set(b.cpus)
        assert os.environ["LINKWISE_SOCKET_IFNAME"] == "=" + here
        assert "LINKWISE_DEVICE" not in os.environ      # no GPU
        dgx = fixture("dgx1")                            # its CPUs 0-79 mostly absent here
        b = bind(2, 8, topology=dgx)
        assert b.gpu == 2 and os.environ["LINKWISE_DEVICE"] == "2"
        assert os.environ["LINKWISE_SOCKET_IFNAME"] == "=" + here   # user's/earlier value kept
    finally:
        os.sched_setaffinity(0, before)
        os.environ.pop("LINKWISE_SOCKET_IFNAME", None)
        os.environ.pop("LINKWISE_DEVICE", None)


def test_classify_pcie():
    sw = ["pci0000:00", "0000:00:01.0", "0000:01:00.0"]
    a = sw + ["0000:02:08.0", "0000:03:00.0"]
    b = sw + ["0000:02:10.0", "0000:04:00.0"]
    deep = sw + ["0000:02:10.0", "0000:04:00.0", "0000:05:00.0", "0000:06:00.0"]
    other_port = ["pci0000:00", "0000:00:02.0", "0000:07:00.0"]
    other_hb = ["pci0000:80", "0000:80:01.0", "0000:81:00.0"]
    assert classify_pcie(a, b, 0, 0) == "PIX"
    assert classify_pcie(a, deep, 0, 0) == "PXB"
    assert classify_pcie(a, other_port, 0, 0) == "PHB"
    assert classify_pcie(a, other_hb, 0, 0) == "NODE"
    assert classify_pcie(a, other_hb, 0, 1) == "SYS"
    assert classify_pcie([], other_hb, None, None) == "NODE"
    assert classify_pcie([], other_hb, 0, None) == "SYS"


def test_cpulist_round_trip():
    assert parse_cpulist("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]
    assert format_cpulist([8, 7, 5, 2, 1, 0]) == "0-2,5,7-8"
    assert parse_cpulist("") == [] and format_cpulist([]) == ""

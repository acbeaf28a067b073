"""CPU slices for ranks follow NUMA nodes and physical cores: Topology.cores read from
sysfs, kept in JSON (files without it still load), and used by binding_for."""
from __future__ import annotations

import json

from linkwise.topo import Topology, discover, fixture, format_cpulist
from linkwise.topo.affinity import binding_for
from linkwise.topo.model import NumaNode, Socket
from test_topo_sysfs import cpus, proc, write


def _ht_host(tmp_path, files: str = "thread_siblings_list"):
    """2 sockets x 2 cores x 2 threads, numbered as Linux does on Intel: socket 0 has CPUs
    0,1 (first threads) and 4,5 (their siblings), socket 1 has 2,3 and 6,7."""
    s, p = tmp_path / "sys", tmp_path / "proc"
    cpus(s, 8, {0: "0-1,4-5", 1: "2-3,6-7"}, sockets=[0, 0, 1, 1, 0, 0, 1, 1])
    proc(p, "0-7")
    for c in range(8):
        top = s / f"devices/system/cpu/cpu{c}/topology"
        if files == "thread_siblings_list":
            write(top / "thread_siblings_list", f"{c % 4},{c % 4 + 4}\n")
        else:
            write(top / "core_id", f"{c % 2}\n")
    return str(s), str(p)


def _slices(t: Topology, n: int) -> list[str]:
    return [format_cpulist(binding_for(r, n, t).cpus) for r in range(n)]


def test_sibling_lists_give_the_cores_and_slices_keep_to_nodes_and_cores(tmp_path):
    s, p = _ht_host(tmp_path)
    t = discover(s, p, use_nvml=False)
    assert t.cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _slices(t, 2) == ["0-1,4-5", "2-3,6-7"]          # one NUMA node each
    assert _slices(t, 4) == ["0,4", "1,5", "2,6", "3,7"]    # one whole core each
    assert _slices(t, 8) == [str(c) for c in (0, 4, 1, 5, 2, 6, 3, 7)]
    assert Topology.from_json(t.to_json()) == t


def test_core_ids_give_the_cores_without_sibling_lists(tmp_path):
    s, p = _ht_host(tmp_path, files="core_id")
    t = discover(s, p, use_nvml=False)
    assert t.cores == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_no_core_information_slices_by_node(tmp_path):
    s, p = tmp_path / "sys", tmp_path / "proc"
    cpus(s, 8, {0: "0-1,4-5", 1: "2-3,6-7"}, sockets=[0, 0, 1, 1, 0, 0, 1, 1])
    proc(p, "0-7")
    t = discover(str(s), str(p), use_nvml=False)
    assert t.cores == []
    assert _slices(t, 2) == ["0-1,4-5", "2-3,6-7"]


def test_dgx1_cpu_only_ranks_stay_on_one_socket_and_whole_cores():
    """The dgx1 numbering (0-19 socket 0, 20-39 socket 1, 40-79 their siblings): 2 ranks
    each spanned both sockets, and with 4 ranks two ranks shared every core."""
    t = fixture("dgx1")
    t.gpus, t.links = [], [ln for ln in t.links if not ln.a.startswith("GPU")]
    assert _slices(t, 2) == ["0-19,40-59", "20-39,60-79"]
    assert _slices(t, 4) == ["0-9,40-49", "10-19,50-59", "20-29,60-69", "30-39,70-79"]


def test_ranks_sharing_a_gpu_get_whole_cores():
    t = fixture("dgx1")
    bs = [binding_for(r, 16, t) for r in range(16)]
    assert (bs[0].gpu, bs[8].gpu) == (0, 0)
    assert format_cpulist(bs[0].cpus) == "0-9,40-49"
    assert format_cpulist(bs[8].cpus) == "10-19,50-59"


def test_a_file_without_cores_still_loads_and_slices_by_node():
    doc = json.loads(fixture("dgx1").to_json())
    del doc["cores"]                      # as written before the field existed
    t = Topology.from_dict(doc)
    assert t.cores == []
    t.gpus = []
    assert _slices(t, 2) == ["0-19,40-59", "20-39,60-79"]


def test_cpus_no_node_lists_come_last():
    t = Topology(sockets=[Socket(0, [0, 1, 2, 3])], numa_nodes=[NumaNode(1, [2, 3])],
                 cpus_allowed=[0, 1, 2, 3])
    assert _slices(t, 2) == ["2-3", "0-1"]

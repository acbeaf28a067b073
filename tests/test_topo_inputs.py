"""`linkwise topo` on odd input: files of the wrong shape, outputs that cannot be written, bad
probe arguments, a stdout reader that goes away; long CPU lists in the matrix; a saved
topology loaded back on the host (and CPU mask) it came from."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from linkwise import topo as topo_mod
from linkwise.topo import Topology, fixture
from linkwise.topo.probe import ProbeResult, render_probe
from linkwise.topo.render import render_matrix
from linkwise.topo.sysfs import read_nics
from test_topo_cli import run

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(topo_mod.__file__))))


@pytest.mark.parametrize("text", ["[1, 2]", "null", '{"gpus": 5}', '{"gpus": [{"name": "x"}]}',
                                  '{"nics": [7]}'])
def test_load_of_the_wrong_shape_is_one_line(tmp_path, capsys, text):
    path = tmp_path / "t.json"
    path.write_text(text)
    assert run(["--load", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("linkwise topo: not a linkwise topology") and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("doc, where", [
    ({"numa_nodes": [{"id": 0, "cpus": "0-3"}]}, "numa_nodes[0].cpus: an array expected"),
    ({"cpus_allowed": 5}, "cpus_allowed: an array expected"),
    ({"cpus_allowed": [0, "1"]}, "cpus_allowed[1]: an integer expected"),
    ({"links": [{"a": "GPU0", "b": "GPU1", "nvlinks": "2"}]}, "links[0].nvlinks: an integer"),
    ({"nics": [{"name": "x", "kind": "ethernet", "speed_mbps": True}]}, "nics[0].speed_mbps"),
    ({"gpus": [{"index": 0, "name": "x", "numa_node": 1.5}]}, "gpus[0].numa_node"),
    ({"gpus": [{"name": "x"}]}, "gpus[0].index: missing"),
    ({"hostname": None}, "hostname: a string expected"),
    ({"sockets": [[0, 1]]}, "sockets[0]: an object expected"),
])
def test_fields_of_the_wrong_type_are_one_line_naming_the_field(tmp_path, capsys, doc, where):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "linkwise-topology", **doc}))
    with pytest.raises(ValueError) as info:  # not TypeError
        Topology.from_dict({"format": "linkwise-topology", **doc})
    assert where in str(info.value)
    assert run(["--load", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"linkwise topo: not a linkwise topology: {path} ({where}" + err.split(where, 1)[1]
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("data, why", [(b"{}", 'no "format" key'), (b'{"gpus": []}', 'no "format"'),
                                       (b"", "invalid JSON"),
                                       (b'{"format": "linkwise-topology", "hostname": "\xff"}',
                                        "not UTF-8 text")])
def test_an_object_without_the_format_or_not_json_is_refused(tmp_path, capsys, data, why):
    path = tmp_path / "t.json"
    path.write_bytes(data)
    assert run(["--load", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"linkwise topo: not a linkwise topology: {path} (") and why in err, err
    assert len(err.splitlines()) == 1


def test_a_truncated_save_names_the_file(tmp_path, capsys):
    whole = fixture("dgx1").to_json()
    path = tmp_path / "cut.json"
    path.write_text(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=f"not a linkwise topology: {path} \\(invalid JSON: "):
        Topology.load(str(path))
    assert run(["--load", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and len(err.splitlines()) == 1


def test_empty_or_path_like_names_are_refused(capsys):
    for argv in (["--fixture", ""], ["--fixture", "../fixtures/dgx1"], ["--load", ""]):
        assert run(argv) == 2, argv
        assert capsys.readouterr().err.startswith("linkwise topo: "), argv


def test_save_that_fails_is_one_line(tmp_path, capsys):
    assert run(["--fixture", "dgx1", "--save", str(tmp_path / "no" / "such" / "dir.json")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"linkwise topo: --save {tmp_path / 'no' / 'such' / 'dir.json'}: No such file or directory")


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--iters", "-2"], ["--size", "-5"],
                                  ["--size", "0"], ["--size", "inf"], ["--size", "1e400"],
                                  ["--ranks", "100000"]])
def test_probe_and_ranks_arguments_are_checked(argv, capsys):
    try:
        code = run(["--fixture", "dgx1", *argv])
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    assert code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_json_with_ranks_has_the_bindings(capsys):
    assert run(["--fixture", "dgx1", "--json", "--ranks", "8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [b["gpu"] for b in doc["bindings"]] == list(range(8))
    assert doc["bindings"][0]["cpus"][:2] == [0, 1]


def test_long_cpu_affinity_keeps_the_numa_column_apart():
    t = fixture("dgx1")
    t.gpus[0].cpu_affinity = list(range(0, 20)) + list(range(40, 60)) + [100, 101]
    row = next(line for line in render_matrix(t, legend=False).splitlines() if line.startswith("GPU0"))
    tokens = row.split()
    assert tokens[-2:] == ["0-19,40-59,100-101", "0"], row


def test_loaded_on_its_own_host_uses_this_processes_cpus(tmp_path):
    t = fixture("epyc-a100-pcie")
    t.hostname = socket.gethostname()
    t.cpus_allowed = [t.cpus[0]]  # as a `taskset -c 0` process saved it
    path = tmp_path / "here.json"
    t.save(str(path))
    got = topo_mod.load(str(path))
    assert got.source == f"file:{path}"
    assert got.cpus_allowed == (sorted(set(t.cpus) & os.sched_getaffinity(0)) or t.cpus)
    other = fixture("epyc-a100-pcie")  # saved on another host: its own mask stays
    other.save(str(tmp_path / "there.json"))
    assert topo_mod.load(str(tmp_path / "there.json")).cpus_allowed == other.cpus_allowed


def test_probe_sizes_below_a_mib_are_labelled():
    r = ProbeResult(devices=["host", "GPU0"], size_bytes=1024, iters=1, latency_bytes=8, backend="torch",
                    bandwidth_gbs=[[None, 1.0], [1.0, None]], latency_us=[[None, 1.0], [1.0, None]])
    assert "1 KiB copies" in render_probe(r)


def test_files_in_the_net_directory_are_not_interfaces(tmp_path):
    net = tmp_path / "class" / "net"
    (net / "lo").mkdir(parents=True)
    (net / "lo" / "type").write_text("772\n")
    (net / "bonding_masters").write_text("bond0\n")
    names = [n.name for n in read_nics(str(tmp_path), [], [])]
    assert names == ["lo"]


@pytest.mark.parametrize("tool, first", [("topo --fixture dgx1", "host"), ("info --json", "{")])
def test_output_to_a_closed_pipe_is_quiet(tool, first):
    p = subprocess.run(f"{sys.executable} -m linkwise.cli {tool} | head -1", shell=True,
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=SRC))
    assert p.stdout.startswith(first) and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_ranks_of_this_machine_follow_cuda_visible_devices(tmp_path, monkeypatch, capsys):
    t = fixture("dgx1")
    path = tmp_path / "here.json"
    t.save(str(path))
    monkeypatch.setenv("LINKWISE_TOPO_FILE", str(path))  # stands for this machine's
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,2")
    topo_mod.load_or_discover(refresh=True)
    try:
        assert run(["--json", "--ranks", "2"]) == 0
        got = [(b["gpu"], b["device"]) for b in json.loads(capsys.readouterr().out)["bindings"]]
        assert got == [(6, 0), (2, 1)]
        assert run(["--fixture", "dgx1", "--json", "--ranks", "2"]) == 0  # a fixture is another machine
        got = [(b["gpu"], b["device"]) for b in json.loads(capsys.readouterr().out)["bindings"]]
        assert got == [(0, 0), (1, 1)]
    finally:
        monkeypatch.delenv("LINKWISE_TOPO_FILE")
        topo_mod.load_or_discover(refresh=True)


def test_cuda_visible_devices_picks_and_numbers_the_gpus():
    from linkwise.topo.affinity import binding_for, visible_gpus
    t = fixture("dgx1")  # 8 GPUs
    assert visible_gpus(t, {}) is None
    assert visible_gpus(t, {"CUDA_VISIBLE_DEVICES": "6,2"}) == [6, 2]
    assert visible_gpus(t, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus(t, {"CUDA_VISIBLE_DEVICES": "3,99,1"}) == [3]  # CUDA stops at a bad entry
    assert visible_gpus(t, {"CUDA_VISIBLE_DEVICES": "MIG-abc"}) is None
    t.gpus[5].uuid = "GPU-1234abcd-0000"
    assert visible_gpus(t, {"CUDA_VISIBLE_DEVICES": "GPU-1234"}) == [5]
    b = [binding_for(r, 2, t, visible=[6, 2]) for r in range(2)]
    # rank 0 gets GPU6 (CUDA ordinal 0) and GPU6's CPUs, not GPU0's
    assert [(x.gpu, x.device) for x in b] == [(6, 0), (2, 1)]
    assert set(b[0].cpus) <= set(t.gpu_cpus(6))
    assert set(b[1].cpus) <= set(t.gpu_cpus(2))
    none = binding_for(0, 1, t, visible=[])  # no GPU visible: placed as without GPUs
    assert none.gpu is None and none.device is None


def test_bind_uses_cuda_visible_devices_for_the_device(tmp_path, monkeypatch):
    from linkwise.topo.affinity import bind
    t = fixture("dgx1")
    t.hostname = "elsewhere"  # keeps its own CPUs when loaded
    path = tmp_path / "dgx1.json"
    t.save(str(path))
    monkeypatch.setenv("LINKWISE_TOPO_FILE", str(path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.delenv("LINKWISE_LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LINKWISE_DEVICE", raising=False)
    before = os.sched_getaffinity(0)
    topo_mod.load_or_discover(refresh=True)
    try:
        b = bind(1)  # local size: the 2 visible GPUs
        assert (b.gpu, b.device, os.environ["LINKWISE_DEVICE"]) == (5, 1, "1")
    finally:
        os.sched_setaffinity(0, before)
        os.environ.pop("LINKWISE_DEVICE", None)
        os.environ.pop("LINKWISE_SOCKET_IFNAME", None)
        monkeypatch.delenv("LINKWISE_TOPO_FILE")
        topo_mod.load_or_discover(refresh=True)


def test_binding_env_names_usable_interfaces_and_keeps_the_users(monkeypatch):
    """What bind() and `linkwise launch --bind auto` give a rank: the CUDA ordinal, and the
    NIC's interface when TCP can use it here; launch put an RDMA device's name (no interface)
    and a user's choice was overwritten before."""
    import linkwise.netif as netif
    from linkwise.topo.affinity import Binding, binding_env
    from linkwise.topo.model import Nic
    t = fixture("dgx1")
    t.nics = [Nic(name="eth3", kind="ethernet", netdev="eth3"), Nic(name="mlx5_0", kind="infiniband"),
              Nic(name="eth9", kind="ethernet", netdev="eth9")]
    monkeypatch.setattr(netif, "list_interfaces", lambda: [netif.Interface("eth3", "10.0.0.5", True),
                                                          netif.Interface("eth9", "", True)])
    monkeypatch.delenv("LINKWISE_SOCKET_IFNAME", raising=False)
    assert binding_env(Binding(gpu=6, nic="eth3", device=0), t) == {
        "LINKWISE_DEVICE": "0", "LINKWISE_SOCKET_IFNAME": "=eth3"}
    assert binding_env(Binding(gpu=None, nic="mlx5_0"), t) == {}   # no interface
    assert binding_env(Binding(gpu=None, nic="eth9"), t) == {}     # no IPv4 address (a bond member)
    monkeypatch.setenv("LINKWISE_SOCKET_IFNAME", "lo")
    assert binding_env(Binding(gpu=2, nic="eth3"), t) == {"LINKWISE_DEVICE": "2"}

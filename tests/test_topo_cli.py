"""`linkwise topo` through its add_arguments/run pair, and the probe's text and plot views."""
from __future__ import annotations

import argparse
import json

import pytest

from linkwise.topo import Topology, fixture
from linkwise.topo import cli
from linkwise.topo.probe import ProbeResult, no_probe_reason, plot_bandwidth, render_probe


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(argv))


def test_fixture_matrix_and_ranks(capsys):
    assert run(["--fixture", "dgx1", "--ranks", "8"]) == 0
    out = capsys.readouterr().out
    assert "GPU0  X     NV1   NV1   NV2   NV2   SYS   SYS   SYS   PIX   SYS   PHB   SYS" in out
    assert "Legend:" in out and "binding for 8 local rank(s)" in out
    assert "7     7     ib3       20-39,60-79" in out


def test_json_save_load(tmp_path, capsys):
    path = tmp_path / "epyc.json"
    assert run(["--fixture", "epyc-a100-pcie", "--json", "--save", str(path)]) == 0
    printed = Topology.from_dict(json.loads(capsys.readouterr().out))
    assert printed == fixture("epyc-a100-pcie") == Topology.load(str(path))
    assert run(["--load", str(path)]) == 0
    assert "GPU5  SYS   SYS   SYS   SYS   NODE  X     PHB" in capsys.readouterr().out


def test_bad_inputs_exit_2(tmp_path, capsys):
    assert run(["--fixture", "nope"]) == 2
    assert capsys.readouterr().err.startswith("linkwise topo: no topology fixture 'nope'")  # no KeyError quotes
    assert run(["--load", str(tmp_path / "missing.json")]) == 2
    assert "linkwise topo" in capsys.readouterr().err
    for bad in ("0", "-1"):
        assert run(["--fixture", "dgx1", "--ranks", bad]) == 2
        assert f"--ranks {bad}: need 1 to 4096 ranks" in capsys.readouterr().err


@pytest.mark.skipif(no_probe_reason() is None, reason="a GPU is present")
def test_probe_without_gpu_says_so(capsys):
    assert run(["--probe", "--plot", "never.png"]) == 0
    assert "nothing to probe" in capsys.readouterr().out
    assert run(["--probe", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["probe"] is None and "nothing to probe" in doc["reason"]
    Topology.from_dict(doc["topology"])


def _fake_result() -> ProbeResult:
    return ProbeResult(devices=["host", "GPU0", "GPU1"],
                       bandwidth_gbs=[[None, 50.0, 50.0], [55.0, None, 380.0],
                                      [55.0, 381.0, None]],
                       latency_us=[[None, 8.0, 8.0], [9.0, None, 12.0], [9.0, 12.0, None]],
                       size_bytes=256 << 20, iters=10, latency_bytes=8, backend="fake",
                       peer_access=[[True, True], [True, True]])


def test_probe_views(tmp_path):
    r = _fake_result()
    text = render_probe(r)
    assert "380.0" in text and "latency us" in text
    png = tmp_path / "bw.png"
    plot_bandwidth(r, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json.dumps(r.to_dict()))["devices"] == r.devices


class _Tensor:
    def __init__(self, nbytes, device):
        self.nbytes, self.device = nbytes, device

    def copy_(self, src, non_blocking=False):
        return self


def _fake_torch(physical: list[int], memory: int = 1 << 30):
    """Just enough torch.cuda for probe(): CUDA devices 0.. are the given physical GPUs;
    allocations larger than ``memory`` on a GPU raise torch.cuda.OutOfMemoryError."""
    import contextlib
    import types

    class OutOfMemoryError(RuntimeError):
        pass

    def empty(n, dtype=None, device=None, pin_memory=False):
        if device is not None and n > memory:
            raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n >> 30}.00 GiB\nmore")
        return _Tensor(n, device)

    class Event:
        def __init__(self, enable_timing=False): pass
        def record(self): pass
        def synchronize(self): pass
        def elapsed_time(self, end): return 1.0

    cuda = types.SimpleNamespace(
        is_available=lambda: bool(physical), device_count=lambda: len(physical),
        can_device_access_peer=lambda i, j: True, synchronize=lambda: None,
        device=lambda i: contextlib.nullcontext(), Event=Event, OutOfMemoryError=OutOfMemoryError)
    return types.SimpleNamespace(__version__="fake", uint8="uint8", empty=empty, cuda=cuda)


@pytest.fixture
def this_machine_is_dgx1(tmp_path, monkeypatch):
    import linkwise.topo as topo_mod
    path = tmp_path / "here.json"
    fixture("dgx1").save(str(path))
    monkeypatch.setenv("LINKWISE_TOPO_FILE", str(path))
    topo_mod.load_or_discover(refresh=True)
    yield
    monkeypatch.delenv("LINKWISE_TOPO_FILE")
    topo_mod.load_or_discover(refresh=True)


@pytest.mark.parametrize("visible, names", [("6,2", ["GPU6", "GPU2"]), (None, [f"GPU{i}" for i in range(8)]),
                                            ("MIG-abc", ["cuda0"])])
def test_probe_names_devices_as_the_matrix_does(this_machine_is_dgx1, monkeypatch, capsys, visible, names):
    """Under CUDA_VISIBLE_DEVICES=6,2 CUDA device 0 is GPU6 of the matrix: it was labelled GPU0."""
    import sys
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setitem(sys.modules, "torch", _fake_torch([0] * len(names)))
    assert run(["--probe", "--json", "--no-progress", "--iters", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["probe"]["devices"] == ["host", *names]


def test_probe_out_of_memory_is_one_line(this_machine_is_dgx1, monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "torch", _fake_torch([0, 1]))
    assert run(["--probe", "--no-progress", "--size", "100G"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("linkwise topo: --probe: cannot allocate two 100 GiB buffers")
    assert len(err.splitlines()) == 1 and "Traceback" not in err

"""linkwise bench: tiny sweeps through the real command, columns, JSON, checks, busbw factors,
and comparison systems that are missing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from linkwise.bench import collective, common, compare, report

import linkwise

# Where the linkwise under test was imported from (site-packages after `pip install .`, or a
# source tree with the built extension on PYTHONPATH): child processes must use the same one.
SRC = os.path.dirname(os.path.dirname(os.path.abspath(linkwise.__file__)))
TINY = ["-b", "8", "-e", "1024", "-f", "8", "-n", "2", "-w", "1", "--no-progress"]
HEADER = ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
          "time", "algbw", "busbw", "#wrong"]


def bench(*argv: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in [k for k in e if k.startswith("LINKWISE_") and k != "LINKWISE_TRANSPORT"]:
        del e[k]
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "linkwise.bench.cli", *argv], env=e,
                          capture_output=True, text=True, timeout=timeout)


def _available_collectives() -> list[str]:
    from linkwise.comm import Communicator
    return [c for c in common.COLLECTIVES if c == "sendrecv" or callable(getattr(Communicator, c, None))]


@pytest.mark.parametrize("coll,n,factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0),
    ("all_gather", 4, 0.75), ("reduce_scatter", 8, 0.875), ("all_to_all", 2, 0.5),
    ("broadcast", 8, 1.0), ("reduce", 5, 1.0), ("sendrecv", 3, 1.0)])
def test_busbw_factor(coll, n, factor):
    assert common.busbw_factor(coll, n) == pytest.approx(factor)


def test_busbw_factor_rejects_unknown():
    with pytest.raises(ValueError):
        common.busbw_factor("gather_all", 2)


def test_sweep_and_sizes():
    assert common.sweep(8, 1024, 8) == [8, 64, 512]
    assert common.sweep(1, 8, 2) == [1, 2, 4, 8]
    assert common.sweep(0, 3 << 20, 1, 1 << 20) == [0, 1 << 20, 2 << 20, 3 << 20]
    assert common.parse_size("64M") == 64 << 20 and common.parse_size("4KiB") == 4096


@pytest.mark.parametrize("coll", common.COLLECTIVES)
def test_reference_is_consistent(coll):
    """The expected results agree with a direct NumPy model for 3 ranks."""
    n, dtype, op = 3, np.dtype(np.float32), "sum"
    total, block = common.counts(coll, 96, 4, n)
    got = [collective.expected(coll, op, r, n, total, block, dtype, 1) for r in range(n)]
    if coll == "all_reduce":
        assert np.array_equal(got[0], got[2])
    if coll == "all_gather":
        assert got[0].size == total
    if coll in ("reduce_scatter",):
        assert got[1].size == block
    if coll == "reduce":
        assert got[0] is None and got[1] is not None


def test_p2p_tiny_sweep_json(tmp_path):
    out = tmp_path / "p2p.json"
    r = bench("p2p", "-b", "1", "-e", "4096", "-f", "16", "-n", "20", "-w", "2", "--no-progress",
              "--json", str(out))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln and not ln.startswith("#")]
    assert [int(ln.split()[0]) for ln in lines] == [1, 16, 256, 4096]
    assert "lat(us)" in r.stdout and "bibw(GB/s)" in r.stdout
    doc = json.loads(out.read_text())
    rows = doc["systems"]["linkwise"]["rows"]
    assert doc["test"] == "p2p" and len(rows) == 4
    assert all(row["latency_us"] > 0 and row["bw_GBps"] > 0 and row["bibw_GBps"] > 0 for row in rows)


def test_collectives_tiny_sweep(tmp_path):
    """Every collective the build has: nccl-tests' columns, JSON, -c 1 gives 0 wrong."""
    colls = _available_collectives()
    for coll in colls:
        out = tmp_path / f"{coll}.json"
        r = bench(coll, *TINY, "-c", "1", "--json", str(out))
        assert r.returncode == 0, f"{coll}: {r.stdout}\n{r.stderr}"
        header = next(ln for ln in r.stdout.splitlines() if "#wrong" in ln)
        assert header.lstrip("#").split() == HEADER
        doc = json.loads(out.read_text())
        rows = doc["systems"]["linkwise"]["rows"]
        assert rows, coll
        for row in rows:
            assert row["oop"]["wrong"] == 0, (coll, row)
            # Every collective has nccl-tests' in-place form (all_to_all: x is also out;
            # sendrecv: comm.sendrecv_replace).
            assert row["ip"]["wrong"] == 0 and row["ip"]["time_us"] > 0, (coll, row)
            assert row["oop"]["busbw"] == pytest.approx(
                row["oop"]["algbw"] * common.busbw_factor(coll, 2))
        assert "# Out of bounds values : 0 OK" in r.stdout


def test_missing_collective_is_not_available(monkeypatch):
    from linkwise.bench.backends import LinkwiseBackend

    class Bare:
        rank, size = 0, 2
    b = LinkwiseBackend(Bare())
    assert b.available("sendrecv") and not b.available("all_reduce")


def test_missing_system_is_skipped(monkeypatch, tmp_path):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("torch", "mpi4py") else real(name, *a))
    assert "not installed" in compare.missing("gloo")
    assert "not installed" in compare.missing("mpi")
    # Through the command: a Python where torch and mpi4py cannot be imported.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\nsys.modules['torch'] = None\nsys.modules['mpi4py'] = None\n")
    r = bench("sendrecv", *TINY, "--compare", "gloo,mpi",
              env={"PYTHONPATH": f"{shim}{os.pathsep}{SRC}"})
    assert r.returncode == 0, r.stderr
    assert "# gloo: skipped" in r.stdout and "# mpi: skipped" in r.stdout


def test_device_cuda_without_gpu_is_one_clear_error(monkeypatch, capsys):
    """No CUDA build or no visible GPU: one line and status 2, before any rank starts."""
    import importlib

    from linkwise.bench import cli
    gpu_comm = importlib.import_module("linkwise.cuda.gpu_comm")  # the package's gpu_comm is a function
    monkeypatch.setattr(gpu_comm, "unavailable_reason", lambda: "no CUDA device is visible")
    assert cli.main(["all_reduce", "--device", "cuda", "-N", "2", "-b", "8", "-e", "8"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "linkwise bench: --device cuda: no CUDA device is visible", err
    # the reason itself: this build and machine (CPU-only here) give a non-empty one
    monkeypatch.undo()
    reason = gpu_comm.unavailable_reason()
    assert reason == "" or "CUDA" in reason
    assert gpu_comm.available() == (reason == "")


def test_report_ratio_columns():
    row = {"size": 1024, "count": 256, "type": "float", "redop": "sum", "root": -1,
           "oop": {"time_us": 10.0, "algbw": 0.1024, "busbw": 0.1024, "wrong": 0}, "ip": {"na": "x"}}
    other = dict(row, oop={"time_us": 20.0, "algbw": 0.0512, "busbw": 0.0512, "wrong": 0})
    doc = {"test": "all_reduce", "nranks": 2, "systems": {
        "linkwise": {"status": "ok", "rows": [row]}, "mpi": {"status": "ok", "rows": [other]},
        "gloo": {"status": "skipped", "reason": "torch is not installed"}}}
    import io
    buf = io.StringIO()
    report.print_doc(doc, buf)
    text = buf.getvalue()
    assert "# gloo: skipped (torch is not installed)" in text
    data = [ln for ln in text.splitlines() if not ln.startswith("#")][0].split()
    assert float(data[-1]) == pytest.approx(2.0)
    assert "# linkwise: n/a where x" in text  # each n/a cell's reason, once


def test_report_says_why_cells_are_na():
    cell = {"time_us": 10.0, "algbw": 0.1, "busbw": 0.1, "wrong": 0}
    rows = [{"size": s, "count": s, "type": "bfloat16", "redop": "sum", "root": -1, "oop": cell, "ip": cell}
            for s in (8, 16)]
    mpi_rows = [dict(r, oop={"na": "MPI has no bfloat16"}, ip={"na": "MPI has no bfloat16"}) for r in rows]
    doc = {"test": "all_reduce", "nranks": 2, "systems": {
        "linkwise": {"status": "ok", "rows": rows}, "mpi": {"status": "ok", "rows": mpi_rows}}}
    import io
    buf = io.StringIO()
    report.print_doc(doc, buf)
    lines = buf.getvalue().splitlines()
    assert lines.count("# mpi: n/a where MPI has no bfloat16") == 1, lines
    assert not any(ln.startswith("# linkwise: n/a") for ln in lines), lines


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_mpirun_is_not_started_inside_the_ranks_binding(monkeypatch):
    """A bound rank (linkwise launch --bind cpu) starts mpirun on the launcher's CPUs, so the
    MPI side of --compare is not squeezed onto that rank's cores; its own mask comes back.
    Unbound (no LINKWISE_LAUNCH_CPUS), mpirun keeps the process's mask, an outer taskset's."""
    import threading
    from linkwise.bench import spawn
    allowed = os.sched_getaffinity(0)
    seen = {}

    def bound_rank():
        os.sched_setaffinity(0, {min(allowed)})
        with spawn._all_cpus():
            seen["inside"] = os.sched_getaffinity(0)
            seen["cmd"] = compare.mpirun_command(len(allowed))
        seen["after"] = os.sched_getaffinity(0)

    def run():
        t = threading.Thread(target=bound_rank)
        t.start()
        t.join()

    monkeypatch.setenv("LINKWISE_LAUNCH_CPUS", ",".join(map(str, sorted(allowed))))
    run()
    assert seen["inside"] == allowed
    assert "--oversubscribe" not in seen["cmd"]
    assert seen["after"] == {min(allowed)}
    monkeypatch.delenv("LINKWISE_LAUNCH_CPUS")
    run()
    assert seen["inside"] == seen["after"] == {min(allowed)}
    monkeypatch.setenv("LINKWISE_LAUNCH_CPUS", "0,x")
    with pytest.raises(ValueError, match="LINKWISE_LAUNCH_CPUS"):
        spawn._all_cpus()


def test_machine_line_names_the_machines_cores(monkeypatch):
    """The header describes the machine, and says so when the rank is bound to fewer cores."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert "(64 cores)" in report.machine()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7}, raising=False)
    assert "(64 cores, this rank on 4)" in report.machine()


def _data_rows(stdout: str) -> list[list[str]]:
    return [ln.split() for ln in stdout.splitlines() if ln.strip() and not ln.startswith("#")]


@pytest.mark.skipif(compare.missing("gloo") is not None, reason="needs torch (gloo)")
def test_gloo_types_it_lacks_are_na(tmp_path):
    """Gloo has no uint32 / uint64 ("Invalid scalar type" from every rank): n/a cells, like an
    op it lacks, and the rest of the table still prints."""
    out = tmp_path / "gloo.json"
    r = bench("all_reduce", "-b", "8", "-e", "8", "-n", "2", "-w", "1", "--no-progress",
              "-d", "int32,uint32,uint64", "--compare", "gloo", "--json", str(out), timeout=120)
    assert r.returncode == 0, r.stderr
    assert [row[2] for row in _data_rows(r.stdout)] == ["int32", "uint32", "uint64"]
    rows = {row["type"]: row for row in json.loads(out.read_text())["systems"]["gloo"]["rows"]}
    assert "time_us" in rows["int32"]["ip"]
    for t in ("uint32", "uint64"):
        assert "gloo has no" in rows[t]["oop"]["na"] and "gloo has no" in rows[t]["ip"]["na"]


@pytest.mark.parametrize("argv,flag", [
    (["-b", "1K", "-e", "8"], "-e 8"), (["-N", "0"], "-N 0"), (["-N", "-1"], "-N -1"),
    (["-n", "0"], "-n 0"), (["-n", "-1"], "-n -1"), (["-w", "-1"], "-w -1"),
    (["--json", "{missing}/x.json"], "--json"), (["--plot", "{missing}/x.png"], "--plot"),
    (["-r", "2"], "-r 2"), (["-N", "3", "-r", "-1"], "-r -1")])
def test_bad_arguments_are_one_clear_error(argv, flag, tmp_path):
    """Like -r out of range: one line and status 2 before any rank starts, no sweep.
    (broadcast: -r is checked only for the collectives with a root.)"""
    argv = [a.format(missing=tmp_path / "no" / "dir") for a in argv]
    r = bench("broadcast", "-b", "8", "-e", "8", "-n", "2", "-w", "1", "--no-progress",
              "--timeout", "30", *argv)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"linkwise bench: {flag}"), r.stderr


def _launched_bench(n: int, *argv: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", str(n), "-m",
                           "linkwise.bench.cli", *argv], env=e, capture_output=True, text=True, timeout=120)


def test_root_is_checked_against_the_launched_job():
    """Under a launcher -r is a rank of the job."""
    r = _launched_bench(3, "broadcast", "-b", "8", "-e", "64", "-n", "2", "-w", "1", "-c", "1",
                        "-r", "2", "--no-progress")
    assert r.returncode == 0, (r.stdout, r.stderr)
    rows = [ln.split()[2:] for ln in r.stdout.splitlines() if ln.startswith("[rank 0]") and ln.split()[2].isdigit()]
    assert rows and all(row[4] == "2" and row[8] == "0" for row in rows), r.stdout
    r = _launched_bench(2, "reduce", "-b", "8", "-e", "8", "-r", "5", "--no-progress")
    assert r.returncode != 0
    assert "linkwise bench: -r 5 is not a rank of 2" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_sizes_that_round_to_the_same_count_give_one_row():
    """-b 0: sizes 0, 1 and 2 are all 0 floats; one row for them."""
    r = bench("all_reduce", "-b", "0", "-e", "8", "-n", "2", "-w", "1", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert [int(row[0]) for row in _data_rows(r.stdout)] == [0, 4, 8]

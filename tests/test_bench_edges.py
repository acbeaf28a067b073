"""linkwise bench at the edges of its job: a comparison launch that fails, one rank, a launcher
of one rank, and a job whose ranks say they are on several hosts."""
from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys

import pytest

from linkwise.bench import compare, report
from test_bench import SRC, _data_rows, _launched_bench, bench
from test_bench_flags import FAST, HAVE_MPL


@pytest.fixture
def failing_mpirun(tmp_path):
    """PATH and PYTHONPATH where mpi4py imports (an empty package) and mpirun exits with 3."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site"
    bin_dir.mkdir()
    (site / "mpi4py").mkdir(parents=True)
    (site / "mpi4py" / "__init__.py").write_text("")
    fake = bin_dir / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun: cannot start (a test stand-in)' >&2\nexit 3\n")
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": f"{site}{os.pathsep}{SRC}"}


def test_a_failed_mpi_launch_keeps_linkwise_results(failing_mpirun, tmp_path):
    """Before, the finished sweep was dropped: only "mpirun exited with status 3" was printed,
    and no --json was written."""
    out = tmp_path / "r.json"
    r = bench("all_reduce", "-b", "8", "-e", "64", "-f", "8", *FAST, "--compare", "mpi",
              "--reps", "2", "--json", str(out), env=failing_mpirun)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "# mpi: failed (mpirun exited with status 3)" in r.stdout, r.stdout
    assert [row[0] for row in _data_rows(r.stdout)] == ["8", "64"], r.stdout
    assert "cannot start (a test stand-in)" in r.stderr and "Traceback" not in r.stderr, r.stderr
    doc = json.loads(out.read_text())
    assert doc["systems"]["mpi"] == {"status": "failed", "reason": "mpirun exited with status 3"}
    assert len(doc["systems"]["linkwise"]["runs"]) == 2  # both repetitions of linkwise's sweep


@pytest.mark.parametrize("how", ["launcher", "one rank"])
def test_a_failed_mpi_launch_is_no_traceback(how, failing_mpirun):
    """Under a launcher, and at -N 1 (run in place), the LaunchError was uncaught."""
    argv = ["all_reduce", "-b", "8", "-e", "8", *FAST, "--compare", "mpi"]
    if how == "launcher":
        e = dict(os.environ, **failing_mpirun)
        r = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", "-m",
                            "linkwise.bench.cli", *argv], env=e, capture_output=True, text=True, timeout=120)
    else:
        r = bench(*argv, "-N", "1", env=failing_mpirun)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "mpi: failed (mpirun exited with status 3)" in r.stdout, r.stdout


def test_ratio_at_one_rank_is_the_time_ratio():
    """busbw is 0 at one rank (nccl-tests' factor), but the times compare: lw/x was n/a."""
    cell = {"time_us": 10.0, "algbw": 0.8, "busbw": 0.0, "wrong": 0}
    row = {"size": 8, "count": 2, "type": "float", "redop": "sum", "root": -1, "oop": cell, "ip": cell}
    theirs = dict(row, oop=dict(cell, time_us=25.0), ip=dict(cell, time_us=25.0))
    doc = {"test": "all_reduce", "nranks": 1, "systems": {
        "linkwise": {"status": "ok", "rows": [row]}, "mpi": {"status": "ok", "rows": [theirs]}}}
    buf = io.StringIO()
    report.print_doc(doc, buf)
    assert float(_data_rows(buf.getvalue())[0][-1]) == pytest.approx(2.5), buf.getvalue()


@pytest.mark.skipif(not HAVE_MPL, reason="needs matplotlib")
def test_plot_at_one_rank_has_the_times(tmp_path):
    """Every busbw is 0 at one rank: the plot was not written ("no measured point")."""
    png = tmp_path / "n1.png"
    r = bench("all_reduce", "-N", "1", "-b", "8", "-e", "1K", "-f", "4", *FAST, "--plot", str(png),
              env={"PYTHONWARNINGS": "error::UserWarning"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    lines = report._plot_lines({"test": "all_reduce", "nranks": 1, "systems": {"linkwise": {
        "status": "ok", "rows": [{"size": 8, "oop": {"time_us": 3.0, "busbw": 0.0}}]}}})
    assert [(ax, ys) for ax, _, _, ys in lines] == [(1, [3.0])]


def test_a_launcher_of_one_rank_runs_one_rank():
    """Started by a launcher with one rank, bench ran -N's default 2 ranks of its own."""
    r = _launched_bench(1, "all_reduce", "-b", "8", "-e", "8", "-n", "2", "-w", "1", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "all_reduce: 1 ranks" in r.stdout, r.stdout
    # -N asking for more under it: bench starts them itself, as outside a launcher
    r = _launched_bench(1, "all_reduce", "-N", "3", "-b", "8", "-e", "8", "-n", "2", "-w", "1", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "all_reduce: 3 ranks" in r.stdout, r.stdout


@pytest.mark.skipif(compare.missing("gloo") is not None, reason="needs torch (gloo)")
def test_a_job_on_several_hosts(tmp_path):
    """Two ranks started by hand, each saying it is alone on its host (local size 1): MPI is
    skipped (a second mpirun from rank 0 would put every rank on its host) rather than
    measured there, and Gloo still runs. (That Gloo's store is at the job's master address
    rather than loopback cannot show on one host: both reach rank 0 here.)"""
    from multirank import free_port
    out = tmp_path / "hosts.json"
    base = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                LINKWISE_SIZE="2", LINKWISE_LOCAL_RANK="0", LINKWISE_LOCAL_SIZE="1",
                LINKWISE_MASTER_ADDR="127.0.0.1", LINKWISE_MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-m", "linkwise.bench.cli", "all_reduce", "-b", "8",
                               "-e", "64", "-f", "8", *FAST, "--compare", "gloo,mpi", "--json", str(out)],
                              env=dict(base, LINKWISE_RANK=str(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    systems = json.loads(out.read_text())["systems"]
    assert systems["gloo"]["status"] == "ok" and len(systems["gloo"]["rows"]) == 2, systems["gloo"]
    if compare.missing("mpi") is None:
        assert systems["mpi"]["status"] == "skipped" and "several hosts" in systems["mpi"]["reason"]


def test_mpirun_args_are_split_as_a_shell_splits_them(monkeypatch):
    """Before, --mpirun-args was split on every space: a quoted argument holding one
    ("--mca btl_tcp_if_include 'eth0 eth1'") reached mpirun as two. The "how" line shows the
    arguments as run, quoted again; an unclosed quote is one line before any rank starts."""
    from linkwise.bench import spawn
    monkeypatch.setattr(compare, "find_mpirun", lambda: "/opt/mpi/bin/mpirun")
    extra = "--mca btl_tcp_if_include 'eth0 eth1' -x FOO=\"a b\""
    cmd = compare.mpirun_command(2, extra)
    assert cmd[-5:] == ["--mca", "btl_tcp_if_include", "eth0 eth1", "-x", "FOO=a b"], cmd
    how = spawn.mpi_how(2, extra)
    assert how.endswith("--mca btl_tcp_if_include 'eth0 eth1' -x 'FOO=a b'"), how
    assert how.startswith("second launch right after linkwise's: mpirun -n 2"), how
    r = bench("all_reduce", "-b", "8", "-e", "8", "-n", "2", "--no-progress", "--compare", "mpi",
              "--mpirun-args", "--mca btl 'self")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["linkwise bench: --mpirun-args \"--mca btl 'self\": No closing quotation"]


def test_mpi_how_is_the_command_without_the_benchmarks_own_forwarding(monkeypatch):
    """The "how" line is mpirun_command(forward=False): the command as run less the benchmark's
    own -x VAR pairs, and nothing else. It used to strip those pairs from the command as run,
    which also dropped the user's own "-x PYTHONPATH" from --mpirun-args."""
    from linkwise.bench import spawn
    monkeypatch.setattr(compare, "find_mpirun", lambda: "/opt/mpi/bin/mpirun")
    extra = "-x PYTHONPATH --bind-to none"
    run = compare.mpirun_command(2, extra)
    first = run.index("-x")  # the benchmark's own pairs come first, the user's after them
    own_pairs = [a for var in compare.FORWARDED for a in ("-x", var)]
    assert run[first:first + len(own_pairs)] == own_pairs and run[-4:] == extra.split(), run
    shown = compare.mpirun_command(2, extra, forward=False)
    assert shown == run[:first] + run[first + len(own_pairs):], (shown, run)
    how = spawn.mpi_how(2, extra)
    assert how == "second launch right after linkwise's: " + shlex.join(["mpirun"] + shown[1:]), how
    assert how.endswith(" -x PYTHONPATH --bind-to none"), how
    assert not {"LINKWISE_BENCH_ARGS", "LINKWISE_BENCH_SYSTEMS", "LINKWISE_BENCH_RESULT"} & set(how.split()), how


def test_nranks_other_than_the_launchers_is_refused():
    """Before, -N 3 under a launcher of 2 ranks was silently ignored: the table said 2 ranks.
    -N equal to the launcher's number runs."""
    r = _launched_bench(2, "all_reduce", "-N", "3", "-b", "8", "-e", "8", "-n", "2", "-w", "1", "--no-progress")
    assert r.returncode == 2, (r.stdout, r.stderr)
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "linkwise bench:" in ln]
    assert said == ["[rank 0] linkwise bench: -N 3: the launcher started 2 ranks, which run the sweep; "
                    "give -N 2 or leave -N out"], r.stdout + r.stderr
    assert "all_reduce:" not in r.stdout
    r = _launched_bench(2, "all_reduce", "-N", "2", "-b", "8", "-e", "8", "-n", "2", "-w", "1", "--no-progress")
    assert r.returncode == 0 and "all_reduce: 2 ranks" in r.stdout, (r.stdout, r.stderr)


def test_bench_checks_the_tunables_through_config_and_spawns_own_names(monkeypatch):
    """bench's own list of the variables it sets in its ranks (SPAWN_SETS) and its own loop over
    the tunables are gone: the names come from spawn (those it gives each rank), the check is
    config.first_invalid, which skips them by name (LINKWISE_MASTER_PORT, not _PORT_SPARE)."""
    from linkwise import config
    from linkwise.bench import cli, spawn
    assert set(spawn.RANK_VARIABLES) == {
        "LINKWISE_RANK", "LINKWISE_SIZE", "LINKWISE_LOCAL_RANK", "LINKWISE_LOCAL_SIZE",
        "LINKWISE_MASTER_ADDR", "LINKWISE_MASTER_PORT", "LINKWISE_JOB_ID"}
    for name in config.TUNABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LINKWISE_MASTER_PORT", "x")  # launch_ranks sets its own
    assert config.first_invalid(("LINKWISE_",), spawn.RANK_VARIABLES) == ""
    cli._check_tunables("cpu", spawning=True)
    with pytest.raises(ValueError, match="LINKWISE_MASTER_PORT='x'"):
        cli._check_tunables("cpu", spawning=False)
    monkeypatch.setenv("LINKWISE_MASTER_PORT_SPARE", "y")
    with pytest.raises(ValueError, match="LINKWISE_MASTER_PORT_SPARE='y'"):
        cli._check_tunables("cpu", spawning=True)

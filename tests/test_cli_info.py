"""`linkwise info` (tables and --json) and the subcommand table of `linkwise`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import linkwise
from linkwise import cli, config

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("LINKWISE_", "OMPI_", "PMI_", "SLURM_")) or k in (
                "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k)
    return monkeypatch


def info_json(capsys) -> dict:
    assert cli.main(["info", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_info_json(clean_env, capsys):
    clean_env.setenv("LINKWISE_TIMEOUT", "12")
    clean_env.setenv("LINKWISE_TRANSPORT", "tcp")
    d = info_json(capsys)
    assert d["version"] == linkwise.__version__
    assert d["launcher"]["launcher"] == "none" and d["launcher"]["size"] == 1
    assert d["transport"] == "tcp"
    assert "name" in d["interface"] or "error" in d["interface"]
    tun = {t["name"]: t for t in d["tunables"]}
    assert set(tun) == set(config.TUNABLES)
    assert tun["LINKWISE_TIMEOUT"]["default"] == 300.0 and tun["LINKWISE_TIMEOUT"]["current"] == 12.0
    assert tun["LINKWISE_TRANSPORT"]["help"] == config.TUNABLES["LINKWISE_TRANSPORT"].help
    assert set(d["build"]) >= {"native", "cuda", "compiler"}


def test_info_reports_launcher(clean_env, capsys):
    for k, v in dict(LINKWISE_RANK=1, LINKWISE_SIZE=2, LINKWISE_LOCAL_RANK=1,
                     LINKWISE_LOCAL_SIZE=2, LINKWISE_MASTER_ADDR="127.0.0.1",
                     LINKWISE_MASTER_PORT=23000, LINKWISE_JOB_ID="feed").items():
        clean_env.setenv(k, str(v))
    d = info_json(capsys)
    assert d["launcher"] == dict(rank=1, size=2, local_rank=1, local_size=2,
                                 master_addr="127.0.0.1", master_port=23000,
                                 launcher="linkwise", job_id="feed", spare_ports=0,
                                 port_source="LINKWISE_MASTER_PORT")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "linkwise: rank 1 of 2" in out and "127.0.0.1:23000" in out


def test_info_survives_broken_parts(clean_env, capsys):
    clean_env.setitem(sys.modules, "linkwise._native", None)  # as if not built
    clean_env.delattr(linkwise, "_native", raising=False)
    clean_env.setenv("LINKWISE_RANK", "x")
    clean_env.setenv("LINKWISE_SIZE", "2")
    clean_env.setenv("LINKWISE_TIMEOUT", "soon")
    clean_env.setenv("LINKWISE_SOCKET_IFNAME", "=nosuchif0")
    d = info_json(capsys)
    assert d["build"]["native"] is False and "not built" in d["build"]["error"]
    assert "LINKWISE_RANK" in d["launcher"]["error"]
    assert "nosuchif0" in d["interface"]["error"]
    tun = {t["name"]: t for t in d["tunables"]}
    assert "soon" in tun["LINKWISE_TIMEOUT"]["current"]["error"]
    assert cli.main(["info"]) == 0  # the table renders the errors too
    out = capsys.readouterr().out
    assert "not built" in out and "LINKWISE_TIMEOUT" in out


def test_info_table(clean_env, capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("version", linkwise.__version__, "launcher", "transport", "interface"):
        assert word in out
    for name in config.TUNABLES:
        assert name in out


def test_info_table_with_markup_like_values(clean_env, capsys):
    """Values and errors holding '[' ... ']' are text, not rich markup: a MarkupError
    traceback before, and the transport's error showed its own [red] tags."""
    clean_env.setenv("LINKWISE_TIMEOUT", "[/x]")
    clean_env.setenv("LINKWISE_TRANSPORT", "bogus")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "[red]" not in out and "LINKWISE_TRANSPORT='bogus' is not valid" in out


def test_single_process_has_no_port_source(clean_env, capsys):
    assert info_json(capsys)["launcher"]["port_source"] == "none"


def test_build_from_native(clean_env, capsys):
    fake = types.ModuleType("linkwise._native")
    fake.build_info = lambda: {"cuda": True, "compiler": "testcc 1"}
    clean_env.setitem(sys.modules, "linkwise._native", fake)
    clean_env.setattr(linkwise, "_native", fake, raising=False)
    d = info_json(capsys)
    assert d["build"] == {"native": True, "cuda": True, "compiler": "testcc 1"}
    assert cli.main(["info"]) == 0
    assert "CUDA, testcc 1" in capsys.readouterr().out


def test_build_names_the_cuda_architectures(clean_env, capsys):
    fake = types.ModuleType("linkwise._native")
    fake.build_info = lambda: {"cuda": True, "cuda_archs": "80,90", "compiler": "testcc 1"}
    clean_env.setitem(sys.modules, "linkwise._native", fake)
    clean_env.setattr(linkwise, "_native", fake, raising=False)
    assert info_json(capsys)["build"]["cuda_archs"] == "80,90"
    assert cli.main(["info"]) == 0
    assert "CUDA (sm 80,90), testcc 1" in capsys.readouterr().out


def test_missing_subcommand_module(capsys, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "tune", ("linkwise.nosuchpkg.cli", "x"))
    assert cli.main(["tune", "--anything"]) == 2
    assert "linkwise tune: not in this version yet" in capsys.readouterr().err


def test_help_marks_missing_subcommands(capsys, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "tune", ("linkwise.nosuchpkg.cli", "pick things"))
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "pick things (not in this version yet)" in out
    assert "measure latency and bandwidth (" not in out  # bench is there


def test_dispatch_to_module(capsys, monkeypatch):
    mod = types.ModuleType("linkwise_fake_cli")
    mod.add_arguments = lambda p: p.add_argument("--size", type=int)
    mod.run = lambda args: args.size + 1
    monkeypatch.setitem(sys.modules, "linkwise_fake_cli", mod)
    monkeypatch.setitem(cli.COMMANDS, "bench", ("linkwise_fake_cli", "x"))
    assert cli.main(["bench", "--size", "6"]) == 7


def test_broken_dependency_is_not_hidden(monkeypatch, tmp_path):
    (tmp_path / "lw_broken_cli.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "plan", ("lw_broken_cli", "x"))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        cli.main(["plan"])


def test_usage(capsys):
    assert cli.main([]) == 2
    assert "launch" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["frobnicate"])
    assert e.value.code == 2


def test_command_line_entry():
    env = dict(os.environ, PYTHONPATH=SRC)
    p = subprocess.run([sys.executable, "-m", "linkwise.cli", "info", "--json"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["version"] == linkwise.__version__


def test_every_variable_the_code_reads_is_a_declared_tunable():
    """`linkwise info` lists config.TUNABLES as "every LINKWISE_* tunable": each variable the
    native code (std::getenv) or the Python package (config.get, os.environ) reads must be
    declared there."""
    import re
    from pathlib import Path

    from linkwise import config
    root = Path(__file__).resolve().parents[1]
    read = set()
    for path in list((root / "csrc").rglob("*.c*")) + list((root / "csrc").rglob("*.h")):
        read |= set(re.findall(r'getenv\("(LINKWISE_[A-Z0-9_]+)"\)', path.read_text()))
    for path in (root / "src" / "linkwise").rglob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r'(?:config\.get|environ\.get|getenv)\(\s*"(LINKWISE_[A-Z0-9_]+)"', text))
    assert len(read) > 20, read  # the scan found the code
    internal = {v for v in read if v.startswith("LINKWISE_BENCH_")}  # bench's own hand-off to its ranks
    assert sorted(read - internal - set(config.TUNABLES)) == []


def _with_stdout_reader_gone(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run `python -m linkwise.cli ARGV` writing to a pipe whose reader has gone (as `| head`
    once it has its lines)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "linkwise.cli", *argv], env=env,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)


def test_info_ends_quietly_when_stdout_goes_away():
    """Before, rich ended the process with status 1 (`linkwise info | head` under pipefail
    failed), where `linkwise topo` and bench end with 0."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(linkwise.__file__)))
    p = _with_stdout_reader_gone(["info"], dict(os.environ, PYTHONPATH=src))
    assert (p.returncode, p.stderr) == (0, "")


def test_bench_writes_its_json_when_stdout_goes_away(tmp_path):
    """Before, the BrokenPipeError was taken for a rank that could not start ("could not start
    the ranks: [Errno 32] Broken pipe", status 1) and the --json file was never written."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(linkwise.__file__)))
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LINKWISE_")}
    p = _with_stdout_reader_gone(["bench", "all_reduce", "-b", "8", "-e", "64", "-f", "8", "-n",
                                  "2", "-w", "1", "--no-progress", "--timeout", "60", "--json",
                                  str(out)], dict(env, PYTHONPATH=src))
    assert (p.returncode, p.stderr) == (0, "")
    rows = json.loads(out.read_text())["systems"]["linkwise"]["rows"]
    assert [r["size"] for r in rows] == [8, 64]

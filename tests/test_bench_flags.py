"""linkwise bench: flags checked up front, bitwise ops, nccl-tests' count column, rows of
0 elements, output files, the average busbw, and Gloo's rendezvous under torchrun."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from linkwise.bench import collective, common, compare, report
from test_bench import SRC, _data_rows, bench

FAST = ["-n", "2", "-w", "1", "--no-progress", "--timeout", "60"]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _one_error(r: subprocess.CompletedProcess, start: str) -> None:
    """Status 2, nothing on stdout (no sweep ran), one line on stderr starting with start."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("linkwise bench: " + start), r.stderr


def _rows(path) -> list[dict]:
    return json.loads(path.read_text())["systems"]["linkwise"]["rows"]


# -- 1. bitwise ops -------------------------------------------------------------------------
def test_bitwise_reference_and_op_lists():
    stack = np.array([[0b1100, 0b1010], [0b1010, 0b0110], [0b1001, 0b0011]], np.int32)
    dt = stack.dtype
    assert common.reduce_reference(stack, "band", dt).tolist() == [0b1000, 0b0010]
    assert common.reduce_reference(stack, "bor", dt).tolist() == [0b1111, 0b1111]
    assert common.reduce_reference(stack, "bxor", dt).tolist() == [0b1111, 0b1111]
    assert common.resolve_ops("band,bor,bxor") == ["band", "bor", "bxor"]
    assert common.resolve_ops("all") == ["sum", "prod", "max", "min", "avg"]  # nccl-tests' five
    assert common.point_na("all_reduce", "float", "band") and not common.point_na("all_reduce", "int8", "bor")
    assert common.point_na("all_gather", "float", "band") is None  # no reduction: -o ignored


def test_bitwise_ops_run_and_check(tmp_path):
    """Integer rows measured with 0 wrong; float rows of the same sweep n/a, with the reason."""
    out = tmp_path / "bw.json"
    r = bench("all_reduce", "-N", "3", "-b", "64", "-e", "64", *FAST, "-d", "int8,int32,float",
              "-o", "band,bor,bxor", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = _rows(out)
    assert [(x["type"], x["redop"]) for x in rows] == [
        (t, o) for t in ("int8", "int32", "float") for o in ("band", "bor", "bxor")]
    for row in rows:
        for var in ("oop", "ip"):
            if row["type"] == "float":
                assert row[var] == {"na": f"{row['redop']} is for integer types"}
            else:
                assert row[var]["wrong"] == 0 and row[var]["time_us"] > 0, row
    assert "# linkwise: n/a where band is for integer types" in r.stdout


@pytest.mark.parametrize("coll", ["reduce", "reduce_scatter"])
def test_bitwise_ops_other_reductions(coll):
    r = bench(coll, "-N", "3", "-b", "96", "-e", "96", *FAST, "-d", "uint8,int64", "-o", "bxor,band")
    assert r.returncode == 0, r.stderr
    rows = _data_rows(r.stdout)
    assert len(rows) == 4 and all(row[8] == "0" and row[12] == "0" for row in rows), r.stdout


@pytest.mark.parametrize("argv,start", [
    (["-o", "band"], "-o band: bitwise ops need an integer type"),
    (["-o", "bor,bxor", "-d", "half,double"], "-o bor,bxor: bitwise ops need an integer type"),
    (["-o", "band", "-d", "uint32,float"], "-o band: bitwise ops need an integer type"),
    (["-o", "nand"], "-o nand: unknown op 'nand'")])
def test_bitwise_op_without_integer_type_is_an_error(argv, start):
    _one_error(bench("all_reduce", "-b", "8", "-e", "8", *FAST, *argv), start)


@pytest.mark.parametrize("system", ["gloo", "mpi"])
def test_bitwise_ops_in_compared_systems(system, tmp_path):
    if compare.missing(system):
        pytest.skip(compare.missing(system))
    out = tmp_path / "cmp.json"
    r = bench("all_reduce", "-b", "16", "-e", "16", *FAST, "-d", "int32,float", "-o", "bor",
              "--compare", system, "--json", str(out), timeout=180)
    assert r.returncode == 0, r.stderr
    rows = {x["type"]: x for x in json.loads(out.read_text())["systems"][system]["rows"]}
    assert rows["int32"]["ip"]["wrong"] == 0 and rows["int32"]["ip"]["time_us"] > 0
    assert rows["float"]["ip"] == {"na": "bor is for integer types"}


# -- 2. Gloo's rendezvous never depends on TORCHELASTIC_USE_AGENT_STORE ---------------------
def _run_group(cmd: list[str], env: dict, timeout: float, tmp_path) -> subprocess.CompletedProcess:
    """Run cmd in its own process group; on timeout stop it and fail, so that a hang is a
    failure. Output goes to files, not pipes: a rank that outlives its parent (torchrun puts
    its workers in sessions of their own) cannot keep the test waiting for EOF. SIGTERM
    first, which torchrun passes on to its workers, then SIGKILL to the group."""
    out_f, err_f = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_f, "w") as out, open(err_f, "w") as err:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            pytest.fail(f"hung for {timeout} s:\n{out_f.read_text()}\n{err_f.read_text()[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out_f.read_text(), err_f.read_text())


def _gloo_measured(stdout: str) -> bool:
    rows = [ln.split() for ln in stdout.splitlines() if ln.split() and ln.split()[-1][:1].isdigit()
            and not ln.startswith("#")]
    return "gloo us" in stdout and len(rows) == 1 and rows[0][-3] != "n/a"


@pytest.mark.skipif(compare.missing("gloo") is not None, reason="needs torch (gloo)")
def test_gloo_ignores_agent_store_variable(tmp_path):
    """The variable torchrun sets made init_method='tcp://' a client on every rank: a hang."""
    e = dict(os.environ, PYTHONPATH=SRC, TORCHELASTIC_USE_AGENT_STORE="True")
    e = {k: v for k, v in e.items() if not k.startswith("LINKWISE_") or k == "LINKWISE_TRANSPORT"}
    r = _run_group([sys.executable, "-m", "linkwise.bench.cli", "all_reduce", "-b", "1K", "-e", "1K",
                    "-n", "3", "-w", "1", "--no-progress", "--compare", "gloo", "--timeout", "60"],
                   e, 120, tmp_path)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert _gloo_measured(r.stdout), r.stdout


@pytest.mark.skipif(compare.missing("gloo") is not None
                    or importlib.util.find_spec("torch.distributed.run") is None,
                    reason="needs torch with torch.distributed.run")
def test_compare_gloo_under_torchrun(tmp_path):
    e = {k: v for k, v in os.environ.items() if not k.startswith("LINKWISE_")}
    e["PYTHONPATH"] = SRC
    r = _run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    "2", "-m", "linkwise.cli", "bench", "all_reduce", "-b", "1K", "-e", "1K", "-n", "3",
                    "-w", "1", "--no-progress", "--compare", "gloo"], e, 150, tmp_path)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert _gloo_measured(r.stdout), r.stdout


# -- 3. count is nccl-tests' per-rank count for the per-rank-block collectives --------------
@pytest.mark.parametrize("coll,argv,size,count", [
    ("all_gather", ["-b", "64"], 60, 5), ("reduce_scatter", ["-b", "64"], 60, 5),
    ("all_to_all", ["-d", "int8", "-b", "20"], 18, 6), ("all_reduce", ["-b", "64"], 64, 16)])
def test_count_column_is_per_rank(coll, argv, size, count, tmp_path):
    out = tmp_path / "c.json"
    r = bench(coll, "-N", "3", "-e", argv[-1], *argv, *FAST, "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert [row[:2] for row in _data_rows(r.stdout)] == [[str(size), str(count)]], r.stdout
    (row,) = _rows(out)
    assert (row["size"], row["count"]) == (size, count) and row["oop"]["wrong"] == 0
    assert row["oop"]["algbw"] == pytest.approx(size / row["oop"]["time_us"] / 1e3)


# -- 4. sizes below one element per rank: a row of 0 elements, never an empty table ---------
@pytest.mark.parametrize("coll", ["all_gather", "reduce_scatter", "all_to_all"])
def test_too_small_size_is_a_zero_row(coll):
    r = bench(coll, "-N", "3", "-b", "7", "-e", "7", *FAST)
    assert r.returncode == 0, r.stderr
    assert [row[:2] + row[8:9] for row in _data_rows(r.stdout)] == [["0", "0", "0"]], r.stdout


def test_merged_sizes_are_named():
    r = bench("all_gather", "-N", "3", "-b", "1", "-e", "16", *FAST)
    assert r.returncode == 0, r.stderr
    assert [row[:2] for row in _data_rows(r.stdout)] == [["0", "0"], ["12", "1"]]
    assert "# size 0 float: also stands for the requested sizes 2, 4, 8 B" in r.stdout


# -- 5. --json and --plot checked before the sweep; write failures are one line -------------
def test_json_directory_is_refused(tmp_path):
    _one_error(bench("all_reduce", "-b", "8", "-e", "8", *FAST, "--json", str(tmp_path)),
               f"--json {tmp_path}: is a directory")


@pytest.mark.skipif(not HAVE_MPL, reason="needs matplotlib")
@pytest.mark.parametrize("name", ["p.txt", "p"])
def test_plot_format_is_checked_up_front(name, tmp_path):
    path = tmp_path / name
    _one_error(bench("all_reduce", "-b", "8", "-e", "8", *FAST, "--plot", str(path)),
               f"--plot {path}: matplotlib cannot write")


def test_plot_without_matplotlib_is_refused(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    r = bench("all_reduce", "-b", "8", "-e", "8", *FAST, "--plot", str(tmp_path / "p.png"),
              env={"PYTHONPATH": f"{shim}{os.pathsep}{SRC}"})
    _one_error(r, f"--plot {tmp_path / 'p.png'}: needs matplotlib")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_json_write_failure_is_one_line():
    r = bench("all_reduce", "-b", "8", "-e", "8", *FAST, "--json", "/dev/full")
    assert r.returncode == 1 and _data_rows(r.stdout), (r.stdout, r.stderr)
    assert r.stderr.strip() == "linkwise bench: --json /dev/full: No space left on device"


@pytest.mark.skipif(not HAVE_MPL, reason="needs matplotlib")
def test_plot_zero_rows_and_real_rows(tmp_path):
    """Only 0-byte rows: no file, one note, no matplotlib warning (UserWarnings are errors here)."""
    png = tmp_path / "p.png"
    r = bench("all_gather", "-N", "3", "-b", "7", "-e", "7", *FAST, "--plot", str(png),
              env={"PYTHONWARNINGS": "error::UserWarning"})
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == (f"linkwise bench: --plot {png} not written: no measured point "
                                "of more than 0 bytes to plot")
    assert not png.exists()
    r = bench("all_gather", "-N", "3", "-b", "7", "-e", "64", "-f", "8", *FAST, "--plot", str(png),
              env={"PYTHONWARNINGS": "error::UserWarning"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


# -- 6, 7. sizes, -f, -i, -w ----------------------------------------------------------------
@pytest.mark.parametrize("argv,start", [
    (["-b", "abc"], "-b abc: not a size (use e.g. 8, 64K, 1M, 2G)"),
    (["-e", "1T"], "-e 1T: not a size (use e.g. 8, 64K, 1M, 2G)"),
    (["-b", "-4"], "-b -4: not a size"), (["-i", "1.5X"], "-i 1.5X: not a size"),
    (["-f", "0.5"], "-f 0.5: the size factor must be at least 1"),
    (["-f", "0"], "-f 0: the size factor must be at least 1"),
    (["-f", "-2"], "-f -2: the size factor must be at least 1"),
    (["-f", "1", "-i", "0"], "-i 0: with -f 1 sizes grow by -i bytes"),
    (["-f", "1", "-i", "-1"], "-i -1: not a size")])
def test_bad_sizes_and_steps(argv, start):
    _one_error(bench("all_reduce", "-b", "8", "-e", "64", *FAST, *argv), start)


@pytest.mark.parametrize("nranks", ["1", "2"])
def test_sizes_beyond_memory_are_one_line_per_rank(nranks):
    """A size whose buffers cannot be allocated (here: under a 3 GiB address-space limit,
    which the ranks inherit) gives one line per rank naming -e, not a MemoryError traceback."""
    import resource
    limit = 3 << 30
    e = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "linkwise.bench.cli", "all_reduce", "-N", nranks, "-b", "2G", "-e", "2G",
                        *FAST], env=e, capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "not enough memory" in ln]
    assert lines and all("-e 2G" in ln for ln in lines), r.stderr
    assert "rank 0: not enough memory" in r.stderr


@pytest.mark.parametrize("argv,sizes", [
    (["-i", "1K"], [1024, 2048, 3072, 4096]),              # -i alone steps by bytes (nccl-tests)
    (["-f", "1", "-i", "1K"], [1024, 2048, 3072, 4096]),
    ([], [1024, 2048, 4096]),                               # default: doubling
    (["-f", "2", "-i", "1K"], [1024, 2048, 4096])])         # -f > 1 wins over -i
def test_step_by_factor_or_bytes(argv, sizes):
    r = bench("all_reduce", "-b", "1K", "-e", "4K", *FAST, *argv)
    assert r.returncode == 0, r.stderr
    assert [int(row[0]) for row in _data_rows(r.stdout)] == sizes


@pytest.mark.parametrize("argv,start", [
    (["--tests", "foo"], "--tests 'foo': expected one or more of latency,bw,bibw (unknown: foo)"),
    (["--tests", "latency,foo"], "--tests 'latency,foo': expected one or more of latency,bw,bibw"),
    (["--tests", ""], "--tests '': expected one or more of"),
    (["--window", "0"], "--window 0: need at least 1 message in flight"),
    (["--window", "-5"], "--window -5: need at least 1")])
def test_bad_p2p_tests_and_window(argv, start):
    _one_error(bench("p2p", "-b", "8", "-e", "8", *FAST, *argv), start)


def test_check_count_as_nccl_tests():
    """-c takes a count as nccl-tests does (test_bench_checks: what it runs); a negative one
    is an error."""
    r = bench("all_reduce", "-b", "64", "-e", "64", *FAST, "-c", "2")
    assert r.returncode == 0, r.stderr
    assert [row[8] for row in _data_rows(r.stdout)] == ["0"]  # #wrong, out of place: checked
    _one_error(bench("all_reduce", "-b", "8", "-e", "8", *FAST, "-c", "-1"), "-c -1: 0 (no checks) or at least 1")


def test_step_zero_is_fine_for_one_size():
    r = bench("all_reduce", "-b", "8", "-e", "8", *FAST, "-f", "1", "-i", "0")
    assert r.returncode == 0 and len(_data_rows(r.stdout)) == 1, r.stderr


class _Counting:
    """A one-rank backend counting how often the bound collective runs."""
    name, rank, size = "count", 0, 1

    def __init__(self):
        self.calls = 0

    def bind(self, *a):
        def fn():
            self.calls += 1
        return fn

    def barrier(self):
        pass

    def max_over_ranks(self, v):
        return v

    def sum_over_ranks(self, v):
        return v

    def result_view(self, coll, send, recv, inplace):
        return recv


@pytest.mark.parametrize("warmup,calls", [(0, 1 + 3), (1, 1 + 3), (4, 4 + 3)])
def test_warmup_counts_the_probing_call(warmup, calls):
    """-w N: N untimed calls in all, the probing first call included (-w 0 still makes it)."""
    b = _Counting()
    collective.run_sweep(b, "all_reduce", [64], ["float"], ["sum"], 0, 3, warmup, False)
    assert b.calls == 2 * calls  # out-of-place and in-place


# -- 8. -r only for the collectives with a root ---------------------------------------------
def test_root_ignored_without_a_root():
    r = bench("all_reduce", "-N", "2", "-r", "5", "-b", "8", "-e", "8", *FAST)
    assert r.returncode == 0 and _data_rows(r.stdout)[0][4] == "-1", r.stderr
    _one_error(bench("reduce", "-N", "2", "-r", "5", "-b", "8", "-e", "8", *FAST), "-r 5 is not a rank of 2")


# -- 9. the average busbw is over both variants, as in nccl-tests ---------------------------
def test_avg_busbw_over_both_variants():
    def cell(bw):
        return {"time_us": 1.0, "algbw": bw, "busbw": bw, "wrong": 0}
    rows = [{"size": 8, "count": 2, "type": "float", "redop": "sum", "root": -1, "oop": cell(1.0), "ip": cell(5.0)},
            {"size": 16, "count": 4, "type": "float", "redop": "sum", "root": -1, "oop": cell(3.0), "ip": {"na": "x"}}]
    buf = io.StringIO()
    report.print_doc({"test": "all_reduce", "nranks": 2, "systems": {"linkwise": {"status": "ok", "rows": rows}}}, buf)
    assert "# Avg bus bandwidth    : 3.0000\n" in buf.getvalue()  # (1 + 5 + 3) / 3; oop only: 2


# -- 10. types linkwise cannot reduce -------------------------------------------------------
@pytest.mark.parametrize("coll,types", [("all_reduce", "uint32"), ("reduce", "uint64"),
                                        ("reduce_scatter", "uint32,uint64")])
def test_unreducible_types_alone_are_an_error(coll, types):
    _one_error(bench(coll, "-b", "64", "-e", "64", *FAST, "-d", types),
               f"-d {types}: linkwise cannot reduce")


def test_unreducible_types_mixed_are_na_rows(tmp_path):
    out = tmp_path / "u.json"
    r = bench("all_reduce", "-b", "64", "-e", "64", *FAST, "-d", "int32,uint32", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = {x["type"]: x for x in _rows(out)}
    assert rows["int32"]["oop"]["wrong"] == 0
    assert rows["uint32"]["oop"] == rows["uint32"]["ip"] == {"na": "linkwise cannot reduce uint32"}
    r = bench("all_gather", "-b", "64", "-e", "64", *FAST, "-d", "uint64")  # moved, not reduced
    assert r.returncode == 0 and _data_rows(r.stdout)[0][8] == "0", r.stderr


def test_rows_in_nccl_tests_order():
    """The whole size sweep for each type, then each op (nccl-tests' loops), not size-major."""
    r = bench("all_reduce", "-b", "8", "-e", "16", "-d", "int32,float", "-o", "sum,max", *FAST)
    assert r.returncode == 0, r.stderr
    got = [(row[2], row[3], int(row[0])) for row in _data_rows(r.stdout)]
    assert got == [(t, o, s) for t in ("int32", "float") for o in ("sum", "max") for s in (8, 16)]


# -- 10. --timeout, --reps and LINKWISE_* values checked before any rank starts ---------------
@pytest.mark.parametrize("argv,start", [
    (["--timeout", "0"], "--timeout 0: give seconds, a positive finite number"),
    (["--timeout", "-1"], "--timeout -1: give seconds"),
    (["--timeout", "nan"], "--timeout nan: give seconds"),   # before: no time limit at all
    (["--reps", "0"], "--reps 0: need at least 1 sweep"),
    (["--reps", "-3"], "--reps -3: need at least 1 sweep")])
def test_bad_timeout_and_reps(argv, start):
    """Before, --timeout 0 or -1 started the ranks and then failed ("did not finish within
    -1 s"), NaN never timed out, and --reps below 1 ran one sweep."""
    _one_error(bench("all_reduce", "-b", "8", "-e", "8", *FAST, *argv), start)


@pytest.mark.parametrize("var,value,argv", [
    ("LINKWISE_TIMEOUT", "abc", []), ("LINKWISE_ALGO", "foo", []),
    ("LINKWISE_COLL_THREADS", "abc", ["-N", "1"]), ("LINKWISE_CHUNK_SIZE", "-5", []),
    ("LINKWISE_RANK", "x", [])])
def test_a_bad_tunable_is_one_line_before_any_rank_starts(var, value, argv):
    """Before, every rank printed a traceback (the communicator or the first collective
    refused the value there) and bench said only that rank 0 exited with status 1."""
    r = bench("all_reduce", "-b", "8", "-e", "8", *FAST, *argv, env={var: value})
    _one_error(r, "")
    assert var in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_bad_tunable_under_a_launcher_is_one_line():
    e = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
             LINKWISE_ALGO="foo")
    r = subprocess.run([sys.executable, "-m", "linkwise.cli", "launch", "-n", "2", "-m",
                        "linkwise.bench.cli", "all_reduce", "-b", "8", "-e", "8", *FAST],
                       env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "LINKWISE_ALGO='foo'" in ln]
    assert len(said) == 1 and said[0].startswith("[rank 0] linkwise bench: "), r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_the_gpu_planes_tunables_do_not_stop_a_cpu_sweep():
    r = bench("all_reduce", "-b", "8", "-e", "8", *FAST, env={"LINKWISE_GPU_LL_MAX": "zz"})
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("argv,start", [
    (["-b", "8", "-e", "1G", "-i", "1"], "-i 1: 1073741817 sizes from -b 8 to -e 1G; a sweep has at most 100000"),
    (["-b", "8", "-e", "1G", "-f", "1.0000001"], "-f 1.0000001: more than 100000 sizes")])
def test_a_sweep_of_a_billion_sizes_is_refused(argv, start):
    """Before, every rank built the list of a billion sizes (tens of GB each) and the run
    ended at --timeout, or when the memory ran out."""
    _one_error(bench("all_reduce", *FAST, *argv, timeout=30), start)


def test_sweep_count_matches_the_sweep():
    for lo, hi, f, step in [(8, 4096, 2, 0), (0, 100, 1, 7), (5, 5, 1, 0), (0, 1000, 1.3, 0),
                            (9, 8, 2, 1), (0, 0, 1, 1)]:
        want = len(common.sweep(lo, hi, f, step)) if hi >= lo else 0
        assert common.sweep_count(lo, hi, f, step) == want, (lo, hi, f, step)
    assert common.sweep_count(8, 1 << 30, 1.0000001, 0, limit=50) == 51

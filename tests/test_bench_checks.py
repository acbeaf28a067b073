"""linkwise bench: #wrong sees outputs a call never wrote, a compared system's wrong results
are named, the JSON keeps the whole command, --plot draws one line per type and op, and Gloo's
one-rank sendrecv is n/a instead of a crash."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from linkwise.bench import collective, common, report
from linkwise.bench.backends import Backend
from test_bench import bench
from test_bench_flags import FAST


class _OneProcess(Backend):
    """A fake backend of one process: nothing to wait for or to combine over ranks."""

    def barrier(self) -> None:
        pass

    def max_over_ranks(self, value: float) -> float:
        return value

    def sum_over_ranks(self, value: int) -> int:
        return value


class _SkipsWrites(_OneProcess):
    """One rank, one process: the collective writes nothing at all, or only what the rank
    gets from others (its own block, or the broadcast root's data, is left as it was)."""

    name = "skips"

    def __init__(self, size_seen: int = 1):
        self.rank, self.size = 0, size_seen

    def bind(self, coll, send, recv, inplace, op, root):
        return lambda: None


@pytest.mark.parametrize("coll", ["all_to_all", "broadcast", "all_gather", "sendrecv"])
def test_an_output_never_written_counts_as_wrong(coll):
    """With one rank, the output these leave unwritten already held the answer (the in-place
    input recv carries), so #wrong said 0 for a call that did nothing."""
    dtype = np.dtype(np.float32)
    total = 64
    point = collective._one_variant(_SkipsWrites(), coll, dtype, "none", 0, total, total,
                                    inplace=False, iters=1, warmup=0, check=True)
    assert point["wrong"] == total, point


def test_poison_differs_in_every_element():
    for dtype in (np.int8, np.uint8, np.int32, np.float16, np.float32, np.float64):
        want = (np.arange(-50, 50) % 7).astype(dtype)
        out = want.copy()
        collective._poison(out, want)
        assert not np.any(out == want), dtype
        assert common.count_wrong(out, want, "sum") == want.size


def _doc(rows_by_system: dict) -> dict:
    systems = {name: {"status": "ok", "rows": rows} for name, rows in rows_by_system.items()}
    return {"test": "all_reduce", "nranks": 2, "systems": systems}


def _row(size, tname, redop):
    cell = {"time_us": 1.0 + size / 1e3, "algbw": 1.0, "busbw": 1.0, "wrong": 0}
    return {"size": size, "count": size // 4, "type": tname, "redop": redop, "root": -1,
            "oop": cell, "ip": cell}


def test_plot_draws_one_line_per_type_and_op():
    rows = [_row(s, t, o) for t in ("float", "int8") for o in ("sum", "max") for s in (64, 512)]
    lines = report._plot_lines(_doc({"linkwise": rows}))
    labels = sorted({label for ax, label, xs, ys in lines})
    assert labels == ["linkwise (out-of-place) float max", "linkwise (out-of-place) float sum",
                      "linkwise (out-of-place) int8 max", "linkwise (out-of-place) int8 sum"]
    assert all(list(xs) == [64, 512] for ax, label, xs, ys in lines)
    one = report._plot_lines(_doc({"linkwise": [_row(s, "float", "sum") for s in (64, 512)]}))
    assert sorted({label for ax, label, xs, ys in one}) == ["linkwise (out-of-place)"]


def test_json_keeps_options_given_before_the_test(tmp_path):
    out = tmp_path / "r.json"
    r = bench("-N", "2", "-b", "64", "-e", "64", *FAST, "--json", str(out), "all_reduce")
    assert r.returncode == 0, r.stderr
    command = json.loads(out.read_text())["command"]
    assert command.startswith("linkwise bench -N 2 -b 64 -e 64") and command.endswith("all_reduce"), command


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch for Gloo")
def test_gloo_sendrecv_on_one_rank_is_na():
    r = bench("sendrecv", "-N", "1", "-b", "8", "-e", "64", "-f", "8", *FAST, "--compare", "gloo")
    assert r.returncode == 0, r.stderr
    assert "Out of bounds values : 0 OK" in r.stdout and "Traceback" not in r.stderr, r.stderr


def test_a_compared_systems_wrong_results_are_named(monkeypatch, capsys):
    from linkwise.bench import cli
    monkeypatch.setattr(report, "median_rows", lambda runs, coll, n: runs)
    monkeypatch.setattr(report, "print_doc", lambda doc, out: None)
    bad = _row(64, "float", "sum") | {"ip": {"time_us": 1.0, "algbw": 1.0, "busbw": 1.0, "wrong": 2}}
    doc = {"test": "all_reduce", "nranks": 2,
           "systems": {"linkwise": {"status": "ok", "runs": [_row(64, "float", "sum")]},
                       "gloo": {"status": "ok", "runs": [bad]}}}
    args = type("Args", (), {"json": None, "plot": None})()
    assert cli._finish(doc, args) == 1
    assert "gloo gave 2 wrong elements" in capsys.readouterr().err


def test_graph_both_prints_two_tables_and_one_json(capsys, tmp_path):
    """--graph both: the eager table, then the graph one; the JSON holds both systems; a wrong
    count in the graph sweep alone still gives status 1."""
    from linkwise.bench import cli
    bad = _row(64, "float", "sum") | {"ip": {"time_us": 1.0, "algbw": 1.0, "busbw": 1.0, "wrong": 3}}
    doc = {"test": "all_reduce", "nranks": 2,
           "systems": {"linkwise": {"status": "ok", "runs": [[_row(64, "float", "sum")]]},
                       "linkwise [graph]": {"status": "ok", "runs": [[bad]]}}}
    out = tmp_path / "r.json"
    args = type("Args", (), {"json": str(out), "plot": None})()
    assert cli._finish(doc, args) == 1
    text = capsys.readouterr().out
    assert text.count("# linkwise bench all_reduce: 2 ranks") == 2
    eager, graph = text.split("# --- the same sweep captured in CUDA graphs ---\n")
    assert "Out of bounds values : 0 OK" in eager and "Out of bounds values : 3 FAILED" in graph
    assert set(json.loads(out.read_text())["systems"]) == {"linkwise", "linkwise [graph]"}


class _FaultyFrom(_OneProcess):
    """One rank: all_reduce out of place done right (a copy) until call ``bad_from``, which and
    every later call leaves the output unwritten. Records each call's input."""

    name = "faulty"

    def __init__(self, bad_from: int):
        self.rank, self.size = 0, 1
        self.bad_from, self.inputs = bad_from, []

    def bind(self, coll, send, recv, inplace, op, root):
        def fn():
            self.inputs.append(send.copy())
            if len(self.inputs) < self.bad_from:
                recv[...] = send
        return fn


def _checked(backend: Backend, checks: int) -> dict:
    return collective._one_variant(backend, "all_reduce", np.dtype(np.float32), "sum", 0, 64, 64,
                                   inplace=False, iters=2, warmup=0, check=checks)


def test_check_count_runs_that_many_checks_on_new_inputs():
    """-c N is nccl-tests' check count: N checking calls, each on other inputs (before, any
    N >= 1 made one)."""
    b = _FaultyFrom(bad_from=10 ** 6)
    assert _checked(b, 3)["wrong"] == 0
    assert len(b.inputs) == 1 + 2 + 3  # the probing call, 2 timed, 3 checks
    checks = b.inputs[3:]
    assert not any(np.array_equal(checks[i], checks[j]) for i in range(3) for j in range(i))
    assert not any(np.array_equal(c, b.inputs[0]) for c in checks)


def test_a_later_check_finds_what_the_first_did_not():
    """A fault from the 5th call on (the second check) passes -c 1 and is found by -c 2;
    the first check that finds wrong elements ends the checks."""
    assert _checked(_FaultyFrom(bad_from=5), 1)["wrong"] == 0
    b = _FaultyFrom(bad_from=5)
    assert _checked(b, 3)["wrong"] == 64
    assert len(b.inputs) == 5
    assert _checked(_FaultyFrom(bad_from=5), 0)["wrong"] is None

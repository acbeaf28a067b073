"""Tables (nccl-tests / OSU layout), JSON documents, medians over repetitions, and plots.

A result document is a dict::

    {"test": "all_reduce" | "p2p", "nranks": 2, "command": "...", "machine": "...",
     "systems": {"linkwise": {"status": "ok", "how": "...", "runs": [[row, ...], ...],
                              "rows": [median row, ...]},
                 "gloo": {"status": "skipped", "reason": "torch is not installed"}, ...}}

Collective rows follow nccl-tests: ``size`` is the bytes of the whole buffer and ``count``
the elements per rank for all_gather, reduce_scatter and all_to_all (size = count * nranks
* element size), the elements of the buffer for the others. "Avg bus bandwidth" averages
every busbw linkwise measured, out-of-place and in-place, as nccl-tests does.

Ratios: for bandwidth, linkwise / other (above 1: linkwise is faster); for p2p latency,
linkwise time / other time (below 1: linkwise is faster). For a collective,
``lw/x = linkwise busbw / x busbw`` equals ``x time / linkwise time`` for the same size.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
from typing import Optional, TextIO

from . import common

VARIANTS = (("oop", "out-of-place"), ("ip", "in-place"))


def machine() -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    total = os.cpu_count() or 1
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    # A rank bound to its cores (launch --bind cpu) says so instead of describing the machine by them.
    cores = f"{total} cores" if mine >= total else f"{total} cores, this rank on {mine}"
    return f"{cpu or platform.processor()} ({cores}), Linux {platform.release()}, " \
           f"Python {platform.python_version()}"


# -- medians over repetitions ---------------------------------------------------------------
def _row_key(row: dict) -> tuple:
    return (row["size"], row.get("type"), row.get("redop"), row.get("root"))


def median_rows(runs: list[list[dict]], coll: str, nranks: int) -> list[dict]:
    """Per point, the median over repetitions (time for collectives; each metric for p2p)."""
    if not runs:
        return []
    if len(runs) == 1:
        return runs[0]
    out = []
    for idx, first in enumerate(runs[0]):
        same = [r[idx] for r in runs if idx < len(r) and _row_key(r[idx]) == _row_key(first)]
        row = dict(first)
        if coll == "p2p":
            for k in ("latency_us", "bw_GBps", "bibw_GBps"):
                if k in first:
                    row[k] = statistics.median(r[k] for r in same)
            if "wrong" in first:  # as the collectives': the largest count of any repetition
                row["wrong"] = max(r.get("wrong") or 0 for r in same)
        else:
            for var, _ in VARIANTS:
                cells = [r[var] for r in same if "time_us" in r.get(var, {})]
                if not cells:
                    continue
                t = statistics.median(c["time_us"] for c in cells)
                algbw = row["size"] / (t * 1e-6) / 1e9 if t > 0 else 0.0
                wrong = [c["wrong"] for c in cells if c.get("wrong") is not None]
                row[var] = {"time_us": t, "algbw": algbw,
                            "busbw": algbw * common.busbw_factor(coll, nranks),
                            "wrong": max(wrong) if wrong else None}
        out.append(row)
    return out


# -- collectives ----------------------------------------------------------------------------
def _cell(c: Optional[dict]) -> str:
    if not c or "time_us" not in c:
        return f"{'n/a':>10} {'n/a':>7} {'n/a':>7} {'n/a':>6}"
    wrong = "N/A" if c.get("wrong") is None else str(c["wrong"])
    return f"{c['time_us']:10.2f} {c['algbw']:7.2f} {c['busbw']:7.2f} {wrong:>6}"


def _na_reasons(rows: list[dict]) -> list[str]:
    """Why cells of these rows are n/a (each reason once, in order of appearance)."""
    seen: dict = {}
    for r in rows:
        for var, _ in VARIANTS:
            why = (r.get(var) or {}).get("na")
            if why:
                seen.setdefault(why, None)
    return list(seen)


def _pick(lw_row: dict, other_row: Optional[dict]):
    """(variant, lw cell, other cell) for a comparison: out-of-place where the other system
    has it, else in-place."""
    if other_row is None:
        return None, None, None
    for var, _ in VARIANTS:
        if "time_us" in other_row.get(var, {}):
            return var, lw_row.get(var, {}), other_row[var]
    return None, None, None


def collective_table(doc: dict, out: TextIO) -> None:
    coll, n = doc["test"], doc["nranks"]
    systems = doc["systems"]
    lw = systems.get("linkwise", {})
    others = [s for s, v in systems.items() if s != "linkwise" and v.get("status") == "ok"]
    w = out.write
    w(f"# linkwise bench {coll}: {n} ranks; {doc.get('machine', '')}\n")
    w(f"# busbw = algbw * {common.busbw_factor(coll, n):.4g} (nccl-tests' factor for {coll}); "
      f"time = mean per call, max over ranks\n")
    for name, s in systems.items():
        if s.get("status") != "ok":
            w(f"# {name}: {s.get('status')} ({s.get('reason', '')})\n")
        elif s.get("how"):
            w(f"# {name}: {s['how']}\n")
    rows = lw.get("rows") if lw.get("status") == "ok" else None
    if rows is None:  # linkwise could not run it: show the first other system instead
        if not others:
            return
        rows = systems[others[0]]["rows"]
        w(f"# rows below are {others[0]}'s (linkwise has no {coll})\n")
        others = others[1:]
    head_cmp = "".join(f" {s + ' us':>10} {s + ' busbw':>10} {'lw/' + s:>8}" for s in others)
    w(f"#{'':47}{'out-of-place':^34}{'in-place':^34}\n")
    w(f"#{'size':>11} {'count':>12} {'type':>8} {'redop':>6} {'root':>5}"
      f" {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
      f" {'time':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}{head_cmp}\n")
    w(f"#{'(B)':>11} {'(elements)':>12} {'':>8} {'':>6} {'':>5}"
      f" {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
      f" {'(us)':>10} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}\n")
    index = {s: {_row_key(r): r for r in systems[s]["rows"]} for s in others}
    busbws, wrong_total = [], 0
    for r in rows:
        line = f"{r['size']:12d} {r['count']:12d} {r['type']:>8} {r['redop']:>6} {r['root']:5d}"
        line += " " + _cell(r.get("oop")) + " " + _cell(r.get("ip"))
        for s in others:
            var, mine, theirs = _pick(r, index[s].get(_row_key(r)))
            if theirs is None:
                line += f" {'n/a':>10} {'n/a':>10} {'n/a':>8}"
                continue
            # x time / linkwise time: the busbw ratio where busbw is defined, and also where it
            # is 0 (one rank, 0 bytes), which still has times
            ratio = (theirs["time_us"] / mine["time_us"]) if mine and mine.get("time_us") else None
            tag = "" if var == "oop" else "*"
            line += f" {theirs['time_us']:10.2f} {theirs['busbw']:9.2f}{tag or ' '}"
            line += f" {ratio:8.2f}" if ratio is not None else f" {'n/a':>8}"
        w(line + "\n")
        for var, _ in VARIANTS:  # nccl-tests: both variants count, for #wrong and the average
            c = r.get(var, {})
            if "busbw" in c:
                wrong_total += c.get("wrong") or 0
                busbws.append(c["busbw"])
    if others:
        w("# lw/x: linkwise busbw / x busbw for the same variant (= x time / linkwise time); "
          "* = compared in place (x has no out-of-place form)\n")
    # Why the n/a cells shown are n/a: linkwise's own cells, and another system's points where
    # it has neither form (one form alone is compared, marked *).
    shown = {"linkwise": rows} if lw.get("status") == "ok" else {}
    for s in others:
        shown[s] = [o for o in systems[s]["rows"] if _pick(o, o)[0] is None]
    for name, na_rows in shown.items():
        for why in _na_reasons(na_rows):
            w(f"# {name}: n/a where {why}\n")
    merged = {(r["size"], r["type"]): r["merged_sizes"] for r in rows if r.get("merged_sizes")}
    for (size, tname), more in merged.items():
        w(f"# size {size} {tname}: also stands for the requested sizes "
          f"{', '.join(map(str, more))} B (the same element count; no row of their own)\n")
    w(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}\n")
    if busbws:
        w(f"# Avg bus bandwidth    : {sum(busbws) / len(busbws):.4f}\n")


# -- point-to-point -------------------------------------------------------------------------
_P2P_COLS = (("latency_us", "lat(us)", True), ("bw_GBps", "bw(GB/s)", False),
             ("bibw_GBps", "bibw(GB/s)", False))


def p2p_table(doc: dict, out: TextIO) -> None:
    systems = doc["systems"]
    w = out.write
    w(f"# linkwise bench p2p: ranks 0 <-> 1 of {doc['nranks']}; {doc.get('machine', '')}\n")
    for name, s in systems.items():
        if s.get("status") != "ok":
            w(f"# {name}: {s.get('status')} ({s.get('reason', '')})\n")
        elif s.get("how"):
            w(f"# {name}: {s['how']}\n")
    lw = systems.get("linkwise", {})
    if lw.get("status") != "ok":
        return
    others = [s for s, v in systems.items() if s != "linkwise" and v.get("status") == "ok"]
    cols = [c for c in _P2P_COLS if c[0] in (lw["rows"][0] if lw["rows"] else {})]
    checked = bool(lw["rows"]) and "wrong" in lw["rows"][0]
    head = f"#{'size':>11}"
    for key, label, _ in cols:
        head += f" {label:>11}"
        for s in others:
            head += f" {s + ' ' + label.split('(')[0]:>11} {'lw/' + s:>7}"
    w(head + (f" {'#wrong':>6}" if checked else "") + "\n")
    index = {s: {r["size"]: r for r in systems[s]["rows"]} for s in others}
    for r in lw["rows"]:
        line = f"{r['size']:12d}"
        for key, _, is_time in cols:
            line += f" {r[key]:11.2f}" if is_time else f" {r[key]:11.3f}"
            for s in others:
                o = index[s].get(r["size"], {})
                if key not in o:
                    line += f" {'n/a':>11} {'n/a':>7}"
                    continue
                line += f" {o[key]:11.2f}" if is_time else f" {o[key]:11.3f}"
                line += f" {r[key] / o[key]:7.2f}" if o[key] else f" {'n/a':>7}"
        w(line + (f" {r.get('wrong', 0):6d}" if checked else "") + "\n")
    if checked:  # as nccl-tests' last line; the other systems' counts go to stderr
        total = sum(r.get("wrong", 0) for r in lw["rows"])
        w(f"# Wrong bytes received : {total} {'OK' if total == 0 else 'FAILED'}\n")
    if others:
        w("# lw/x: latency = linkwise time / x time (lower is better); bw, bibw = linkwise GB/s / "
          "x GB/s (higher is better)\n")


def print_doc(doc: dict, out: TextIO) -> None:
    (p2p_table if doc["test"] == "p2p" else collective_table)(doc, out)


def write_json(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _plot_lines(doc: dict) -> list[tuple]:
    """(axis 0 = bandwidth / 1 = time, label, xs, ys) of every line to draw. Points of 0
    bytes (or 0 GB/s) are left out: they have no place on log axes."""
    lines: list[tuple] = []
    p2p = doc["test"] == "p2p"
    for name, s in doc["systems"].items():
        rows = [r for r in s.get("rows") or [] if r["size"] > 0] if s.get("status") == "ok" else []
        if not rows:
            continue
        if p2p:
            for ax, key in ((0, "bw_GBps"), (1, "latency_us")):
                pts = [(r["size"], r[key]) for r in rows if r.get(key, 0) > 0]
                if pts:
                    lines.append((ax, name) + tuple(zip(*pts)))
            continue
        # One line per type and op of the sweep (-d / -o with several), each named by them
        # when there are several: one line through them all would double back on itself.
        series: dict = {}
        for r in rows:
            series.setdefault((r.get("type"), r.get("redop")), []).append(r)
        for (tname, redop), group in series.items():
            what = f" {tname} {redop}" if len(series) > 1 else ""
            for var, label in VARIANTS:
                cells = [(r["size"], r.get(var, {})) for r in group]
                if not any(c.get("time_us", 0) > 0 for _, c in cells):
                    continue
                # busbw is 0 at one rank (nccl-tests' factors): only the time panel has points
                for ax, key in ((0, "busbw"), (1, "time_us")):
                    pts = [(size, c[key]) for size, c in cells if c.get(key, 0) > 0]
                    if pts:
                        lines.append((ax, f"{name} ({label}){what}", [p[0] for p in pts], [p[1] for p in pts]))
                break
    return lines


def plot(doc: dict, path: str) -> bool:
    """busbw and time against size (log-log), one line per system (out-of-place where it has
    it, else in-place); for p2p, latency and bandwidth. False (nothing written) when no point
    can be drawn (every size 0 bytes)."""
    lines = _plot_lines(doc)
    if not lines:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    p2p = doc["test"] == "p2p"
    for ax, label, xs, ys in lines:
        (ax_bw, ax_t)[ax].plot(xs, ys, marker="o", label=label)
    ax_bw.set_ylabel("bandwidth (GB/s)" if p2p else "busbw (GB/s)")
    ax_t.set_ylabel("one-way latency (us)" if p2p else "time (us)")
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_lines():  # an empty legend warns
            ax.legend(fontsize=8)
    fig.suptitle(f"linkwise bench {doc['test']}, {doc['nranks']} ranks")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return True

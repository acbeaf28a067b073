"""``linkwise info``: what this build is and what linkwise would do here.

Prints version, build (CPU/CUDA, compiler), the launcher detected and this rank, the transport
setting and the interface chosen for cross-host TCP, and every LINKWISE_* tunable with its
default, current value and help. ``--json`` prints the same as one JSON object. Nothing here
may fail because one part is broken: each part that raises is reported as {"error": ...}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

__all__ = ["add_arguments", "run", "collect"]


def _guard(fn) -> Any:
    try:
        return fn()
    except Exception as exc:  # reported, not raised: info must work on a broken setup
        return {"error": f"{type(exc).__name__}: {exc}"}


def _build() -> dict:
    try:
        from . import _native
    except ImportError as exc:
        return {"native": False, "cuda": False, "compiler": None,
                "error": f"native module not built ({exc})"}
    info = dict(_native.build_info())
    return {"native": True, **info}


def _launcher() -> dict:
    from .bootstrap import detect
    return dataclasses.asdict(detect())


def _interface() -> dict:
    import warnings
    from .netif import select_interface
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iface = select_interface()
    out = {"name": iface.name, "address": iface.address}
    if caught:
        out["warning"] = str(caught[0].message)
    return out


def _tunables() -> list[dict]:
    from . import config
    out = []
    for t in config.TUNABLES.values():
        current = _guard(t.current)
        out.append({"name": t.name, "default": t.default, "current": current, "help": t.help})
    return out


def collect() -> dict:
    """Everything ``linkwise info`` shows, as plain data."""
    from . import __version__, config
    return {
        "version": __version__,
        "build": _guard(_build),
        "launcher": _guard(_launcher),
        "transport": _guard(lambda: config.get("LINKWISE_TRANSPORT")),
        "interface": _guard(_interface),
        "tunables": _tunables(),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _show(value: Any) -> str:
    """Rich markup for a value: its text escaped (a value may hold '[' ... ']'), an error red."""
    from rich.markup import escape
    if isinstance(value, dict) and "error" in value:
        return f"[red]{escape(str(value['error']))}[/red]"
    return escape("" if value is None else str(value))


def _print_rich(data: dict) -> None:
    from rich.console import Console

    # Rendered, then written: rich ends the process with status 1 itself when stdout's reader
    # goes away (`linkwise info | head`); a plain write lets linkwise.cli end quietly (0).
    console = Console()
    with console.capture() as captured:
        _print_tables(console, data)
    sys.stdout.write(captured.get())


def _print_tables(console, data: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    summary = Table(title="linkwise", show_header=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("version", escape(str(data["version"])))
    b = data["build"]
    if b.get("native"):
        kind = "CPU only"
        if b.get("cuda"):
            kind = f"CUDA (sm {b['cuda_archs']})" if b.get("cuda_archs") else "CUDA"
        summary.add_row("build", f"{kind}, {b.get('compiler')}")
    else:
        summary.add_row("build", _show({"error": b.get("error")}))
    lw = data["launcher"]
    if "error" in lw:
        summary.add_row("launcher", _show(lw))
    else:
        summary.add_row("launcher", f"{lw['launcher']}: rank {lw['rank']} of {lw['size']}, "
                        f"local {lw['local_rank']} of {lw['local_size']}")
        summary.add_row("rendezvous", f"{lw['master_addr']}:{lw['master_port']}"
                        + (f"  job {lw['job_id']}" if lw["job_id"] else ""))
    summary.add_row("transport", _show(data["transport"]))
    ifc = data["interface"]
    summary.add_row("interface", _show(ifc) if "error" in ifc else
                    f"{ifc['name']} ({ifc['address']})" + (f"  [yellow]{escape(ifc['warning'])}"
                                                          f"[/yellow]" if "warning" in ifc else ""))
    console.print(summary)

    tun = Table(title="tunables (LINKWISE_*)")
    # Names are never wrapped (users copy them); the help column takes what width is left.
    tun.add_column("name", no_wrap=True, min_width=max(len(t["name"]) for t in data["tunables"]))
    for col in ("default", "current", "help"):
        tun.add_column(col, overflow="fold")
    for t in data["tunables"]:
        cur = t["current"]
        changed = not (isinstance(cur, dict) and "error" in cur) and cur != t["default"]
        cur_text = _show(cur)
        tun.add_row(t["name"], _show(t["default"]),
                    f"[bold yellow]{cur_text}[/bold yellow]" if changed else cur_text,
                    escape(t["help"]))
    console.print(tun)


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        _print_rich(data)
    return 0

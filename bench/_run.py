"""Helpers of the side-by-side scripts: run `linkwise bench` and read its JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "src") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "src"))  # run from a checkout without installing


def linkwise_bench(*argv: str, env: dict | None = None, echo: bool = True) -> dict:
    """Run `linkwise bench ARGV --json tmp` (from this checkout); returns the JSON document."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.join(ROOT, "src") + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.update(env or {})
    cmd = [sys.executable, "-m", "linkwise.bench.cli", *argv, "--no-progress", "--json", path]
    try:
        r = subprocess.run(cmd, env=e, capture_output=True, text=True)
        if echo:
            sys.stdout.write(r.stdout)
        if r.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"

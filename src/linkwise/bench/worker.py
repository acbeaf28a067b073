"""Entry point of ranks started by :mod:`linkwise.bench.spawn` (``python -m``).

Reads the benchmark's arguments from ``LINKWISE_BENCH_ARGS``, measures the systems named in
``LINKWISE_BENCH_SYSTEMS``, and rank 0 writes ``{"systems": ...}`` to ``LINKWISE_BENCH_RESULT``.
"""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace


def main() -> int:
    args = SimpleNamespace(**json.loads(os.environ["LINKWISE_BENCH_ARGS"]))
    systems = [s for s in os.environ.get("LINKWISE_BENCH_SYSTEMS", "linkwise").split(",") if s]
    from .runner import OutOfMemory, measure
    try:
        out = measure(args, systems, show_progress=not args.no_progress)
    except OutOfMemory as exc:
        print(f"linkwise bench: {exc}", file=sys.stderr)
        return 3
    if out.pop("_rank") == 0:
        nranks = out.pop("_nranks")
        tmp = os.environ["LINKWISE_BENCH_RESULT"] + ".part"
        with open(tmp, "w") as f:
            json.dump({"systems": out, "nranks": nranks}, f)
        os.replace(tmp, os.environ["LINKWISE_BENCH_RESULT"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

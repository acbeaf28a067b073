"""``linkwise`` command line: a thin table of subcommands.

Each subcommand lives in a module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their subcommand runs, so a broken or missing tool never stops
the others; a missing one answers "not available in this build" with exit status 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

# name -> (module, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("linkwise.info", "version, build, launcher, transport, interface and tunables"),
    "launch": ("linkwise.launch", "start N local ranks (like torchrun --standalone)"),
    "bench": ("linkwise.bench.cli", "measure latency and bandwidth"),
    "topo": ("linkwise.topo.cli", "show, save or probe this machine's topology"),
    "plan": ("linkwise.plan.cli", "lay rings, trees and chains over a topology"),
    "tune": ("linkwise.tune.cli", "pick algorithms and chunk sizes by measurement"),
}


def _load(module: str):
    """The subcommand's module, or None when this build does not have it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # Only "this module (or its package) is absent" means not available; a missing
        # dependency inside an existing module is a real error and propagates.
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            return None
        raise


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    top = argparse.ArgumentParser(prog="linkwise", description="linkwise: fast communication "
                                  "between processes that knows the machine's links")
    sub = top.add_subparsers(dest="command", metavar="command")
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    if not argv:
        top.print_help(sys.stderr)
        return 2
    if argv[0] not in COMMANDS:
        top.parse_args(argv)  # prints --help (exit 0) or the "invalid choice" error (exit 2)
        return 2
    name, rest = argv[0], argv[1:]
    module = _load(COMMANDS[name][0])
    if module is None:
        print(f"linkwise {name}: not available in this build", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"linkwise {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())

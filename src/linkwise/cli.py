"""``linkwise`` command line: a thin table of subcommands.

Each subcommand lives in a module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their subcommand runs, so a broken or missing tool never stops
the others; a missing one (plan and tune, not written yet) is marked so in ``linkwise --help``
and answers "not in this version yet" with exit status 2.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
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


def _present(module: str) -> bool:
    """Whether the subcommand's module exists, found without running it."""
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is absent
        return False


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    top = argparse.ArgumentParser(prog="linkwise", description="linkwise: fast communication "
                                  "between processes that knows the machine's links")
    sub = top.add_subparsers(dest="command", metavar="command")
    for name, (module, text) in COMMANDS.items():
        if not _present(module):
            text += " (not in this version yet)"
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
        print(f"linkwise {name}: not in this version yet", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"linkwise {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    try:
        return int(module.run(parser.parse_args(rest)) or 0)
    except BrokenPipeError:
        # A reader of stdout that went away (`linkwise topo | head`): end quietly, as other
        # Unix tools do; later writes and the flush at exit go nowhere instead of raising.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


if __name__ == "__main__":
    sys.exit(main())

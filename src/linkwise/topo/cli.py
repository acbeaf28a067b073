"""``linkwise topo``: print, save and measure the machine's topology.

The top-level dispatcher (``linkwise.cli``) builds a sub-parser, calls
:func:`add_arguments` on it, and calls :func:`run` with the parsed namespace; ``run``
returns the process exit status (0 ok, 2 bad input) and prints to stdout (progress bars and
diagnostics to stderr). Also runnable alone: ``python -m linkwise.topo.cli``.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Optional

from . import fixture, fixture_names, load, load_or_discover
from .affinity import binding_for, visible_gpus
from .model import Topology
from .render import render_bindings, render_matrix, render_summary


MAX_RANKS = 4096  # --ranks: ranks of one host (the binding table grows with the square)


def _size(text: str) -> int:
    """``268435456``, ``256M``, ``1G``, ``64KiB`` -> bytes, at least 1."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 256M, 1G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least 1 byte")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: need at least 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--fixture", metavar="NAME",
                     help=f"print a shipped topology ({', '.join(fixture_names())})")
    src.add_argument("--load", metavar="FILE", help="print a topology saved with --save")
    parser.add_argument("--save", metavar="FILE", help="write the topology as JSON to FILE")
    parser.add_argument("--json", action="store_true",
                        help="print JSON instead of the matrix (with --probe: "
                             '{"topology": ..., "probe": ...})')
    parser.add_argument("--probe", action="store_true",
                        help="measure bandwidth and latency between the GPUs and the host "
                             "of THIS machine (needs PyTorch and a GPU)")
    parser.add_argument("--size", type=_size, default=256 << 20,
                        help="bytes per bandwidth copy in --probe (default 256M)")
    parser.add_argument("--iters", type=_positive, default=10,
                        help="timed copies per pair in --probe (default 10)")
    parser.add_argument("--reference", action="store_true",
                        help="with --probe: also time cudaMemcpyPeer (CuPy) per GPU pair "
                             "and print the ratio")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the probed bandwidth matrix as a heat map (implies --probe)")
    parser.add_argument("--ranks", type=int, metavar="N",
                        help="print the GPU, CPUs and NIC that N local ranks would get")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _topology(args) -> Topology:
    if args.fixture is not None:
        if args.fixture not in fixture_names():  # also no paths: --fixture ../x
            raise ValueError(f"no topology fixture {args.fixture!r}; have {', '.join(fixture_names())}")
        return fixture(args.fixture)
    if args.load is not None:
        if not args.load:
            raise ValueError("--load needs a file name")
        return load(args.load)
    return load_or_discover()


def run(args) -> int:
    if args.ranks is not None and not 1 <= args.ranks <= MAX_RANKS:
        print(f"linkwise topo: --ranks {args.ranks}: need 1 to {MAX_RANKS} ranks", file=sys.stderr)
        return 2
    try:
        topo = _topology(args)
    except (KeyError, OSError, ValueError) as exc:
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # KeyError's str() quotes it
        print(f"linkwise topo: {text}", file=sys.stderr)
        return 2
    if args.save:
        try:
            topo.save(args.save)
        except OSError as exc:
            print(f"linkwise topo: --save {args.save}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"saved {topo.source} topology to {args.save}", file=sys.stderr)

    probed: Optional[dict] = None
    if args.probe or args.plot:
        from .probe import ProbeError
        try:
            probed = _run_probe(args, topo)
        except ProbeError as exc:
            print(f"linkwise topo: --probe: {exc}", file=sys.stderr)
            return 1

    plot_error = (probed or {}).pop("plot_error", None)
    # This machine's bindings follow CUDA_VISIBLE_DEVICES, as launch --bind auto's do.
    visible = visible_gpus(topo) if args.fixture is None and args.load is None else None
    if args.json:
        extra = {k: v for k, v in (probed or {}).items() if k != "text"}
        doc = topo.to_dict() if probed is None else {"topology": topo.to_dict(), **extra}
        if args.ranks:
            doc = dict(doc, bindings=[asdict(binding_for(r, args.ranks, topo, visible)) for r in range(args.ranks)])
        print(json.dumps(doc, indent=1))
        return _said(plot_error)
    print(render_summary(topo))
    print()
    print(render_matrix(topo))
    if args.ranks:
        print()
        print(f"binding for {args.ranks} local rank(s) (linkwise launch --bind auto):")
        print(render_bindings(topo, args.ranks, visible))
    if probed and "text" in probed:
        print()
        print(probed.pop("text"))
    return _said(plot_error)


def _said(plot_error: Optional[str]) -> int:
    """1 after one line on stderr when --plot could not be written (the tables are out)."""
    if plot_error:
        sys.stdout.flush()
        print(plot_error, file=sys.stderr)
        return 1
    return 0


def _run_probe(args, topo: Topology) -> dict:
    """Runs the probe; returns {"probe": dict|None, "reason"?, "reference"?, "text"?}."""
    from .probe import (no_probe_reason, plot_bandwidth, probe, reference_peer_bandwidth,
                        render_probe)
    reason = no_probe_reason()
    if reason is not None:
        return {"probe": None, "reason": reason, "text": f"probe: {reason}"}
    if args.fixture or args.load:
        print("linkwise topo --probe: measuring this machine, not the loaded topology",
              file=sys.stderr)
    # Named by this machine's topology (the probe measures it even with --fixture/--load).
    here = topo if args.fixture is None and args.load is None else None
    result = probe(size_bytes=args.size, iters=args.iters, progress=not args.no_progress,
                   topology=here)
    out: dict = {"probe": result.to_dict(), "text": render_probe(result)}
    if args.reference:
        rows, ratios = [], []
        for s, src in enumerate(result.devices):
            for d, dst in enumerate(result.devices):
                if s == d or "host" in (src, dst):
                    continue
                ref = reference_peer_bandwidth(s - 1, d - 1, args.size, args.iters)
                got = result.bandwidth_gbs[s][d]
                if ref is None or got is None:
                    continue
                ratios.append(got / ref)
                rows.append({"src": src, "dst": dst, "probe_gbs": got, "memcpy_peer_gbs": ref,
                             "ratio": got / ref})
        out["reference"] = rows
        if ratios:
            out["text"] += ("\n\ncudaMemcpyPeer reference: probe/reference ratio "
                            f"min {min(ratios):.3f} max {max(ratios):.3f} over {len(ratios)} "
                            "pairs" + "\n" + "\n".join(
                                f"  {r['src']}->{r['dst']}: probe {r['probe_gbs']:.1f} GB/s, "
                                f"cudaMemcpyPeer {r['memcpy_peer_gbs']:.1f} GB/s"
                                for r in rows))
        else:
            out["text"] += "\n\ncudaMemcpyPeer reference: CuPy missing or fewer than 2 GPUs"
    if args.plot:
        try:
            plot_bandwidth(result, args.plot)
            print(f"wrote {args.plot}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - matplotlib raises many kinds; the probe's results still print
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            out["plot_error"] = f"linkwise topo: --plot {args.plot}: {why}"
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="linkwise topo", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""all_reduce and broadcast, linkwise vs Open MPI (mpi4py) and Gloo (torch.distributed).

    python bench/allreduce_vs_mpi_gloo.py [--reps 3] [-N 2]

Gloo runs in linkwise's processes right after its sweep; MPI is a second launch (mpirun)
right after; every repetition repeats both; tables show medians. Targets (issue 3, 2 ranks):
all_reduce busbw >= 2x Open MPI and >= 10x Gloo at 1 MiB and above, 8 B latency <= Open
MPI's; broadcast busbw >= 2x Open MPI at 1 MiB and above.
"""
from __future__ import annotations

import argparse

from _run import linkwise_bench, verdict


def _cmp(doc: dict, other: str, size: int) -> float | None:
    """linkwise busbw / other busbw at size, same variant (out-of-place if other has it)."""
    lw = {r["size"]: r for r in doc["systems"]["linkwise"].get("rows", [])}.get(size)
    ot = {r["size"]: r for r in doc["systems"].get(other, {}).get("rows", [])}.get(size)
    if not lw or not ot:
        return None
    var = "oop" if "time_us" in ot["oop"] else "ip"
    return lw[var]["time_us"] and ot[var]["time_us"] / lw[var]["time_us"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-N", "--nranks", type=int, default=2)
    a = ap.parse_args()
    for coll, targets in (("all_reduce", {"mpi": 2.0, "gloo": 10.0}), ("broadcast", {"mpi": 2.0})):
        doc = linkwise_bench(coll, "-b", "8", "-e", "64M", "-f", "8", "-N", str(a.nranks),
                             "--compare", "gloo,mpi", "--reps", str(a.reps))
        if doc["systems"]["linkwise"].get("status") != "ok":
            print(f"{coll}: linkwise has no {coll} yet")
            continue
        sizes = [r["size"] for r in doc["systems"]["linkwise"]["rows"]]
        print()
        for other, want in targets.items():
            big = [(s, _cmp(doc, other, s)) for s in sizes if s >= 1 << 20]
            ok = all(x is not None and x >= want for _, x in big)
            desc = ", ".join(f"{s >> 20} MiB {x:.2f}x" for s, x in big if x is not None)
            print(f"{coll} busbw vs {other} at >= 1 MiB (target >= {want}x): {desc}: {verdict(ok)}")
        small = _cmp(doc, "mpi", 8)
        if coll == "all_reduce" and small is not None:
            print(f"all_reduce 8 B time: linkwise / Open MPI = {1 / small:.2f} (target <= 1): "
                  f"{verdict(small >= 1)}")


if __name__ == "__main__":
    main()

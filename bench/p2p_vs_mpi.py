"""Shared-memory point-to-point, linkwise vs Open MPI (mpi4py under mpirun -n 2), same run.

    python bench/p2p_vs_mpi.py [--reps 5]

Each repetition launches linkwise's two ranks, then mpirun's two ranks, back to back (the
`linkwise bench p2p --compare mpi --reps R` sweep); the table shows medians. Targets (issue 2):
one-way latency at 8 B <= 1.5x Open MPI's; bandwidth at 4 MiB and 64 MiB >= Open MPI's.
"""
from __future__ import annotations

import argparse

from _run import linkwise_bench, verdict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    lat = linkwise_bench("p2p", "-b", "8", "-e", "8", "--tests", "latency", "--compare", "mpi",
                         "--reps", str(a.reps), env={"LINKWISE_TRANSPORT": "shm"})
    bw = linkwise_bench("p2p", "-b", "4M", "-e", "64M", "-f", "16", "--tests", "bw",
                        "--compare", "mpi", "--reps", str(a.reps), env={"LINKWISE_TRANSPORT": "shm"})
    lw_l, mpi_l = (lat["systems"][s]["rows"][0]["latency_us"] for s in ("linkwise", "mpi"))
    for doc, key in ((lat, "latency_us"), (bw, "bw_GBps")):
        for name in ("linkwise", "mpi"):
            runs = doc["systems"][name]["runs"]
            print(f"runs {name} {key}: " + "; ".join(
                ", ".join(f"{row[key]:.2f}" for row in run) for run in runs))
    print(f"\n8 B one-way latency: linkwise {lw_l:.2f} us, Open MPI {mpi_l:.2f} us, "
          f"ratio {lw_l / mpi_l:.2f} (target <= 1.5): {verdict(lw_l <= 1.5 * mpi_l)}")
    mpi_rows = {r["size"]: r for r in bw["systems"]["mpi"]["rows"]}
    for r in bw["systems"]["linkwise"]["rows"]:
        o = mpi_rows[r["size"]]["bw_GBps"]
        print(f"{r['size'] >> 20} MiB bandwidth: linkwise {r['bw_GBps']:.2f} GB/s, Open MPI {o:.2f} "
              f"GB/s, ratio {r['bw_GBps'] / o:.2f} (target >= 1): {verdict(r['bw_GBps'] >= o)}")


if __name__ == "__main__":
    main()

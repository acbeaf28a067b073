"""8 ranks on this machine's cores: ranks 0 and 1 ping-pong while 6 others wait.

    python bench/oversubscribed_pingpong.py [-N 8]

Waiting ranks must block, not spin: the run must finish, and quickly. Prints the wall time
and the latency, next to the same test with 2 ranks.
"""
from __future__ import annotations

import argparse
import time

from _run import linkwise_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-N", "--nranks", type=int, default=8)
    a = ap.parse_args()
    for n in (2, a.nranks):
        t0 = time.perf_counter()
        doc = linkwise_bench("p2p", "-N", str(n), "-b", "8", "-e", "64K", "-f", "8", "--tests",
                             "latency", "--timeout", "120", echo=False)
        wall = time.perf_counter() - t0
        lat = {r["size"]: r["latency_us"] for r in doc["systems"]["linkwise"]["rows"]}
        print(f"{n} ranks: completed in {wall:.1f} s wall; one-way latency "
              + ", ".join(f"{s} B {v:.2f} us" for s, v in lat.items()))


if __name__ == "__main__":
    main()

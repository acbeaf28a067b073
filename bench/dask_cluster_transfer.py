"""Worker-to-worker transfers in a Dask LocalCluster, linkwise:// against tcp://: an array made
on worker A is needed by a task on worker B, so B fetches it from A (Dask's get_data path,
as a shuffle or a reduction moves data). Times the fetch task from submit to result, the
two protocols' clusters alternating in rounds; prints medians and their ratio.

    python3 bench/dask_cluster_transfer.py [--sizes 1M,16M,64M,256M] [--reps 5] [--rounds 3]
"""
import argparse
import statistics
import time

import numpy as np
from distributed import Client, LocalCluster

from linkwise import dask_comm  # noqa: F401 - registers linkwise:// (installed: the entry point)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _make(nbytes: int, seed: int):
    return np.full(nbytes // 8, float(seed))


def _first(x) -> float:
    return float(x[0])


def transfer_times(client: Client, nbytes: int, reps: int) -> list:
    a, b = sorted(client.scheduler_info()["workers"])
    times = []
    for i in range(reps + 1):  # the first is a warm-up
        data = client.submit(_make, nbytes, i, workers=[a], pure=False)
        data.result()
        t0 = time.perf_counter()
        got = client.submit(_first, data, workers=[b], pure=False).result()
        elapsed = time.perf_counter() - t0
        assert got == float(i)
        if i:
            times.append(elapsed)
        del data
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,16M,64M,256M", type=lambda t: [_size(x) for x in t.split(",")])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    protocols = ["tcp://", "linkwise://"]
    times = {(p, s): [] for p in protocols for s in args.sizes}
    for _ in range(args.rounds):
        for p in protocols:
            with LocalCluster(protocol=p, n_workers=2, threads_per_worker=1, processes=True,
                              dashboard_address=":0", memory_limit=0) as cluster, Client(cluster) as client:
                client.wait_for_workers(2)
                for s in args.sizes:
                    times[p, s] += transfer_times(client, s, args.reps)
    print(f"# worker-to-worker fetch, LocalCluster of 2 worker processes; medians of {args.rounds} x {args.reps}")
    print(f"{'size (B)':>12} {'tcp ms':>9} {'tcp GB/s':>9} {'lw ms':>9} {'lw GB/s':>9} {'tcp/lw':>7}")
    for s in args.sizes:
        t_tcp, t_lw = (statistics.median(times[p, s]) for p in protocols)
        print(f"{s:>12} {t_tcp * 1e3:>9.2f} {s / t_tcp / 1e9:>9.2f} {t_lw * 1e3:>9.2f} {s / t_lw / 1e9:>9.2f} "
              f"{t_tcp / t_lw:>7.2f}")


if __name__ == "__main__":
    main()

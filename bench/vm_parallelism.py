"""Does this machine really run P processes at once right now? Times a fixed CPU-bound loop
in one process, then in P processes started together, and prints P * t(one) / t(P): about P
when every process has a core of its own, about 1 when they share one.

Why: the 2-core development VM's two vCPUs sometimes share one host CPU for minutes (this
script printed 0.72-0.80 then, 1.8-2.2 otherwise, with nothing else running in the VM). In
that mode two ranks that spin on each other crawl (Open MPI's 16 MiB all_reduce took 92 ms
instead of ~6 ms; linkwise, which sleeps on a futex after 50 us, ~5 ms instead of ~2.5 ms),
so 2-rank comparisons taken then mean little. Check before and after a measurement:

    python3 bench/vm_parallelism.py [-p 2] [--min 1.7]    # exit status 1 below --min
"""
import argparse
import multiprocessing as mp
import sys
import time


def _spin(n: int) -> None:
    x = 0
    for i in range(n):
        x += i


def _timed(procs: int, n: int) -> float:
    ps = [mp.Process(target=_spin, args=(n,)) for _ in range(procs)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", "--procs", type=int, default=2)
    ap.add_argument("-n", type=int, default=3_000_000, help="loop iterations per process")
    ap.add_argument("--min", type=float, default=0.0, help="exit 1 when the parallelism is below this")
    args = ap.parse_args()
    one = _timed(1, args.n)  # includes one process start, as the P-process run does
    many = _timed(args.procs, args.n)
    par = args.procs * one / many
    print(f"parallelism {par:.2f} of {args.procs} (one process {one * 1e3:.0f} ms, "
          f"{args.procs} at once {many * 1e3:.0f} ms)")
    return 0 if par >= args.min else 1


if __name__ == "__main__":
    sys.exit(main())

"""Dask comms side by side: linkwise:// against Dask's own tcp:// between two processes of one
host. For each size, a message {"x": to_serialize(array of that many bytes)} goes to an echo
process and back (Dask's array serializer, as a worker's data transfer uses); the two
protocols alternate in rounds so that both see the same machine noise. Prints the median
round trip and the bandwidth (2 x size / time) of each, and their ratio.

    python3 bench/dask_comm_vs_tcp.py [--sizes 1K,64K,1M,16M,128M] [--iters 20] [--rounds 3]
"""
import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
from distributed.comm import connect
from distributed.protocol import to_serialize

import linkwise
from linkwise import dask_comm  # noqa: F401 - registers linkwise://

ECHO = textwrap.dedent("""
    import asyncio, sys
    from distributed.comm import listen
    from linkwise import dask_comm

    async def main(protocol):
        async def handle(comm):
            while True:
                await comm.write(await comm.read())
        listener = listen(f"{protocol}://127.0.0.1:0", handle)
        await listener.start()
        print(listener.contact_address, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1]))
""")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


async def _round_trips(comm, nbytes: int, iters: int) -> float:
    x = np.ones(nbytes, np.uint8)
    for _ in range(2):  # warm: buffers, page faults
        await comm.write({"x": to_serialize(x)})
        await comm.read()
    t0 = time.perf_counter()
    for _ in range(iters):
        await comm.write({"x": to_serialize(x)})
        await comm.read()
    return (time.perf_counter() - t0) / iters


async def main(args) -> None:
    src = os.path.dirname(os.path.dirname(os.path.abspath(linkwise.__file__)))
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    protocols = ["tcp", "linkwise"]
    peers, comms = [], {}
    try:
        for p in protocols:
            proc = subprocess.Popen([sys.executable, "-c", ECHO, p], stdout=subprocess.PIPE, env=env, text=True)
            peers.append(proc)
            comms[p] = await connect(proc.stdout.readline().strip())
        times = {(p, s): [] for p in protocols for s in args.sizes}
        for _ in range(args.rounds):
            for s in args.sizes:
                iters = max(3, min(args.iters, int(2e9 // max(s, 1))))  # about a second or less a point
                for p in protocols:
                    times[p, s].append(await _round_trips(comms[p], s, iters))
        print(f"# Dask comm round trips, two processes of one host ({os.cpu_count()} CPUs); "
              f"medians of {args.rounds} rounds")
        print(f"{'size (B)':>12} {'tcp us':>10} {'tcp GB/s':>9} {'lw us':>10} {'lw GB/s':>9} {'tcp/lw':>7}")
        for s in args.sizes:
            t_tcp, t_lw = (statistics.median(times[p, s]) for p in protocols)
            print(f"{s:>12} {t_tcp * 1e6:>10.1f} {2 * s / t_tcp / 1e9:>9.2f} {t_lw * 1e6:>10.1f} "
                  f"{2 * s / t_lw / 1e9:>9.2f} {t_tcp / t_lw:>7.2f}")
        for c in comms.values():
            await c.close()
    finally:
        for proc in peers:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1K,64K,1M,16M,128M", type=lambda t: [_size(x) for x in t.split(",")])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(ap.parse_args()))

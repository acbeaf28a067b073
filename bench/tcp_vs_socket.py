"""TCP over loopback: linkwise (LINKWISE_TRANSPORT=tcp) vs a plain Python socket pair.

    python bench/tcp_vs_socket.py [--reps 5] [--sizes 4M,16M,64M]

For each repetition, back to back: `linkwise bench p2p --tests bw` over forced TCP (a window
of isends from rank 0 to rank 1, 4-byte ack per window), then two processes streaming the
same messages over a TCP connection on 127.0.0.1 with socket.sendall / recv_into (one ack at
the end). Medians are reported. Target (issue 2): linkwise >= 80% of the plain sockets.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

from _run import linkwise_bench, verdict

_BYTES = 1 << 30  # bytes streamed per point


def _receiver(port_q, size: int, count: int) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(size))
    for _ in range(count):
        got = 0
        while got < size:
            n = conn.recv_into(buf[got:], size - got)
            if n == 0:
                raise ConnectionError("sender went away")
            got += n
    conn.sendall(b"k")
    conn.close()
    srv.close()


def socket_stream(size: int) -> float:
    """GB/s of one TCP connection on loopback streaming messages of size bytes."""
    count = max(8, _BYTES // size)
    warm = 2
    q = mp.Queue()
    p = mp.Process(target=_receiver, args=(q, size, count + warm))
    p.start()
    s = socket.create_connection(("127.0.0.1", q.get()))
    buf = bytearray(size)
    for _ in range(warm):
        s.sendall(buf)
    t0 = time.perf_counter()
    for _ in range(count):
        s.sendall(buf)
    s.recv(1)
    dt = time.perf_counter() - t0
    s.close()
    p.join()
    return size * count / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="4M,16M,64M")
    a = ap.parse_args()
    from linkwise.bench.common import parse_size
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    lw: dict[int, list[float]] = {s: [] for s in sizes}
    sk: dict[int, list[float]] = {s: [] for s in sizes}
    for _ in range(a.reps):
        for size in sizes:
            doc = linkwise_bench("p2p", "-b", str(size), "-e", str(size), "--tests", "bw",
                                 env={"LINKWISE_TRANSPORT": "tcp"}, echo=False)
            lw[size].append(doc["systems"]["linkwise"]["rows"][0]["bw_GBps"])
            sk[size].append(socket_stream(size))
    print(f"{'size':>8} {'linkwise tcp GB/s':>18} {'python socket GB/s':>19} {'ratio':>6}  target >= 0.80")
    for size in sizes:
        a_, b_ = statistics.median(lw[size]), statistics.median(sk[size])
        print(f"{size >> 20:>4} MiB {a_:18.3f} {b_:19.3f} {a_ / b_:6.2f}  {verdict(a_ >= 0.8 * b_)}"
              f"   (runs: lw {', '.join(f'{x:.2f}' for x in lw[size])}; "
              f"socket {', '.join(f'{x:.2f}' for x in sk[size])})")


if __name__ == "__main__":
    main()

"""linkwise bench p2p: -c checks the bytes received, and the collectives' flags it has no use
for (-d, -o, -r) are refused instead of ignored; -N is bounded when bench starts the ranks."""
from __future__ import annotations

import json
import queue
import threading

import numpy as np
import pytest

from linkwise.bench import p2p
from test_bench import bench


class _Posted:
    """A request: sends complete when posted (queued), receives when waited for."""

    def __init__(self, receive=None):
        self.receive = receive


class ThreadPair:
    """Two ranks as two threads of this process, joined by queues: the Backend interface the
    p2p loops use. `flip` makes rank 0's byte messages (or rank 1's, with flip_from=1) arrive
    with their first byte zeroed, as a transport that corrupts data would (the harness's int64
    counts pass unchanged)."""

    def __init__(self, flip: bool = False, flip_from: int = 0):
        self.boxes = {0: queue.Queue(), 1: queue.Queue()}
        self.gate = threading.Barrier(2)
        self.flip, self.flip_from = flip, flip_from

    def rank_view(self, rank: int):
        pair = self

        class View:
            name, size = "pair", 2

            def __init__(self):
                self.rank = rank

            def send(self, buf, peer):
                data = np.array(buf, copy=True)
                if pair.flip and rank == pair.flip_from and data.dtype == np.uint8:
                    data[0] = 0
                pair.boxes[peer].put(data)

            def recv(self, buf, peer):
                buf[...] = pair.boxes[rank].get(timeout=30)

            def isend(self, buf, peer):
                self.send(buf, peer)
                return _Posted()

            def irecv(self, buf, peer):
                return _Posted(lambda: self.recv(buf, peer))

            def waitall(self, reqs):
                for req in reqs:
                    if req.receive:
                        req.receive()

            def barrier(self):
                pair.gate.wait(timeout=30)
        return View()


def _run_pair(pair: ThreadPair, **kw) -> list[dict]:
    """Rank 0's rows of p2p.run_sweep with both ranks in threads."""
    out = {}

    def body(rank):
        out[rank] = p2p.run_sweep(pair.rank_view(rank), [1, 7, 4096], ["latency", "bw", "bibw"],
                                  iters=12, warmup=2, window=3, **kw)
    threads = [threading.Thread(target=body, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == {0, 1}
    return out[0]


def test_the_check_counts_no_wrong_bytes_when_the_transport_is_right():
    rows = _run_pair(ThreadPair(), check=True)
    assert [r["wrong"] for r in rows] == [0, 0, 0]
    assert all(r["latency_us"] > 0 and r["bw_GBps"] > 0 for r in rows)


@pytest.mark.parametrize("flip_from", [0, 1])
def test_the_check_counts_wrong_bytes_from_either_side(flip_from):
    """One corrupted byte a message: latency (rank 0's echo), bw (rank 1's buffer, sent back
    to rank 0 as a count) and bibw (both buffers) each see it once at the end."""
    rows = _run_pair(ThreadPair(flip=True, flip_from=flip_from), check=True)
    # latency: the echo holds the flipped byte once (rank 0 flips it going out, or rank 1 on
    # the way back); bw: only rank 0 sends data; bibw: both directions, one received by each.
    bw_wrong = 1 if flip_from == 0 else 0
    assert [r["wrong"] for r in rows] == [1 + bw_wrong + 1] * 3, rows


def test_without_the_check_there_is_no_count():
    rows = _run_pair(ThreadPair(flip=True), check=False)
    assert all("wrong" not in r for r in rows)


def test_the_pattern_differs_from_zeros_and_between_sizes():
    assert np.count_nonzero(p2p.pattern(1000)) == 1000
    assert not np.array_equal(p2p.pattern(300), p2p.pattern(301)[:300])


def test_p2p_table_has_the_wrong_column_and_a_verdict(tmp_path):
    out = tmp_path / "p2p.json"
    r = bench("p2p", "-b", "8", "-e", "512", "-f", "8", "-n", "20", "-w", "2", "--no-progress",
              "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "#wrong" in r.stdout and "# Wrong bytes received : 0 OK" in r.stdout, r.stdout
    rows = json.loads(out.read_text())["systems"]["linkwise"]["rows"]
    assert [row["wrong"] for row in rows] == [0, 0, 0]
    r = bench("p2p", "-b", "8", "-e", "8", "-n", "20", "-w", "2", "-c", "0", "--no-progress")
    assert r.returncode == 0 and "#wrong" not in r.stdout, (r.stdout, r.stderr)


@pytest.mark.parametrize("flags", [["-d", "int8"], ["-o", "max"], ["-r", "1"], ["-d", "float", "-r", "0"]])
def test_p2p_refuses_the_collectives_flags(flags):
    """Before, p2p ignored them silently (a -d int8 sweep measured bytes all the same)."""
    r = bench("p2p", "-b", "8", "-e", "8", "--no-progress", *flags)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    line = r.stderr.strip()
    assert line.startswith("linkwise bench: -") and "p2p moves bytes" in line, line
    assert all(f in line for f in flags if f.startswith("-")), line


def test_a_huge_rank_count_is_refused_before_any_rank_starts():
    r = bench("all_reduce", "-N", "100000", "-b", "8", "-e", "8", "--no-progress")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.startswith("linkwise bench: -N 100000: more than 16 ranks for each"), r.stderr


def test_p2p_of_0_bytes_at_most_is_refused():
    """Before, -e 0 measured (and showed) a 1-byte message, larger than -e."""
    r = bench("p2p", "-b", "0", "-e", "0", "-n", "10", "-w", "2", "--no-progress")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip() == "linkwise bench: -e 0: p2p measures messages of 1 byte or more"

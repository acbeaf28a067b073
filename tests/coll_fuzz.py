"""Random sequences of CPU collectives, each checked against the NumPy reference.

    linkwise launch -n 3 tests/coll_fuzz.py            # FUZZ_SECONDS=60 FUZZ_SEED=1 by default
    FUZZ_SPLIT=1 FUZZ_ASYNC=1 linkwise launch -n 5 tests/coll_fuzz.py

Every rank of a communicator draws the same sequence (one seed per communicator): collective,
dtype, op, size (around the paths' thresholds: one-shot, CMA, lanes, streamed stores), root,
in place or out, and a buffer offset by one element (misaligned). FUZZ_ASYNC=1 leaves some
all_reduce/broadcast calls pending for a few calls before waiting and checking them;
FUZZ_SPLIT=1 runs on comm.split(rank % 2) with the keys reversed. The ranks agree to stop
through a world all_reduce each step (a rank that stopped alone would leave a peer in a
collective nobody joins). Rank 0 prints "FUZZ OK <size> ranks <cases> cases seed <seed>";
a wrong element raises AssertionError naming the case.
"""
import os
import time
from dataclasses import dataclass

import numpy as np
from coll_ref import DTYPES, INT, check_equal, data, np_dtype, ops_for, reduce_ref

import linkwise

COLLECTIVES = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "gather", "scatter"]
BLOCKED = ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter")  # size = per rank
SIZES = [0, 1, 3, 63, 64, 65, 1023, 4096, 8191, 8197, 32 << 10, (32 << 10) + 8, 65537,
         (256 << 10) - 8, 256 << 10, (256 << 10) + 24, 1 << 20, (1 << 20) + 3, 3 << 20,
         (8 << 20) + 16]


@dataclass
class Case:
    """One drawn step; every rank of the communicator draws the same (r is this rank)."""
    n: int
    r: int
    dt: str
    op: str
    count: int
    root: int
    inplace: bool
    off: int      # buffer offset in elements (1: misaligned)
    defer: bool   # leave the call pending (async) where the collective allows it
    salt: int
    fl: bool      # float avg: compared with a tolerance
    tag: str


class Fuzz:
    def __init__(self, comm, rng, use_async: bool):
        self.comm, self.rng, self.use_async = comm, rng, use_async
        self.pending = []  # (request, check) of calls not waited for yet
        self.cases = 0

    def buf(self, a: np.ndarray, offset: int) -> np.ndarray:
        """A copy of a that starts `offset` elements into a fresh allocation."""
        b = np.empty(a.size + offset, a.dtype)[offset:]
        b[...] = a
        return b

    def step(self) -> None:
        comm, rng = self.comm, self.rng
        n, r = comm.size, comm.rank
        coll = str(rng.choice(COLLECTIVES))
        dt = str(rng.choice(DTYPES))
        op = str(rng.choice(ops_for(dt)))
        count = int(rng.choice(SIZES)) // np.dtype(np_dtype(dt)).itemsize
        if coll in BLOCKED:
            count //= n
        root, inplace, off = int(rng.integers(0, n)), bool(rng.integers(0, 2)), int(rng.integers(0, 2))
        tag = (f"{coll} {dt} {op} count={count} root={root} inplace={inplace} offset={off} "
               f"n={n} case={self.cases}")
        getattr(self, coll)(Case(n, r, dt, op, count, root, inplace, off,
                                 self.use_async and bool(rng.integers(0, 2)), self.cases,
                                 op == "avg" and dt not in INT, tag))
        self.cases += 1
        if len(self.pending) > int(rng.integers(0, 6)):
            self.drain()

    def drain(self) -> None:
        for req, check in self.pending:
            req.wait()
            check()
        self.pending.clear()

    def all_reduce(self, c: Case):
        ins = [data(q, c.count, c.dt, c.op, c.salt) for q in range(c.n)]
        want = reduce_ref(ins, c.op, c.dt)
        x = self.buf(ins[c.r], c.off)
        if c.inplace and c.defer:
            req = self.comm.all_reduce(x, op=c.op, async_op=True)
            self.pending.append((req, lambda: check_equal(x, want, c.tag + " async", c.fl)))
        elif c.inplace:
            self.comm.all_reduce(x, op=c.op)
            check_equal(x, want, c.tag, c.fl)
        else:
            out = self.buf(np.zeros_like(ins[c.r]), c.off)
            self.comm.all_reduce(x, op=c.op, out=out)
            check_equal(out, want, c.tag, c.fl)
            check_equal(x, ins[c.r], c.tag + " input untouched")

    def broadcast(self, c: Case):
        src = data(c.root, c.count, c.dt, "sum", c.salt)
        x = self.buf(src if c.r == c.root else np.zeros_like(src), c.off)
        if c.defer:
            req = self.comm.broadcast(x, root=c.root, async_op=True)
            self.pending.append((req, lambda: check_equal(x, src, c.tag + " async")))
        elif c.inplace or c.r != c.root:
            self.comm.broadcast(x, root=c.root)
            check_equal(x, src, c.tag)
        else:
            out = self.buf(np.zeros_like(src), c.off)
            self.comm.broadcast(x, root=c.root, out=out)
            check_equal(out, src, c.tag)
            check_equal(x, src, c.tag + " input untouched")

    def reduce(self, c: Case):
        ins = [data(q, c.count, c.dt, c.op, c.salt) for q in range(c.n)]
        x = self.buf(ins[c.r], c.off)
        self.comm.reduce(x, root=c.root, op=c.op)
        check_equal(x, reduce_ref(ins, c.op, c.dt) if c.r == c.root else ins[c.r], c.tag, c.fl)

    def all_gather(self, c: Case):
        ins = [data(q, c.count, c.dt, "sum", c.salt) for q in range(c.n)]
        check_equal(self.comm.all_gather(self.buf(ins[c.r], c.off)), np.concatenate(ins), c.tag)

    @staticmethod
    def _blocks(c: Case, op: str):
        """Per rank: n blocks of count elements."""
        return [np.concatenate([data(q, c.count, c.dt, op, c.salt * 31 + b) for b in range(c.n)])
                for q in range(c.n)]

    @staticmethod
    def _mine(a: np.ndarray, c: Case) -> np.ndarray:
        """Block r of an array of n blocks."""
        return a[c.r * c.count:(c.r + 1) * c.count]

    def reduce_scatter(self, c: Case):
        xs = self._blocks(c, c.op)
        got = self.comm.reduce_scatter(self.buf(xs[c.r], c.off), op=c.op)
        check_equal(got, self._mine(reduce_ref(xs, c.op, c.dt), c), c.tag, c.fl)

    def all_to_all(self, c: Case):
        xs = self._blocks(c, "sum")
        out = self.buf(np.zeros_like(xs[c.r]), c.off)
        self.comm.all_to_all(self.buf(xs[c.r], c.off), out=out)
        check_equal(out, np.concatenate([self._mine(x, c) for x in xs]), c.tag)

    def gather(self, c: Case):
        ins = [data(q, c.count, c.dt, "sum", c.salt) for q in range(c.n)]
        got = self.comm.gather(self.buf(ins[c.r], c.off), root=c.root)
        if c.r == c.root:
            check_equal(got, np.concatenate(ins), c.tag)
        else:
            assert got is None, c.tag

    def scatter(self, c: Case):
        full = np.concatenate([data(q, c.count, c.dt, "sum", c.salt) for q in range(c.n)])
        out = self.buf(np.zeros(c.count, full.dtype), c.off)
        send = self.buf(full, c.off) if c.r == c.root else None
        check_equal(self.comm.scatter(send, root=c.root, out=out), self._mine(full, c), c.tag)


def main() -> None:
    world = linkwise.init()
    split = os.environ.get("FUZZ_SPLIT") == "1"
    comm = world.split(world.rank % 2, -world.rank) if split else world
    seed = int(os.environ.get("FUZZ_SEED", "1"))
    # one sequence per communicator: the same on all of its ranks
    fuzz = Fuzz(comm, np.random.default_rng([seed, world.rank % 2 if split else 0]),
                os.environ.get("FUZZ_ASYNC") == "1")
    deadline = time.monotonic() + float(os.environ.get("FUZZ_SECONDS", "60"))
    flag = np.zeros(1, np.int32)
    while True:
        flag[0] = time.monotonic() > deadline
        if world.all_reduce(flag, op="max")[0]:
            break
        fuzz.step()
    fuzz.drain()
    world.barrier()
    if comm.rank == 0:
        print(f"FUZZ OK {comm.size} ranks {fuzz.cases} cases seed {seed}", flush=True)
    world.close()


if __name__ == "__main__":
    main()

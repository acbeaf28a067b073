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

import numpy as np
from coll_ref import DTYPES, INT, check_equal, data, np_dtype, ops_for, reduce_ref

import linkwise

COLLECTIVES = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "gather", "scatter"]
BLOCKED = ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter")  # size = per rank
SIZES = [0, 1, 3, 63, 64, 65, 1023, 4096, 8191, 8197, 32 << 10, (32 << 10) + 8, 65537,
         (256 << 10) - 8, 256 << 10, (256 << 10) + 24, 1 << 20, (1 << 20) + 3, 3 << 20,
         (8 << 20) + 16]


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
        defer = self.use_async and bool(rng.integers(0, 2))
        salt, fl = self.cases, op == "avg" and dt not in INT
        tag = (f"{coll} {dt} {op} count={count} root={root} inplace={inplace} offset={off} "
               f"n={n} case={self.cases}")
        getattr(self, coll)(n, r, dt, op, count, root, inplace, off, defer, salt, fl, tag)
        self.cases += 1
        if len(self.pending) > int(rng.integers(0, 6)):
            self.drain()

    def drain(self) -> None:
        for req, check in self.pending:
            req.wait()
            check()
        self.pending.clear()

    def all_reduce(self, n, r, dt, op, count, root, inplace, off, defer, salt, fl, tag):
        ins = [data(q, count, dt, op, salt) for q in range(n)]
        want = reduce_ref(ins, op, dt)
        x = self.buf(ins[r], off)
        if inplace and defer:
            req = self.comm.all_reduce(x, op=op, async_op=True)
            self.pending.append((req, lambda: check_equal(x, want, tag + " async", fl)))
        elif inplace:
            self.comm.all_reduce(x, op=op)
            check_equal(x, want, tag, fl)
        else:
            out = self.buf(np.zeros_like(ins[r]), off)
            self.comm.all_reduce(x, op=op, out=out)
            check_equal(out, want, tag, fl)
            check_equal(x, ins[r], tag + " input untouched")

    def broadcast(self, n, r, dt, op, count, root, inplace, off, defer, salt, fl, tag):
        src = data(root, count, dt, "sum", salt)
        x = self.buf(src if r == root else np.zeros_like(src), off)
        if defer:
            req = self.comm.broadcast(x, root=root, async_op=True)
            self.pending.append((req, lambda: check_equal(x, src, tag + " async")))
        elif inplace or r != root:
            self.comm.broadcast(x, root=root)
            check_equal(x, src, tag)
        else:
            out = self.buf(np.zeros_like(src), off)
            self.comm.broadcast(x, root=root, out=out)
            check_equal(out, src, tag)
            check_equal(x, src, tag + " input untouched")

    def reduce(self, n, r, dt, op, count, root, inplace, off, defer, salt, fl, tag):
        ins = [data(q, count, dt, op, salt) for q in range(n)]
        x = self.buf(ins[r], off)
        self.comm.reduce(x, root=root, op=op)
        check_equal(x, reduce_ref(ins, op, dt) if r == root else ins[r], tag, fl)

    def all_gather(self, n, r, dt, op, count, root, inplace, off, defer, salt, fl, tag):
        ins = [data(q, count, dt, "sum", salt) for q in range(n)]
        check_equal(self.comm.all_gather(self.buf(ins[r], off)), np.concatenate(ins), tag)

    def _blocks(self, n, count, dt, op, salt):
        """Per rank: n blocks of count elements."""
        return [np.concatenate([data(q, count, dt, op, salt * 31 + b) for b in range(n)])
                for q in range(n)]

    def reduce_scatter(self, n, r, dt, op, count, root, inplace, off, defer, salt, fl, tag):
        xs = self._blocks(n, count, dt, op, salt)
        full = reduce_ref(xs, op, dt)
        got = self.comm.reduce_scatter(self.buf(xs[r], off), op=op)
        check_equal(got, full[r * count:(r + 1) * count], tag, fl)

    def all_to_all(self, n, r, dt, op, count, root, inplace, off, defer, salt, fl, tag):
        xs = self._blocks(n, count, dt, "sum", salt)
        out = self.buf(np.zeros_like(xs[r]), off)
        self.comm.all_to_all(self.buf(xs[r], off), out=out)
        check_equal(out, np.concatenate([xs[q][r * count:(r + 1) * count] for q in range(n)]), tag)

    def gather(self, n, r, dt, op, count, root, inplace, off, defer, salt, fl, tag):
        ins = [data(q, count, dt, "sum", salt) for q in range(n)]
        got = self.comm.gather(self.buf(ins[r], off), root=root)
        if r == root:
            check_equal(got, np.concatenate(ins), tag)
        else:
            assert got is None, tag

    def scatter(self, n, r, dt, op, count, root, inplace, off, defer, salt, fl, tag):
        full = np.concatenate([data(q, count, dt, "sum", salt) for q in range(n)])
        out = self.buf(np.zeros(count, full.dtype), off)
        got = self.comm.scatter(self.buf(full, off) if r == root else None, root=root, out=out)
        check_equal(got, full[r * count:(r + 1) * count], tag)


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

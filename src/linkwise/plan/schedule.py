"""Schedules: which algorithm a collective runs and in what shape, as plain data.

A Schedule is a value (a frozen dataclass of ints and tuples): it can be printed, saved,
compared and simulated, and the native executors receive its fields as lists of ints. The
neighbour functions here are pure and are property-tested for every size from 1 to 64.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

ALGOS = ("ring", "tree", "chain", "direct")


@dataclass(frozen=True)
class Schedule:
    """How one collective runs on one rank.

    algorithm: "ring" | "tree" | "chain" | "direct".
    ring_order: the ring as a permutation of ranks (position i sends to position i+1).
    parent / children: this rank's place in the broadcast/reduce tree (parent -1 at the root;
    a chain is a tree whose nodes have one child each).
    chain_order: the chain from the root outward, when algorithm == "chain".
    chunk_bytes: pipelining unit.
    """

    algorithm: str
    chunk_bytes: int
    ring_order: tuple[int, ...] = ()
    parent: int = -1
    children: tuple[int, ...] = ()
    chain_order: tuple[int, ...] = field(default=())


def ring_peers(order: Sequence[int], rank: int) -> tuple[int, int]:
    """(left, right) of `rank` in the ring `order`: it receives from left and sends to right.

        order = [0, 2, 1, 3]:   0 ──▶ 2 ──▶ 1 ──▶ 3
                                ▲                  │
                                └──────────────────┘
        ring_peers(order, 1) == (2, 3)
    """
    n = len(order)
    pos = list(order).index(rank)
    return order[(pos - 1) % n], order[(pos + 1) % n]


def tree_parent_children(n: int, rank: int, root: int = 0) -> tuple[int, list[int]]:
    """Binomial tree over n ranks rooted at `root`: (parent or -1, children).

    Ranks are renumbered v = (rank - root) mod n; v's parent clears v's lowest set bit, and
    its children are v + 2^k for every 2^k below v's lowest set bit (largest first, so the
    biggest subtree starts first). n = 8, root = 0:

                 0
            ┌────┼────┐
            4    2    1
          ┌─┴┐   │
          6  5   3
          │
          7
    """
    if not 0 <= rank < n or not 0 <= root < n:
        raise ValueError(f"rank {rank} and root {root} must be in 0..{n - 1}")
    v = (rank - root) % n
    parent = -1 if v == 0 else ((v & (v - 1)) + root) % n
    low = v & -v if v else 1 << max(n - 1, 1).bit_length()
    children = []
    k = low >> 1
    while k:
        if v + k < n:
            children.append((v + k + root) % n)
        k >>= 1
    return parent, children


def chain_parent_children(order: Sequence[int], rank: int) -> tuple[int, list[int]]:
    """A chain root ─▶ order[1] ─▶ order[2] ─▶ ... (order[0] is the root):

        order = [2, 0, 1, 3]:   2 ──▶ 0 ──▶ 1 ──▶ 3
        chain_parent_children(order, 1) == (0, [3])
    """
    pos = list(order).index(rank)
    parent = order[pos - 1] if pos > 0 else -1
    children = [order[pos + 1]] if pos + 1 < len(order) else []
    return parent, children


# Default choices by message size (bytes). Tuned on a 2-core machine; a tuner may replace them.
SMALL_ALLREDUCE = 16 << 10      # direct (one-shot) below this with few ranks
MEDIUM_ALLREDUCE = 256 << 10    # recursive doubling below this, ring above
SMALL_BCAST = 64 << 10          # binomial tree below this, pipelined chain above
DEFAULT_CHUNK = 512 << 10


# A broadcast between two ranks at least this large goes point-to-point as one message (one
# copy) instead of through the shared-memory executor (two copies).
LARGE_PAIR_BCAST = 8 << 20


def default_schedule(kind: str, n: int, rank: int, root: int, nbytes: int,
                     algo: Optional[str] = None, chunk: Optional[int] = None,
                     order: Optional[Sequence[int]] = None) -> Schedule:
    """The schedule for one call. `algo`/`chunk` override (LINKWISE_ALGO, LINKWISE_CHUNK_SIZE);
    an algorithm that does not apply to `kind` falls back to the default for it."""
    order = tuple(range(n)) if order is None else tuple(order)
    chunk = int(chunk or DEFAULT_CHUNK)
    if kind == "all_reduce":
        if algo not in ("ring", "tree", "direct"):
            if nbytes <= SMALL_ALLREDUCE and n <= 4:
                algo = "direct"
            elif nbytes < MEDIUM_ALLREDUCE:
                algo = "tree"
            else:
                algo = "ring"
        return Schedule(algo, chunk, ring_order=order)
    if kind in ("broadcast", "reduce"):
        if algo not in ("tree", "chain", "direct"):
            algo = "tree" if nbytes < SMALL_BCAST else "chain"
        if kind == "broadcast" and n == 2 and chunk == DEFAULT_CHUNK and nbytes >= LARGE_PAIR_BCAST:
            # Two ranks: the whole broadcast is one message, pulled in a single copy where the
            # link allows it; cutting it into chunks only adds per-message costs.
            chunk = max(chunk, nbytes)
        if algo == "chain":
            rot = tuple(order[(order.index(root) + i) % n] for i in range(n))
            # Reduce uses the same chain: data flows from the far end toward the root.
            parent, children = chain_parent_children(rot, rank)
            return Schedule(algo, chunk, parent=parent, children=tuple(children), chain_order=rot)
        if algo == "direct":  # the root talks to everyone
            parent, children = (-1, [r for r in range(n) if r != root]) if rank == root else (root, [])
            return Schedule(algo, chunk, parent=parent, children=tuple(children))
        parent, children = tree_parent_children(n, rank, root)
        return Schedule(algo, chunk, parent=parent, children=tuple(children))
    if kind in ("all_gather", "reduce_scatter"):
        return Schedule("ring", chunk, ring_order=order)
    return Schedule("direct", chunk)

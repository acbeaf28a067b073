"""Planning: how a collective is laid over the ranks (ring orders, trees, chains).

A :class:`Schedule` is a plain value; the native executors take its fields as lists of ints.
"""
from .schedule import (ALGOS, Schedule, chain_parent_children, default_schedule, ring_peers,
                       tree_parent_children)

__all__ = ["ALGOS", "Schedule", "chain_parent_children", "default_schedule", "ring_peers",
           "tree_parent_children"]

"""The variables ``linkwise launch`` works out for each rank (OMP_NUM_THREADS; with ``--bind
auto``, LINKWISE_DEVICE and LINKWISE_SOCKET_IFNAME), and how a launch nested in a rank of
another tells the outer launcher's values from the user's.

Contract: each rank gets LINKWISE_LAUNCH_SET, a JSON object of those variables its launcher set
for it, with their values (absent when it set none). A ``linkwise launch`` started inside that
rank takes a variable whose value is still the recorded one as the outer launcher's, not as one
the user chose (a value set before the outer launch, or changed in the rank since, is the
user's and kept):
  * OMP_NUM_THREADS: the outer value is the CPUs the outer launcher gave this rank; each inner
    rank gets its ``--bind`` slice's count, else that count divided among the inner ranks (at
    least 1; with one inner rank, the value itself);
  * LINKWISE_DEVICE, LINKWISE_SOCKET_IFNAME: an inner ``--bind auto`` works them out afresh for
    each of its ranks (left unset where it finds no GPU or NIC); without it the inner ranks keep
    the outer rank's, as they keep its CPU affinity.
Called by launch.py only, from the thread that starts the ranks.
"""
from __future__ import annotations

import json
from typing import Mapping, Optional

RECORD = "LINKWISE_LAUNCH_SET"
THREADS = "OMP_NUM_THREADS"
BOUND = ("LINKWISE_DEVICE", "LINKWISE_SOCKET_IFNAME")  # what --bind auto sets (binding_env)


def outer_values(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that an outer ``linkwise launch`` set for this process and
    that still have the value it gave them ({} outside a launch, or for an unreadable record)."""
    try:
        recorded = json.loads(environ.get(RECORD) or "{}")
    except ValueError:
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {k: v for k, v in recorded.items() if k in (THREADS, *BOUND) and environ.get(k) == v}


def users_environ(environ: Mapping[str, str], outer: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the outer launcher's values: what the user set (for binding_env, which
    keeps a LINKWISE_SOCKET_IFNAME the user set)."""
    return {k: v for k, v in environ.items() if k not in outer}


def _cpu_budget(outer: Mapping[str, str]) -> Optional[int]:
    """The CPUs an outer launcher gave this rank (its OMP_NUM_THREADS), None if it set none."""
    value = outer.get(THREADS, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def complete_rank_env(env: dict, outer: Mapping[str, str], *, auto: bool, n: int, cpus: list[int],
                      allowed: int, bound: Mapping[str, str]) -> None:
    """Finish one rank's environment `env` (the launcher's own environment with the rank's
    LINKWISE_* variables) in place: OMP_NUM_THREADS, `bound` (the variables --bind auto gave
    this rank; `auto`: --bind auto was asked for), and the LINKWISE_LAUNCH_SET record.
    `cpus`: the rank's binding (empty: unbound); `allowed`: how many CPUs this launcher may use."""
    record = {}
    for name in BOUND:
        if name in bound:
            env[name] = record[name] = bound[name]
        elif name in outer and auto:  # worked out afresh, and none found for this rank
            env.pop(name, None)
        elif name in outer:  # kept: the outer rank's GPU or NIC
            record[name] = outer[name]
    budget = _cpu_budget(outer)
    if budget is not None or (n > 1 and THREADS not in env):
        # As torchrun: ranks that each start an OpenMP (or BLAS, torch) thread a CPU would run
        # n threads on every CPU. A bound rank gets its slice's count.
        share = max(1, (budget or allowed) // n)
        env[THREADS] = record[THREADS] = str(len(cpus) if cpus else share)
    if record:
        env[RECORD] = json.dumps(record)
    else:
        env.pop(RECORD, None)  # an outer launch's, which no longer describes this rank

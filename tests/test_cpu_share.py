"""How many CPUs a rank counts as its own (helper threads, spinning): _setup.cpus_per_rank
from every rank's card, and what a communicator made of it under real affinities."""
import os

import pytest

from linkwise._setup import PeerCard, cpus_per_rank
from multirank import run_ranks


def cards(*masks, hosts=None):
    hosts = hosts or ["h"] * len(masks)
    return [PeerCard(rank=r, host=hosts[r], pid=1, cpus=format(m, "x") if m is not None else "")
            for r, m in enumerate(masks)]


ALL64 = (1 << 64) - 1


def test_unbound_ranks_share_the_host():
    c = cards(*[ALL64] * 16)
    assert cpus_per_rank(c, 3, 16) == 4.0
    assert cpus_per_rank(cards(ALL64, ALL64), 0, 2) == 32.0


def test_ranks_bound_to_disjoint_slices_keep_their_slice():
    c = cards(*[0xF << (4 * r) for r in range(16)])  # 16 ranks, 4 CPUs each (--bind cpu)
    assert [cpus_per_rank(c, r, 16) for r in (0, 15)] == [4.0, 4.0]
    c = cards(0b01, 0b10)  # two ranks bound to one CPU each
    assert cpus_per_rank(c, 1, 2) == 1.0


def test_overlapping_or_oversubscribed():
    assert cpus_per_rank(cards(0b11, 0b11, 0b11), 0, 3) == pytest.approx(2 / 3)
    assert cpus_per_rank(cards(0b1, 0b1), 0, 2) == 0.5  # two ranks on one CPU
    # A split communicator sees only its own ranks' cards; the job's ranks on the host count.
    assert cpus_per_rank(cards(ALL64, ALL64), 0, 16) == 4.0


def test_only_this_hosts_ranks_count():
    c = cards(0xF, 0xF0, 0xF, hosts=["a", "a", "b"])
    assert cpus_per_rank(c, 0, 2) == 4.0
    assert cpus_per_rank(c, 2, 1) == 4.0


def test_a_card_without_mask_means_any_cpu():
    n = os.cpu_count() or 1
    assert cpus_per_rank(cards(None, None), 0, 2) == n / 2


def _share(comm):
    return comm._cpus_per_rank, sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_communicator_counts_bound_ranks_by_their_slice():
    """Each rank binds itself to one CPU of this machine before init (as --bind cpu does): a
    rank then counts that CPU as its own when there are as many CPUs as ranks (not CPUs /
    ranks, which would make it sleep at once and run no helper threads); unbound ranks
    share the CPUs."""
    ncpu = len(os.sched_getaffinity(0))
    for share, cpus in run_ranks(2, _bind_then_share, init=False):
        assert len(cpus) == 1
        assert share == (1.0 if ncpu >= 2 else 0.5)
    assert [s for s, _ in run_ranks(2, _share)] == [ncpu / 2] * 2


def _bind_then_share(rank, n):
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    import linkwise
    comm = linkwise.init()
    try:
        return _share(comm)
    finally:
        comm.close()

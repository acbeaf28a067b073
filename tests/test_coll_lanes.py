"""Lanes of the copy-through-shared-memory collectives (algo/shm_coll.cc): a two-shot
all_reduce or ring broadcast cut into stripes that helper threads run as independent
protocols, against the NumPy reference. Every op and dtype, in place and out=, sizes 0, 1,
odd, one round per lane and several rounds (a lane's area is 2 MiB / lanes), 1 to 8 ranks,
ranks with fewer threads than lanes, lane counts changing between calls (the broadcast's
areas move), and a rank killed mid-collective.

LINKWISE_COLL_THREADS forces helper threads (so a 2-core CI machine runs them too),
LINKWISE_COLL_LANE_MIN=4K lets small messages use several lanes, LINKWISE_SHM_CMA=0 keeps
the single-copy paths out, and the executor's lane counters prove the lanes ran."""

import numpy as np
import pytest

from coll_ref import DTYPES, check_all_reduce_matrix, check_bitwise_sum, check_broadcast, check_equal, data, np_dtype
from multirank import collective_until_peer_error, run_ranks

LANE_ENV = {"LINKWISE_COLL_THREADS": "3", "LINKWISE_COLL_LANE_MIN": "4K", "LINKWISE_SHM_CMA": "0"}


def _sizes(dtype: str, big: bool) -> list:
    """Element counts: 0 and 1 (one-shot), just above the one-shot limit (32 KiB; 3 lanes of
    ~11 KB), an odd count of a few lanes, and with `big` several rounds per lane (~2.9 MB)."""
    es = np.dtype(np_dtype(dtype)).itemsize
    sizes = [0, 1, (32 << 10) // es + 3, 60_001]
    return sizes + [2_900_017 // es] if big else sizes


def _all_reduce_matrix(comm, dtypes, big):
    return check_all_reduce_matrix(comm, dtypes, lambda dt, op: _sizes(dt, big and op in ("sum", "max")))


def _lane_calls(comm):
    return comm._shm.lane_calls if comm.size > 1 else (0, 0)


def _all_reduce_body(comm, dtypes, big):
    checked = _all_reduce_matrix(comm, dtypes, big)
    return checked, _lane_calls(comm)


@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_every_dtype_and_op(n):
    got = run_ranks(n, _all_reduce_body, DTYPES, False, env=LANE_ENV, timeout=240)
    for checked, (ar_lanes, _) in got:
        # the two sizes above the one-shot limit of every (dtype, op), both forms, ran on lanes
        assert ar_lanes == checked // 2, (checked, ar_lanes)


@pytest.mark.parametrize("n", [1, 5, 8])
def test_all_reduce_rank_counts(n):
    got = run_ranks(n, _all_reduce_body, ["float32", "int8"], n == 5, env=LANE_ENV, timeout=240)
    if n > 1:
        assert all(ar > 0 for _, (ar, _) in got)


def _uneven_threads_body(comm):
    # LINKWISE_COLL_THREADS (read as the executor is set up, when the communicator is made):
    # rank 0 has 4 threads (4 lanes), the others 1 or 2, so they run several lanes one after
    # another.
    checked = _all_reduce_matrix(comm, ["float32", "int64"], True)
    return checked, _broadcast_matrix(comm, ["float32"], True), _lane_calls(comm)


@pytest.mark.parametrize("n", [3, 5])
def test_fewer_threads_than_lanes(n):
    threads = [str(4 if r == 0 else 1 + r % 2) for r in range(n)]
    got = run_ranks(n, _uneven_threads_body, env=dict(LANE_ENV, LINKWISE_COLL_THREADS=threads), timeout=240)
    for _, _, (ar, bc) in got:
        assert ar > 0 and bc > 0


def _most_lanes_body(comm):
    # 20 threads asked for: the executor caps lanes at 16 (its per-lane counters in the slot
    # header). A 2.9 MB message with 4 KiB lane min runs on all 16, two rounds each.
    checked = _all_reduce_matrix(comm, ["float32", "int64"], True)
    return checked, _broadcast_matrix(comm, ["uint8"], True), comm._shm.max_lanes, _lane_calls(comm)


def test_sixteen_lanes():
    got = run_ranks(3, _most_lanes_body, env=dict(LANE_ENV, LINKWISE_COLL_THREADS="20"), timeout=240)
    for _, _, lanes, (ar, bc) in got:
        assert lanes == 16 and ar > 0 and bc > 0


def _bitwise_body(comm):
    bits = check_bitwise_sum(comm, 300_007)  # 1.2 MB: 3 lanes
    assert comm._shm.lane_calls[0] == 1
    return bits


def test_same_bits_everywhere():
    got = run_ranks(3, _bitwise_body, env=LANE_ENV)
    assert got[0] == got[1] == got[2]


def _broadcast_matrix(comm, dtypes, big):
    """Every root, in place and out=; sizes alternate so the lane count changes between
    calls (1 lane below 8 KiB, 2, 3) and with `big` the ring wraps within a lane."""
    checked = 0
    counts = [0, 1, 7, 2_047, 3_001, 20_011] + ([800_003] if big else [])
    for dt in dtypes:
        for count in counts:
            for root in range(comm.size):
                check_broadcast(comm, dt, count, root)
                checked += 2
    return checked


def _broadcast_body(comm, dtypes, big):
    return _broadcast_matrix(comm, dtypes, big), _lane_calls(comm)


@pytest.mark.parametrize("n,big", [(1, False), (2, True), (3, True), (5, False), (8, False)])
def test_broadcast(n, big):
    got = run_ranks(n, _broadcast_body, ["float32", "uint8"], big, env=LANE_ENV, timeout=240)
    if n > 1:
        assert all(bc > 0 for _, (_, bc) in got)


def _back_to_back_body(comm):
    """Broadcasts of changing size and root with no other collective between them: the
    root of a call may refill ring areas that the previous call's readers still copy from."""
    rng = np.random.default_rng(11)
    for i in range(60):
        count = int(rng.choice([100, 5_000, 40_000, 300_000]))
        root = int(rng.integers(comm.size))
        ref = data(root, count, "int32", "sum", salt=i)
        x = ref.copy() if comm.rank == root else np.zeros(count, np.int32)
        comm.broadcast(x, root=root)
        check_equal(x, ref, f"back-to-back {i} count {count} root {root}")
    return _lane_calls(comm)[1]


def test_broadcast_lane_changes_back_to_back():
    assert all(bc > 0 for bc in run_ranks(4, _back_to_back_body, env=LANE_ENV, timeout=240))


def _die_body(comm, kind):
    peer = collective_until_peer_error(comm, kind, np.ones(300_001, np.float32))
    return f"PeerError peer={peer} lanes={comm._shm.lane_calls}"


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast"])
def test_rank_killed_mid_collective(kind):
    out = run_ranks(3, _die_body, kind, env=LANE_ENV, expect_fail=True, timeout=60)
    assert out[2][0] == "died"
    for status, val in out[:2]:
        assert status == "ok" and val.startswith("PeerError peer=2"), (status, val)

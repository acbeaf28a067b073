"""Out-of-place broadcast through the shared-memory executor (algo/shm_coll.cc, shm_cma.cc):
the root passes x and out to the native call, which copies x into the root's out itself
(while readers pull from x on the CMA path, or after feeding the ring); checked against the
root's data for sizes 0, 1, odd, and larger than a CMA piece / ring piece, blocking and
async, with the root's x untouched and out overlapping x (the memmove fallback)."""
import os

import numpy as np
import pytest

from coll_ref import check_equal, data, np_dtype
from multirank import run_ranks

# Every broadcast of at least one byte through CMA, in 4 KiB pieces (many claims per call).
CMA_ENV = {"LINKWISE_COLL_CMA_BCAST_MIN": "1", "LINKWISE_COLL_CMA_PIECE": "4K"}
# CMA off: the ring through the segment (256 KiB pieces, 8 slots: 300_001 float32 wraps it).
RING_ENV = {"LINKWISE_SHM_CMA": "0"}
SIZES = [0, 1, 7, 5003, 300_001]


def _cma_permitted() -> bool:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read()) <= 1
    except OSError:
        return True


def _body(comm, want_cma):
    checked = 0
    for dt in ["float32", "uint8"]:
        for count in SIZES:
            for root in range(comm.size):
                ref = data(root, count, dt, "sum", salt=11)
                x = ref.copy() if comm.rank == root else np.full(count, 9, np_dtype(dt))
                out = np.full(count, 5, np_dtype(dt))
                got = comm.broadcast(x, root=root, out=out)
                assert got is out
                check_equal(out, ref, f"broadcast out= {dt} {count} root {root}")
                if comm.rank == root:
                    check_equal(x, ref, "root's x untouched")
                else:
                    assert np.all(x == 9), "a reader's x is not written"
                # async: the queued job carries x and out as well
                out2 = np.full(count, 6, np_dtype(dt))
                comm.broadcast(x, root=root, out=out2, async_op=True).wait()
                check_equal(out2, ref, f"async broadcast out= {dt} {count} root {root}")
                checked += 1
    # out overlapping x on the root (a view into the same memory, shifted): the root's data
    # as it was before the call must arrive everywhere.
    n = 70_001
    buf = np.zeros(2 * n, np.float32)
    ref = data(0, n, "float32", "sum", salt=3)
    if comm.rank == 0:
        buf[:n] = ref
    x, out = buf[:n], buf[n // 3:n // 3 + n]
    comm.broadcast(x, root=0, out=out)
    check_equal(out, ref, "broadcast with out overlapping x")
    if comm.size > 1:
        assert comm._shm.cma is want_cma
    return checked


@pytest.mark.skipif(not _cma_permitted(), reason="ptrace_scope forbids process_vm_readv between ranks")
@pytest.mark.parametrize("n", [2, 3])
def test_cma_broadcast_out(n):
    got = run_ranks(n, _body, True, env=CMA_ENV, timeout=240)
    assert all(c == got[0] for c in got)


@pytest.mark.parametrize("n", [2, 3])
def test_ring_broadcast_out(n):
    got = run_ranks(n, _body, False, env=RING_ENV, timeout=240)
    assert all(c == got[0] for c in got)


def _large_out_of_place(comm, count):
    """Point-to-point broadcast of 1 MiB and more out of place: the root sends from x while a
    helper thread copies x into out (dispatch.cc); every rank's out gets the root's data, the
    root's x stays as it was."""
    got = []
    for root in range(comm.size):
        ref = data(root, count, "float32", "sum", salt=5)
        x = ref.copy() if comm.rank == root else np.full(count, 9, np.float32)
        out = np.full(count, 5, np.float32)
        comm.broadcast(x, root=root, out=out)
        check_equal(out, ref, f"large broadcast out= root {root}")
        if comm.rank == root:
            check_equal(x, ref, "root's x untouched")
        got.append(float(out[count // 2]))
    return got


@pytest.mark.parametrize("n,env", [(2, {}), (3, {"LINKWISE_TRANSPORT": "tcp"}), (3, {"LINKWISE_ALGO": "chain"})],
                         ids=["shm-pair", "tcp", "chain"])
def test_large_out_of_place_broadcast_point_to_point(n, env):
    got = run_ranks(n, _large_out_of_place, 2_500_001, env=env, timeout=240)
    assert all(g == got[0] for g in got)

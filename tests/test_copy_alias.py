"""Copies whose destination lies 1-31 bytes past the source modulo 4 KiB (core/copy.h): the
string copy (glibc's memcpy, the kernel's process_vm_readv/writev) runs several times slower
there, so copy_bytes takes a vector loop and CMA transfers go through a bounce buffer. The
data must arrive intact on those detours: point-to-point over the shared-memory ring and over
CMA, and the collectives of the shared-memory executor, with buffers placed at chosen offsets
within a page on each rank. Each case also checks that the detour ran (_native.copy_detours),
so a change of placement cannot leave them untested. The detours are on by default on AMD CPUs
only (where the slow copy was measured); the tests force them on (LINKWISE_COPY_DETOUR=on) so
that they run on any CPU, and check that "off" takes none."""
import numpy as np
import pytest

from coll_ref import check_equal, data, reduce_ref
from multirank import run_ranks


def placed(count: int, dtype, offset: int) -> np.ndarray:
    """A zeroed array of count elements whose data starts `offset` bytes into a page."""
    dt = np.dtype(dtype)
    raw = np.zeros(count * dt.itemsize + 8192, np.uint8)
    start = (offset - raw.ctypes.data) % 4096
    return raw[start:start + count * dt.itemsize].view(dt)


def _detours():
    from linkwise import _native
    return _native.copy_detours()


def test_placed_arrays_start_where_asked():
    for off in (0, 16, 4095):
        a = placed(10, np.uint8, off)
        assert a.ctypes.data % 4096 == off and a.size == 10


ON = {"LINKWISE_COPY_DETOUR": "on"}

# Sizes in bytes: under the ring, a few pages, over one 128 KiB bounce block and not a
# multiple of it, and over the 1 MiB ring (the send wraps it).
P2P_SIZES = [1000, 4099, 70_001, 131_075, 300_007, (1 << 20) + 3]


def _p2p_body(comm, recv_offset, sweep):
    before = _detours()
    for nbytes in P2P_SIZES + [3001] * sweep:
        if sweep:
            recv_offset = (recv_offset + 4) % 4096  # each message lands elsewhere in the ring
        want = data(0, nbytes, "uint8", "sum", salt=nbytes) * 37 + 1
        if comm.rank == 0:
            buf = placed(nbytes, np.uint8, 0)
            buf[:] = want
            comm.send(buf, 1)
            back = placed(nbytes, np.uint8, recv_offset)
            comm.recv(back, 1)
            check_equal(back, want[::-1].copy(), f"echo of {nbytes} bytes")
        else:
            buf = placed(nbytes, np.uint8, recv_offset)
            comm.recv(buf, 0)
            check_equal(buf, want, f"{nbytes} bytes into offset {recv_offset}")
            out = placed(nbytes, np.uint8, 0)
            out[:] = buf[::-1]
            comm.send(out, 0)
    after = _detours()
    return after[0] - before[0], after[1] - before[1]


@pytest.mark.parametrize("recv_offset", [16, 5])
def test_p2p_single_copy_survives_aliasing_placement(recv_offset):
    # From 64 KiB messages go single-copy (CMA) by default.
    res = run_ranks(2, _p2p_body, recv_offset, 0, env=ON)
    assert sum(r[1] for r in res) > 0, f"no CMA transfer went through the bounce buffer: {res}"


def test_p2p_ring_survives_aliasing_placement():
    # Everything through the ring, and a sweep of receive offsets: where a message's data sits
    # in the ring depends on the messages before it, so the sweep is what makes some copies
    # alias (deterministically: the same program lays out the ring the same way every run).
    res = run_ranks(2, _p2p_body, 0, 512, env={"LINKWISE_SHM_RNDV_THRESHOLD": "1G", **ON})
    assert sum(r[0] for r in res) > 0, f"no ring copy took the vector loop: {res}"
    assert sum(r[1] for r in res) == 0


def _coll_body(comm, counts):
    """Collectives with odd ranks' buffers 16 bytes into a page and even ranks' at 0."""
    off = 16 if comm.rank % 2 else 0
    before = _detours()
    for count in counts:
        for root in range(comm.size):
            want = data(root, count, "float32", "sum", salt=5)
            x = placed(count, np.float32, off)
            if comm.rank == root:
                x[:] = want
            comm.broadcast(x, root=root)
            check_equal(x, want, f"broadcast in place {count} root {root}")
            out = placed(count, np.float32, off)
            src = placed(count, np.float32, 0)
            if comm.rank == root:
                src[:] = want
            comm.broadcast(src, root=root, out=out)
            check_equal(out, want, f"broadcast out of place {count} root {root}")
        inputs = [data(r, count, "float32", "sum", salt=9) for r in range(comm.size)]
        want = reduce_ref(inputs, "sum", "float32")
        x = placed(count, np.float32, 0)
        x[:] = inputs[comm.rank]
        out = placed(count, np.float32, off)
        comm.all_reduce(x, out=out)
        check_equal(out, want, f"all_reduce out of place {count}")
        comm.all_reduce(x)
        check_equal(x, want, f"all_reduce in place {count}")
        block = min(count, 2001)  # the executor's exchange takes x up to 32 KiB
        mine = data(comm.rank, block, "float32", "sum", salt=13)
        gathered = placed(block * comm.size, np.float32, off)
        comm.all_gather(mine, out=gathered)
        check_equal(gathered, np.concatenate([data(r, block, "float32", "sum", salt=13)
                                              for r in range(comm.size)]), f"all_gather {block}")
    after = _detours()
    return after[0] - before[0], after[1] - before[1]


# float32 counts: a few pages, and over 1 MiB (several CMA pieces and bounce blocks).
COLL_COUNTS = [3001, 300_007]
# Every broadcast and all_reduce through CMA (the single-copy paths), in 64 KiB pieces.
CMA_ENV = {"LINKWISE_COLL_CMA_BCAST_MIN": "1", "LINKWISE_COLL_CMA_MIN": "1",
           "LINKWISE_COLL_CMA_PIECE": "64K"}
RING_ENV = {"LINKWISE_SHM_CMA": "0"}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("env", [CMA_ENV, RING_ENV], ids=["cma", "ring"])
def test_collectives_data_survive_aliasing_placement(n, env):
    res = run_ranks(n, _coll_body, COLL_COUNTS, env={**env, **ON})
    vector = sum(r[0] for r in res)
    bounced = sum(r[1] for r in res)
    if env is CMA_ENV:
        assert bounced > 0, f"no CMA transfer went through the bounce buffer: {res}"
    assert vector > 0, f"no copy took the vector loop: {res}"


def test_detours_off_take_none_and_move_the_same_data():
    res = run_ranks(2, _coll_body, COLL_COUNTS, env={**CMA_ENV, "LINKWISE_COPY_DETOUR": "off"})
    assert res == [(0, 0), (0, 0)]
    res = run_ranks(2, _p2p_body, 16, 0, env={"LINKWISE_COPY_DETOUR": "0"})
    assert res == [(0, 0), (0, 0)]


def test_detour_default_follows_the_cpu():
    from linkwise import _native
    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    try:
        _native.set_copy_detour(-1)
        assert _native.copy_detour_on() is amd
        _native.set_copy_detour(0)
        assert _native.copy_detour_on() is False
        _native.set_copy_detour(1)
        assert _native.copy_detour_on() is True
    finally:
        _native.set_copy_detour(-1)


def _local_copy_body(comm, counts):
    """run_collective's local copies (x into out; all_gather's own block), through the general
    path (LINKWISE_ALGO set: no latency path serves the call) on one rank, with out 16 bytes
    past x within a page, and with an out that overlaps x (staged first). Returns how many
    vector-loop copies each aliasing call took (copy_bytes counts them) and the calls that
    were to take one."""
    took, expected = 0, 0
    for count in counts:
        want = data(0, count, "float32", "sum", salt=count)
        aliasing = count * 4 >= 1024  # copy_bytes takes the vector loop from 1 KiB
        calls = [
            ("all_reduce", lambda x, out: comm.all_reduce(x, out=out), want),
            ("broadcast", lambda x, out: comm.broadcast(x, root=0, out=out), want),
            ("reduce_scatter", lambda x, out: comm.reduce_scatter(x, out=out), want),
            ("all_gather", lambda x, out: comm.all_gather(x, out=out), want),
        ]
        for name, call, expect in calls:
            x = placed(count, np.float32, 0)
            x[:] = want
            out = placed(count, np.float32, 16)
            before = _detours()[0]
            call(x, out)
            took += _detours()[0] - before
            expected += aliasing
            check_equal(out, expect, f"{name} of {count} into out 16 bytes on")
            check_equal(x, want, f"{name} of {count}: x untouched")
            # out overlapping x one element on (and one back): x is staged, out gets x's values
            for shift in (1, -1):
                raw = placed(count + 1, np.float32, 0)
                x, out = (raw[:count], raw[1:]) if shift == 1 else (raw[1:], raw[:count])
                x[:] = want
                call(x, out)
                check_equal(out, expect, f"{name} of {count} into an out overlapping x by {shift}")
    return took, expected


def test_collective_local_copies_take_the_detour_and_survive_overlap():
    """run_collective copied x into out with std::memmove, never taking copy_bytes' detour
    (256 KiB one-rank all_reduce into an out 16 bytes past x: 0.10-0.12 ms, against
    0.02-0.04 with copy_bytes on the 2-core VM's EPYC). Sizes: under and at 1 KiB, pages, MiB."""
    counts = [1, 255, 256, 3001, 300_007]
    (took, expected), = run_ranks(1, _local_copy_body, counts,
                                  env={"LINKWISE_ALGO": "ring", **ON})
    assert expected > 0 and took == expected, (took, expected)

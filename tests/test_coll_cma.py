"""The single-copy (CMA) paths of the shared-memory collectives (algo/shm_cma.cc) against
the NumPy reference: all_reduce (every op and dtype, in place and out=) and broadcast (every
root, in place and out=), sizes 0, 1, odd, several chunks, not a multiple of the rank count,
1 to 8 ranks, with helper threads, the forced fallback, and a rank killed mid-collective.

Tiny thresholds / chunks (LINKWISE_COLL_CMA_*) make small messages take the CMA paths, and
the executor's counters prove they did."""

import numpy as np
import pytest

from coll_ref import DTYPES, check_all_reduce_matrix, check_bitwise_sum, check_broadcast, check_equal, data
from multirank import collective_until_peer_error, run_ranks

# Every message of at least one byte goes through CMA, reduced 4 KiB at a time (the floor).
CMA_ENV = {"LINKWISE_COLL_CMA_MIN": "1", "LINKWISE_COLL_CMA_BCAST_MIN": "1",
           "LINKWISE_COLL_CMA_CHUNK": "4K", "LINKWISE_COLL_CMA_PIECE": "4K"}
SIZES = [0, 1, 7, 1000, 5003]  # 5003 float64: ~40 KB, several 4 KiB chunks per rank


def _cma_permitted() -> bool:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read()) <= 1  # 1: PR_SET_PTRACER_ANY lets peers in
    except OSError:
        return True


def _all_reduce_matrix(comm, dtypes, sizes):
    return check_all_reduce_matrix(comm, dtypes, lambda dt, op: sizes)


def _matrix_body(comm, dtypes, sizes):
    checked = _all_reduce_matrix(comm, dtypes, sizes)
    if comm.size == 1:
        return checked, None
    shm = comm._shm
    assert shm.cma, "CMA was expected to be permitted and agreed"
    return checked, shm.cma_calls[0]


@pytest.mark.skipif(not _cma_permitted(), reason="ptrace_scope forbids process_vm_readv between ranks")
@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_every_dtype_and_op(n):
    got = run_ranks(n, _matrix_body, DTYPES, SIZES, env=CMA_ENV, timeout=240)
    for checked, calls in got:
        # every call of >= 1 byte went through CMA (count 0 takes the one-shot path)
        assert calls == checked - checked // len(SIZES), (checked, calls)


@pytest.mark.skipif(not _cma_permitted(), reason="ptrace_scope forbids process_vm_readv between ranks")
@pytest.mark.parametrize("n", [1, 5, 8])
def test_all_reduce_rank_counts(n):
    sizes = [0, 1, 7, 5003]
    got = run_ranks(n, _matrix_body, ["float32", "int8", "bfloat16"], sizes, env=CMA_ENV, timeout=240)
    if n > 1:
        assert all(calls > 0 for _, calls in got)


@pytest.mark.skipif(not _cma_permitted(), reason="ptrace_scope forbids process_vm_readv between ranks")
@pytest.mark.parametrize("n", [2, 3])
def test_helper_threads(n):
    env = dict(CMA_ENV, LINKWISE_COLL_THREADS="3")
    got = run_ranks(n, _matrix_body, ["float32", "float16", "int64"], [1, 5003, 40_009], env=env, timeout=240)
    assert all(calls > 0 for _, calls in got)


def _bitwise_body(comm):
    return check_bitwise_sum(comm, 100_003)


@pytest.mark.skipif(not _cma_permitted(), reason="ptrace_scope forbids process_vm_readv between ranks")
def test_same_bits_everywhere():
    got = run_ranks(3, _bitwise_body, env=CMA_ENV)
    assert got[0] == got[1] == got[2]


def _broadcast_body(comm, dtypes):
    calls = 0
    for dt in dtypes:
        for count in [0, 1, 7, 1000, 5003, 20_011]:  # 20011 float32: 20 pieces of 4 KiB
            for root in range(comm.size):
                check_broadcast(comm, dt, count, root)
                calls += 2 if count else 0
    return calls, comm._shm.cma_calls[1] if comm.size > 1 else None


@pytest.mark.skipif(not _cma_permitted(), reason="ptrace_scope forbids process_vm_readv between ranks")
@pytest.mark.parametrize("n,threads", [(1, 1), (2, 1), (3, 1), (5, 1), (8, 1), (3, 2)])
def test_broadcast(n, threads):
    env = dict(CMA_ENV, LINKWISE_COLL_THREADS=str(threads))
    got = run_ranks(n, _broadcast_body, ["float32", "uint8"], env=env, timeout=240)
    for want_calls, calls in got:
        if n > 1:
            assert calls == want_calls


def _fallback_body(comm):
    checked = _all_reduce_matrix(comm, ["float32", "int32"], [5003, 300_001])
    assert comm._shm.cma is False
    ref = data(1, 300_001, "float32", "sum")
    x = ref.copy() if comm.rank == 1 else np.zeros_like(ref)
    comm.broadcast(x, root=1)
    check_equal(x, ref, "fallback broadcast")
    assert comm._shm.cma_calls == (0, 0)
    return checked


@pytest.mark.parametrize("n", [2, 3])
def test_forced_fallback(n):
    env = dict(CMA_ENV, LINKWISE_SHM_CMA="0")
    assert run_ranks(n, _fallback_body, env=env, timeout=240)[0] > 0


def _one_rank_refuses(comm):
    # rank 1 alone disables CMA: the executor must agree on the fallback everywhere
    checked = _all_reduce_matrix(comm, ["float64"], [5003])
    return comm._shm.cma, comm._shm.cma_calls, checked


def test_cma_off_on_one_rank_is_off_everywhere():
    # read when the communicator is made (it sets up the executor)
    got = run_ranks(3, _one_rank_refuses, env=dict(CMA_ENV, LINKWISE_SHM_CMA=["1", "0", "1"]))
    assert [(cma, calls) for cma, calls, _ in got] == [(False, (0, 0))] * 3


def _die_body(comm, kind):
    peer = collective_until_peer_error(comm, kind, np.ones(300_001, np.float32))
    return f"PeerError peer={peer} cma={comm._shm.cma_calls}"


@pytest.mark.skipif(not _cma_permitted(), reason="ptrace_scope forbids process_vm_readv between ranks")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["all_reduce", "broadcast"])
def test_rank_killed_mid_collective(kind, threads):
    env = dict(CMA_ENV, LINKWISE_COLL_CMA_CHUNK="64K", LINKWISE_COLL_CMA_PIECE="64K",
               LINKWISE_COLL_THREADS=str(threads))
    out = run_ranks(3, _die_body, kind, env=env, expect_fail=True, timeout=60)
    assert out[2][0] == "died"
    for status, val in out[:2]:
        assert status == "ok" and val.startswith("PeerError peer=2"), (status, val)


def test_default_thresholds(monkeypatch):
    """Which sizes take the single-copy paths by default (docs/benchmarks.md says why)."""
    from linkwise.collectives import _NEVER, _cma_settings
    for name in ("LINKWISE_COLL_CMA_MIN", "LINKWISE_COLL_CMA_BCAST_MIN", "LINKWISE_LOCAL_SIZE", "LINKWISE_SHM_CMA",
                 "LINKWISE_COLL_ONE_SHOT_MAX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LINKWISE_COLL_THREADS", "1")
    enable, ar_min, bc_min, _, _, _, threads, _ = _cma_settings(1.0, 2)
    assert (enable, ar_min, bc_min, threads) == (True, _NEVER, 4 << 20, 1)  # broadcast: 4 MiB, 2 ranks of 1 thread
    assert [_cma_settings(1.0, n)[2] for n in (3, 4, 5)] == [8 << 20, 8 << 20, _NEVER]
    monkeypatch.setenv("LINKWISE_COLL_THREADS", "2")
    assert _cma_settings(1.0, 2)[2] == 8 << 20
    monkeypatch.setenv("LINKWISE_COLL_THREADS", "4")
    assert _cma_settings(4.0, 16)[1:3] == (8 << 20, _NEVER)
    monkeypatch.setenv("LINKWISE_COLL_CMA_MIN", "64K")
    monkeypatch.setenv("LINKWISE_COLL_CMA_BCAST_MIN", "1M")
    monkeypatch.setenv("LINKWISE_SHM_CMA", "0")
    assert _cma_settings(4.0, 16)[:3] == (False, 64 << 10, 1 << 20)
    monkeypatch.delenv("LINKWISE_COLL_THREADS")
    # Threads: 3/4 of the rank's CPUs (linkwise._setup.cpus_per_rank), 2 from 2 CPUs, at least 1, at most 8
    # (16 ranks on 64 cores: 3; 8 ranks: 6; 4 ranks: 8; 16 ranks on 32 cores: 2)
    cpus = (0.5, 1.0, 1.9, 2.0, 2.5, 2.9, 4.0, 8.0, 15.5, 64.0)
    assert [_cma_settings(c, 2)[6] for c in cpus] == [1, 1, 1, 2, 2, 2, 3, 6, 8, 8]
    # with one thread the single-copy all_reduce stays off; from 2 it starts at 8 MiB
    monkeypatch.delenv("LINKWISE_COLL_CMA_MIN")
    assert [_cma_settings(c, 4)[1] for c in (1.9, 2.0)] == [_NEVER, 8 << 20]
    # One-shot all_reduce up to 16 KiB / ranks with a core per rank; 32 KiB (the executor's
    # area) with 2 ranks or ranks sharing cores; the variable wins over both.
    assert [_cma_settings(1.0, n)[-1] for n in (2, 3, 4, 8, 16, 512)] == [32768, 5461, 4096, 2048, 1024, 64]
    assert [_cma_settings(0.5, n)[-1] for n in (2, 8)] == [32768, 32768]
    monkeypatch.setenv("LINKWISE_COLL_ONE_SHOT_MAX", "100")
    assert _cma_settings(1.0, 8)[-1] == 100

"""The GPU plane's IPC mapping cache (csrc/cuda/reg_cache.h), through _native._RegCacheModel:
the same bookkeeping with made-up mappings and completion tokens, so its rules are tested
without a GPU. Before, the cache never closed a mapping unless the same (peer, base) came back
with another handle: a peer's freed allocations stayed allocated on its GPU for the
communicator's life (bench/gpu_open_issues probe_06; the GPU test is in
test_gpu_open_fixes.py)."""
from __future__ import annotations

import pytest

from linkwise import _native

MiB = 1 << 20
BIG = 1 << 60


def model(entries=1000, nbytes=BIG):
    return _native._RegCacheModel(entries, nbytes)


def test_the_same_allocation_is_mapped_once():
    c = model()
    a = c.map(0, 1, 0x10000000, 4 * MiB, "A")
    assert c.map(0, 1, 0x10000000, 4 * MiB, "A") == a
    assert c.map(1, 1, 0x10000000, 4 * MiB, "A") == a  # x and out in one allocation
    assert (c.entries, c.bytes, c.closed) == (1, 4 * MiB, [])


@pytest.mark.parametrize("base, nbytes", [(0x10000000, 4 * MiB),   # same base, new handle
                                          (0x10100000, 8 * MiB),   # starts inside
                                          (0x0FF00000, 2 * MiB)])  # ends inside
def test_a_new_allocation_overlapping_an_entry_closes_it(base, nbytes):
    c = model()
    c.map(0, 1, 0x10000000, 4 * MiB, "old")
    c.map(0, 2, 0x10000000, 4 * MiB, "other peer")  # another process's address space
    c.map(0, 1, base, nbytes, "new")
    assert c.closed == ["old"]
    assert (c.entries, c.retired, c.bytes) == (2, 0, 4 * MiB + nbytes)


def test_an_adjacent_allocation_does_not_close_it():
    c = model()
    c.map(0, 1, 0x10000000, 4 * MiB, "A")
    c.map(1, 1, 0x10000000 + 4 * MiB, 4 * MiB, "B")
    assert c.closed == [] and c.entries == 2


def test_a_retired_entry_waits_for_the_work_that_used_it():
    c = model()
    c.set_pending(7, True)
    c.map(0, 1, 0x10000000, 4 * MiB, "old")
    c.note_use(100, 7)  # an operation on stream 100 read it; not finished yet
    c.map(0, 1, 0x10000000, 4 * MiB, "new")
    assert (c.closed, c.retired, c.entries) == ([], 1, 1)
    c.trim()
    assert c.closed == []
    c.set_pending(7, False)
    c.trim()
    assert (c.closed, c.retired) == (["old"], 0)


def test_a_slot_pointing_into_a_retired_entry_is_unset():
    c = model()
    c.map(1, 1, 0x10000000, 4 * MiB, "old")  # slot 1: an earlier call's out
    c.map(0, 1, 0x10000000, 4 * MiB, "new")  # the peer freed it and reallocated there
    assert not c.is_set(1, 1) and c.is_set(0, 1)


def test_least_recently_used_entries_go_beyond_the_entry_bound():
    c = model(entries=2)
    for i in range(4):
        c.map(0, 1, 0x10000000 + i * 16 * MiB, MiB, f"h{i}")
    assert c.closed == ["h0", "h1"] and c.entries == 2
    c.map(0, 1, 0x10000000 + 2 * 16 * MiB, MiB, "h2")  # used again: now the newest
    c.map(0, 1, 0x10000000 + 4 * 16 * MiB, MiB, "h4")
    assert c.closed == ["h0", "h1", "h3"]


def test_the_byte_bound_counts_the_peers_allocations():
    c = model(nbytes=10 * MiB)
    c.map(0, 1, 0x10000000, 4 * MiB, "a")
    c.map(0, 2, 0x10000000, 4 * MiB, "b")
    assert c.closed == [] and c.bytes == 8 * MiB
    c.map(0, 1, 0x20000000, 4 * MiB, "c")
    assert c.closed == ["a"] and c.bytes == 8 * MiB


def test_entries_the_slots_reference_stay_over_the_bound():
    c = model(entries=0, nbytes=0)
    c.map(0, 1, 0x10000000, MiB, "x of 1")
    c.map(1, 1, 0x20000000, MiB, "out of 1")
    c.map(2, 1, 0x30000000, MiB, "prs scratch of 1")  # mapped once, referenced for good
    assert c.closed == [] and c.entries == 3
    c.unset(0, 1)
    c.unset(1, 1)
    c.trim()
    assert sorted(c.closed) == ["out of 1", "x of 1"] and c.entries == 1


def test_the_bound_never_closes_an_entry_with_pending_work():
    c = model(entries=0)
    c.set_pending(1, True)
    c.map(0, 1, 0x10000000, MiB, "a")
    c.note_use(5, 1)
    c.unset(0, 1)
    c.trim()
    assert c.closed == [] and c.entries == 1  # over the bound, but the host does not wait
    c.set_pending(1, False)
    c.trim()
    assert c.closed == ["a"] and c.entries == 0


def test_every_stream_that_used_an_entry_must_be_done():
    c = model(entries=0)
    c.set_pending(1, True)
    c.set_pending(2, True)
    c.map(0, 1, 0x10000000, MiB, "a")
    c.note_use(10, 1)  # stream 10
    c.note_use(20, 2)  # stream 20
    c.unset(0, 1)
    c.set_pending(2, False)
    c.trim()
    assert c.closed == []  # stream 10's use is still pending
    c.map(0, 1, 0x10000000, MiB, "a")
    c.note_use(10, 3)  # a later use on stream 10, done: the earlier one there is done too
    c.unset(0, 1)
    c.trim()
    assert c.closed == ["a"]


def test_an_empty_token_keeps_the_entry_until_close_all():
    c = model(entries=0)
    c.map(0, 1, 0x10000000, MiB, "a")
    c.note_use(10, -1)  # no event could be recorded
    c.map(0, 1, 0x10000000, MiB, "b")  # retired, but its work cannot be known done
    assert (c.closed, c.retired) == ([], 1)
    c.close_all()
    assert sorted(c.closed) == ["a", "b"] and (c.entries, c.retired, c.bytes) == (0, 0, 0)


def test_a_mapping_that_cannot_be_opened_leaves_the_slot_unset():
    c = model()
    c.map(0, 1, 0x10000000, MiB, "a")
    with pytest.raises(RuntimeError):
        c.map(0, 1, 0x20000000, MiB, "fail")
    assert not c.is_set(0, 1) and c.entries == 1


def test_the_bounds_are_gpu_plane_settings(monkeypatch):
    from linkwise import config
    monkeypatch.delenv("LINKWISE_GPU_REG_CACHE_ENTRIES", raising=False)  # the defaults first
    monkeypatch.delenv("LINKWISE_GPU_REG_CACHE_BYTES", raising=False)
    assert config.get("LINKWISE_GPU_REG_CACHE_ENTRIES") == 128
    assert config.get("LINKWISE_GPU_REG_CACHE_BYTES") == 4 << 30
    monkeypatch.setenv("LINKWISE_GPU_REG_CACHE_BYTES", "512M")
    assert config.get("LINKWISE_GPU_REG_CACHE_BYTES") == 512 << 20
    monkeypatch.setenv("LINKWISE_GPU_REG_CACHE_ENTRIES", "-1")  # refused on every rank up front
    assert "LINKWISE_GPU_REG_CACHE_ENTRIES='-1' is not valid" in config.first_invalid(
        config.READ_BY_GPU_PLANE)

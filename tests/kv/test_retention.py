"""Retained blocks (an agent session's): kept against capacity pressure until their deadline,
evicted after it, and never beyond the capacity (FileKVStore and MemoryKVStore alike)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.kv.file_store import FileKVStore
from dualpath.kv.retention import RetainedKeys
from dualpath.kv.store import KVStore, LruIndex, MemoryKVStore
from tests.kv.conftest import (
    TINY_FINGERPRINT,
    TINY_LAYOUT,
    capacity_for,
    make_block,
    make_keys,
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_timed_store(store_kind: str, tmp_path: Path, clock: FakeClock):
    def make(capacity_blocks: int | None) -> KVStore:
        capacity_bytes = (
            None if capacity_blocks is None else capacity_for(store_kind, capacity_blocks)
        )
        if store_kind == "file":
            return FileKVStore(
                tmp_path / "store",
                TINY_LAYOUT,
                TINY_FINGERPRINT,
                capacity_bytes=capacity_bytes,
                clock=clock,
            )
        return MemoryKVStore(
            TINY_LAYOUT, TINY_FINGERPRINT, capacity_bytes=capacity_bytes, clock=clock
        )

    return make


KEYS = make_keys(8)


def present(store: KVStore) -> list[int]:
    return [i for i, key in enumerate(KEYS) if store.contains(key)]


def write(store: KVStore, *indices: int) -> None:
    for i in indices:
        assert store.write(KEYS[i], make_block(i))


def test_retained_blocks_survive_pressure_until_their_deadline(make_timed_store, clock) -> None:
    store = make_timed_store(capacity_blocks=3)
    write(store, 0, 1, 2)
    store.retain([KEYS[0]], 10.0)  # block 0 is the least recently used
    write(store, 3)  # evicts 1 rather than 0
    write(store, 4)  # then 2
    assert present(store) == [0, 3, 4]
    clock.now_s = 10.0  # the deadline: no longer retained
    write(store, 5)
    assert present(store) == [3, 4, 5]
    stats = store.stats()
    assert (stats.evictions, stats.retained_evictions) == (3, 0)


def test_capacity_stays_a_hard_bound_oldest_retained_first(make_timed_store, clock) -> None:
    store = make_timed_store(capacity_blocks=2)
    write(store, 0, 1)
    store.retain([KEYS[1], KEYS[0]], 10.0)
    write(store, 2)  # only retained blocks (and the new one) are left: 0 goes, counted
    assert present(store) == [1, 2]
    stats = store.stats()
    assert (stats.evictions, stats.retained_evictions) == (1, 1)


def test_a_block_may_be_retained_before_it_is_written(make_timed_store, clock) -> None:
    store = make_timed_store(capacity_blocks=2)
    store.retain([KEYS[0]], 10.0)  # queued for writing, say
    write(store, 0, 1, 2)
    assert present(store) == [0, 2]


def test_a_later_turn_extends_the_deadline_and_an_earlier_one_never_shortens_it(
    make_timed_store, clock
) -> None:
    store = make_timed_store(capacity_blocks=2)
    write(store, 0, 1)
    store.retain([KEYS[0]], 10.0)
    clock.now_s = 8.0
    store.retain([KEYS[0]], 10.0)  # deadline 18
    store.retain([KEYS[0]], 1.0)  # an older turn's shorter mark changes nothing
    clock.now_s = 17.0
    write(store, 2)
    assert present(store) == [0, 2]
    clock.now_s = 18.0
    write(store, 3)
    assert present(store) == [2, 3]


def test_a_store_without_a_capacity_keeps_no_marks(clock) -> None:
    index: LruIndex = LruIndex(None)
    index.retain(KEYS[:3], 10.0, 0.0)
    assert index.num_retained_keys == 0


def test_marks_are_bounded_and_expired_ones_dropped() -> None:
    index: LruIndex = LruIndex(1000, max_num_retained_keys=2)
    index.retain(KEYS[:3], 10.0, 0.0)  # one more than the bound: the earliest set goes
    assert index.num_retained_keys == 2
    index.retain(KEYS[3:4], 30.0, 20.0)  # at 20 s the others have expired
    assert index.num_retained_keys == 1


def test_retained_keys_keep_the_latest_deadline_and_the_last_set() -> None:
    marks = RetainedKeys(max_num_keys=2)
    marks.retain(["a", "b"], 10.0)
    marks.retain(["a"], 5.0)  # "a" keeps 10 s and becomes the last set
    marks.retain(["c"], 10.0)  # over the bound: "b", the earliest set, goes
    assert [marks.is_retained(key, 9.0) for key in "abc"] == [True, False, True]
    assert not marks.is_retained("a", 10.0)
    assert len(marks) == 1  # the expired mark was dropped on the way
    with pytest.raises(ValueError, match="max_num_keys"):
        RetainedKeys(0)


def test_retain_checks_its_keys(make_timed_store) -> None:
    store = make_timed_store(capacity_blocks=2)
    with pytest.raises(ValueError, match="key"):
        store.retain(["not-a-key"], 10.0)

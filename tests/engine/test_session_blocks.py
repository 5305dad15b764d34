"""A DE's session blocks: hit blocks marked at assignment, hit and written blocks at the end,
for the session's retention time from then; nothing for a request without a session."""

from __future__ import annotations

from dualpath.engine.session_blocks import SessionBlocks
from dualpath.kv.store import MemoryKVStore
from dualpath.protocol import Assignment
from tests.kv.conftest import TINY_FINGERPRINT, TINY_LAYOUT, make_block, make_keys

KEYS = make_keys(8)


class FakeClock:
    now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def assignment(request_id: int, session_retention_s: float) -> Assignment:
    return Assignment(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling={},
        num_prefill_side_blocks=0,
        num_decode_side_blocks=0,
        prefill_engine_id=0,
        decode_engine_id=1,
        session_retention_s=session_retention_s,
    )


def make_store(clock: FakeClock, capacity_blocks: int) -> MemoryKVStore:
    return MemoryKVStore(
        TINY_LAYOUT,
        TINY_FINGERPRINT,
        capacity_bytes=capacity_blocks * TINY_LAYOUT.full_block_bytes,
        clock=clock,
    )


def fill(store: MemoryKVStore, indices: range) -> list[int]:
    """Write blocks ``indices`` (each evicting the least recently used unretained block), and
    say which of ``KEYS`` are left."""
    for i in indices:
        store.write(KEYS[i], make_block(i))
    return [i for i, key in enumerate(KEYS) if store.contains(key)]


def test_a_session_requests_blocks_are_kept_from_its_end() -> None:
    clock = FakeClock()
    store = make_store(clock, capacity_blocks=4)
    fill(store, range(2))  # blocks 0 and 1: the request's hit
    sessions = SessionBlocks(store)
    sessions.on_assigned(assignment(7, 10.0), KEYS[:2])
    clock.now_s = 8.0
    sessions.on_finished(7, KEYS[2:3])  # it wrote block 2 (maybe still queued)
    clock.now_s = 17.0  # past the assignment's mark (10 s), within the end's (18 s)
    assert fill(store, range(2, 6)) == [0, 1, 2, 5]  # 3 and 4 evicted in turn
    clock.now_s = 18.0
    assert fill(store, range(6, 8)) == [2, 5, 6, 7]  # the least recently used go: 0, 1


def test_a_request_without_a_session_marks_nothing() -> None:
    clock = FakeClock()
    store = make_store(clock, capacity_blocks=3)
    fill(store, range(2))
    sessions = SessionBlocks(store)
    sessions.on_assigned(assignment(7, 0.0), KEYS[:2])
    sessions.on_finished(7, KEYS[2:3])
    assert fill(store, range(2, 5)) == [2, 3, 4]


def test_a_cancelled_request_keeps_only_its_assignments_marks() -> None:
    clock = FakeClock()
    store = make_store(clock, capacity_blocks=3)
    fill(store, range(2))
    sessions = SessionBlocks(store)
    sessions.on_assigned(assignment(7, 10.0), KEYS[:2])
    sessions.forget(7)
    sessions.on_finished(7, KEYS[2:3])  # (its end never comes; nothing is marked if it did)
    clock.now_s = 9.0
    assert fill(store, range(2, 5)) == [0, 1, 4]
    clock.now_s = 10.0
    assert fill(store, range(2, 4)) == [2, 3, 4]


def test_no_store_no_marks() -> None:
    sessions = SessionBlocks(None)
    sessions.on_assigned(assignment(7, 10.0), KEYS[:2])
    sessions.on_finished(7, KEYS[2:3])  # nothing to do, nothing raised

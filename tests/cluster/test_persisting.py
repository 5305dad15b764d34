"""The scheduler's record of blocks still being written, and the requests waiting on them."""

from __future__ import annotations

import pytest

from dualpath.cluster.persisting import PersistingBlocks


def test_a_waiter_is_released_when_its_writer_is_written() -> None:
    blocks: PersistingBlocks[str] = PersistingBlocks(wait_s=5.0)
    blocks.add(7, decode_engine_id=1, keys=["k1", "k2"], now_s=0.0)
    assert blocks.writer_of("k2") == 7
    assert blocks.writer_of("k0") is None
    blocks.wait(7, "next turn")
    assert blocks.written([8]) == []  # not a writer: nothing released
    assert blocks.written([7]) == ["next turn"]
    assert blocks.writer_of("k1") is None and len(blocks) == 0
    assert blocks.num_waits == 1


def test_a_later_writer_of_the_same_block_keeps_it() -> None:
    blocks: PersistingBlocks[str] = PersistingBlocks(wait_s=5.0)
    blocks.add(1, 1, ["shared", "a"], 0.0)
    blocks.add(2, 2, ["shared", "b"], 0.1)
    blocks.written([1])
    assert blocks.writer_of("shared") == 2
    assert blocks.writer_of("a") is None


def test_a_lost_engine_releases_only_its_own_waiters() -> None:
    blocks: PersistingBlocks[str] = PersistingBlocks(wait_s=5.0)
    blocks.add(1, 1, ["a"], 0.0)
    blocks.add(2, 2, ["b"], 0.0)
    blocks.wait(1, "on a")
    blocks.wait(2, "on b")
    assert blocks.engine_lost(2) == ["on b"]
    assert blocks.writer_of("a") == 1 and blocks.writer_of("b") is None


def test_unconfirmed_writers_expire_oldest_first() -> None:
    blocks: PersistingBlocks[str] = PersistingBlocks(wait_s=2.0)
    blocks.add(1, 1, ["a"], now_s=0.0)
    blocks.add(2, 1, ["b"], now_s=1.5)
    blocks.wait(1, "on a")
    blocks.wait(2, "on b")
    assert blocks.expire(now_s=1.9) == []
    assert blocks.expire(now_s=2.0) == ["on a"]
    assert blocks.expire(now_s=3.5) == ["on b"]
    assert blocks.num_expired == 2 and len(blocks) == 0


def test_disabled_it_records_nothing() -> None:
    blocks: PersistingBlocks[str] = PersistingBlocks(wait_s=0.0)
    blocks.add(1, 1, ["a"], 0.0)
    assert not blocks.is_enabled and blocks.writer_of("a") is None
    with pytest.raises(ValueError, match="wait_s"):
        PersistingBlocks(wait_s=-1.0)


def test_a_request_cannot_finish_twice() -> None:
    blocks: PersistingBlocks[str] = PersistingBlocks(wait_s=1.0)
    blocks.add(1, 1, ["a"], 0.0)
    with pytest.raises(RuntimeError, match="caller bug"):
        blocks.add(1, 1, ["b"], 0.0)

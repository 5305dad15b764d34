from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.kv.block_pool import BlockPool


def test_allocates_lowest_ids_and_reuses_freed_blocks_last() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert (a, b) == ([0, 1], [2, 3, 4])
    pool.free(a)
    # Block 5 was never used, then the freed ones tail first.
    assert pool.allocate(3) == [5, 1, 0]
    assert pool.num_free_blocks == 0
    assert not pool.can_allocate(1)


def test_caller_bugs_raise() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(blocks)
    with pytest.raises(RuntimeError, match="can_allocate"):
        pool.allocate(3)
    with pytest.raises(ValueError):
        BlockPool(0)


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=60))
def test_free_plus_used_is_total_and_no_block_is_owned_twice(ops) -> None:
    pool = BlockPool(12)
    owned: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc and pool.can_allocate(n):
            owned.append(pool.allocate(n))
        elif owned:
            pool.free(owned.pop(0))
        flat = [b for blocks in owned for b in blocks]
        assert len(flat) == len(set(flat))
        assert pool.num_free_blocks + len(flat) == pool.num_blocks == 12

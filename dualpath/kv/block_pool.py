"""Device KV blocks: which paged-cache slots are free. Pure bookkeeping, no tensors.

Blocks are handed out lowest id first from a FIFO free list, and freed blocks go to its back,
so a freed block is reused as late as possible (tests assert exact ids).
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A fixed set of ``num_blocks`` block ids; each is either free or owned by one sequence."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free ids; the caller owns them until ``free``."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(
                f"caller bug: allocate({num_blocks}) with {len(self._free)} free; "
                "ask can_allocate first"
            )
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._is_free[block_id] = False
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Return blocks, tail first (a sequence's last blocks are the least likely reused)."""
        for block_id in reversed(block_ids):
            if self._is_free[block_id]:
                raise RuntimeError(f"caller bug: block {block_id} freed twice")
            self._is_free[block_id] = True
            self._free.append(block_id)

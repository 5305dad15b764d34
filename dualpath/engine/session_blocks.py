"""A decode engine's agent-session blocks: kept in its store between the session's turns.

A request that continues an agent session carries its retention time
(``Assignment.session_retention_s``). The DE it is placed on marks the request's blocks
retained in its store (``KVStore.retain``; ``dualpath.kv.retention`` says what that does):

    assigned   the hit blocks (both sides'): kept from the scheduler's lookup to their reads,
               and an earlier turn's deadline extended at once
    finished   the hit blocks and every block the request wrote (its prompt's new blocks,
               those its output filled), for the retention time from now: the session's
               next turn, after its tool has run, finds them all

A DE marks, not a PE: a DE's store object writes, so it is the one that evicts (a PE's only
reads). The scheduler keeps a session on one DE while it has room, so one store object holds
a session's marks. Both engine kinds' DEs use this (``engine.decode``, ``vllm.decode``).
"""

from __future__ import annotations

from collections.abc import Sequence

from dualpath.kv.hashing import BlockKey
from dualpath.kv.store import KVStore
from dualpath.protocol import Assignment


class SessionBlocks:
    """Per session request in flight: its retention time and hit blocks, until it finishes
    or is cancelled. A no-op without a store."""

    def __init__(self, store: KVStore | None) -> None:
        self.store = store
        self._request_id_to_blocks: dict[int, tuple[float, tuple[BlockKey, ...]]] = {}

    def on_assigned(self, assignment: Assignment, hit_keys: Sequence[BlockKey]) -> None:
        """Mark a session request's hit blocks (``hit_keys``: every hit block's key)."""
        retention_s = assignment.session_retention_s
        if self.store is None or retention_s <= 0:
            return
        keys = tuple(hit_keys)
        self._request_id_to_blocks[assignment.request_id] = (retention_s, keys)
        self.store.retain(keys, retention_s)

    def on_finished(self, request_id: int, written_keys: Sequence[BlockKey]) -> None:
        """Mark its hit blocks and ``written_keys`` (those it wrote, some maybe still queued
        for writing) for the retention time from now."""
        blocks = self._request_id_to_blocks.pop(request_id, None)
        if blocks is None or self.store is None:
            return
        retention_s, hit_keys = blocks
        self.store.retain((*hit_keys, *written_keys), retention_s)

    def forget(self, request_id: int) -> None:
        """A cancelled request: its blocks keep whatever marks they have."""
        self._request_id_to_blocks.pop(request_id, None)

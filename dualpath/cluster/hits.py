"""How much of a prompt the KV store holds: the scheduler's read-only use of the store.

A request's hit is the longest run of leading Full Blocks present (SPEC §3), over the blocks of
all but the prompt's last token (the PE must compute that one). Any thread may ask: the
coordinator hashes and looks up on the submitting thread, not in its loop (a 32K-token prompt
takes about a millisecond). A store that fails a lookup makes the prompt a miss, never an error.
"""

from __future__ import annotations

import array
import logging
from pathlib import Path

from dualpath.errors import KVStoreError
from dualpath.kv.hashing import BlockKey, block_keys
from dualpath.kv.store import FileKVStore, KVStore
from dualpath.model.identity import KVIdentity

logger = logging.getLogger(__name__)


class PromptHits:
    def __init__(self, store: KVStore | None, identity: KVIdentity) -> None:
        self.store = store
        self.identity = identity
        self.block_size = identity.layout.block_size_tokens

    def block_keys(self, prompt_token_ids: array.array) -> list[BlockKey]:
        """Keys of the whole blocks a hit may cover (none without a store)."""
        if self.store is None:
            return []
        max_blocks = (len(prompt_token_ids) - 1) // self.block_size
        return block_keys(
            prompt_token_ids[: max_blocks * self.block_size],
            self.block_size,
            self.identity.fingerprint,
        )

    def num_cached_tokens(self, keys: list[BlockKey]) -> int:
        """Tokens of the leading ``keys`` the store holds."""
        return self._lookup(keys) * self.block_size if keys else 0

    def num_more_blocks(self, keys: list[BlockKey]) -> int:
        """Leading ``keys`` present, for a run that may have grown since it was looked up.
        A bare presence check first, so that the common miss is not counted as a second
        lookup in the store's statistics (the scheduler's hit and miss metrics)."""
        return self._lookup(keys) if keys and self._contains(keys[0]) else 0

    def _lookup(self, keys: list[BlockKey]) -> int:
        try:
            return self.store.lookup(keys)
        except KVStoreError as exc:
            logger.warning("store lookup failed, treating the prompt as a miss: %s", exc)
            return 0

    def _contains(self, key: BlockKey) -> bool:
        try:
            return self.store.contains(key)
        except KVStoreError as exc:
            logger.warning("store lookup failed, treating the block as a miss: %s", exc)
            return False


def open_store_for_lookups(root_dir: Path | None, identity: KVIdentity) -> FileKVStore | None:
    """The scheduler's store: lookups only, to size each request's hit."""
    if root_dir is None:
        return None
    return FileKVStore(root_dir, identity.layout, identity.fingerprint)

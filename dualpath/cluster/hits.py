"""How much of a prompt the KV store holds: the scheduler's read-only use of the store.

A request's hit is the longest run of leading Full Blocks present (SPEC §3), over the blocks of
all but the prompt's last token (the PE must compute that one). Any thread may ask: the
coordinator hashes and looks up on the submitting thread, not in its loop (a 32K-token prompt
takes about a millisecond). A store that fails a lookup makes the prompt a miss, never an error.

A lookup never holds its caller longer than ``LOOKUP_TIMEOUT_S``: it runs on a thread of its
own, and one that has not answered by then is a miss. Until that lookup returns, every other
one is a miss at once. The scheduler's loop asks too (a request placed again, or waiting for a
write), and a store on a distributed file system whose server is cut off can hang a file
operation for the volume's ping timeout (tens of seconds): the loop would stop heartbeating,
and every engine would take the scheduler for dead. A miss recomputes: slower, never wrong.
"""

from __future__ import annotations

import array
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TypeVar

from dualpath.errors import KVStoreError
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.hashing import BlockKey, block_keys
from dualpath.kv.store import KVStore
from dualpath.model.identity import KVIdentity

logger = logging.getLogger(__name__)

# Longest a lookup may hold its caller (module docstring); a local disk answers in microseconds.
LOOKUP_TIMEOUT_S = 1.0
_T = TypeVar("_T")


class PromptHits:
    def __init__(
        self,
        store: KVStore | None,
        identity: KVIdentity,
        *,
        lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
    ) -> None:
        self.store = store
        self.identity = identity
        self.block_size = identity.layout.block_size_tokens
        self.lookup_timeout_s = lookup_timeout_s
        self._lookups = ThreadPoolExecutor(4, thread_name_prefix="hit-lookup")
        self._lock = threading.Lock()
        self._hung: Future | None = None  # a lookup past its timeout, still running

    def block_keys(
        self, prompt_token_ids: array.array, cache_salt: str | None = None
    ) -> list[BlockKey]:
        """Keys of the whole blocks a hit may cover, in ``cache_salt``'s namespace (none
        without a store)."""
        if self.store is None:
            return []
        max_blocks = (len(prompt_token_ids) - 1) // self.block_size
        return block_keys(
            prompt_token_ids[: max_blocks * self.block_size],
            self.block_size,
            self.identity.fingerprint,
            cache_salt=cache_salt,
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
        return self._bounded(lambda: self.store.lookup(keys), 0, "the prompt")

    def _contains(self, key: BlockKey) -> bool:
        return self._bounded(lambda: self.store.contains(key), False, "the block")

    def _bounded(self, lookup: Callable[[], _T], miss: _T, what: str) -> _T:
        """``lookup()``, or ``miss`` if it fails, takes longer than the timeout, or an earlier
        one is still hung."""
        with self._lock:
            if self._hung is not None and not self._hung.done():
                return miss
            self._hung = None
        future = self._lookups.submit(lookup)
        try:
            return future.result(timeout=self.lookup_timeout_s)
        except FutureTimeout:
            with self._lock:
                self._hung = future
            logger.warning(
                "store lookup took over %.1f s: treating %s as a miss, and every lookup until "
                "it returns",
                self.lookup_timeout_s,
                what,
            )
            return miss
        except KVStoreError as exc:
            logger.warning("store lookup failed, treating %s as a miss: %s", what, exc)
            return miss


def open_store_for_lookups(root_dir: Path | None, identity: KVIdentity) -> FileKVStore | None:
    """The scheduler's store: lookups only, to size each request's hit."""
    if root_dir is None:
        return None
    return FileKVStore(root_dir, identity.layout, identity.fingerprint)

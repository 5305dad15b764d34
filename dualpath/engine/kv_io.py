"""The single-node engine's storage I/O: read hit blocks in, write full blocks out.

Reads run on a small thread pool (a store is many files, often on a DFS) straight into the
paged cache on CPU, or through a host staging buffer elsewhere. Writes are write-behind on one
thread: the block is copied to host memory at once (so the device block can be reused), then
written while the engine computes. ``flush`` waits for every pending write; when pending bytes
exceed a bound, ``persist`` waits for the oldest writes first (back-pressure, never a drop).
``pending`` tells which keys are still queued or being written, so a caller can say which of
a finished request's blocks the store does not hold yet (the scheduler then waits for them
rather than recomputing them).

A block that cannot be read ends the hit prefix there: the engine recomputes from that block
on (correct tokens, just slower). A block that cannot be written is logged and counted; serving
goes on without persisting it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from dualpath.errors import KVStoreError
from dualpath.kv.hashing import BlockKey
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import KVStore
from dualpath.transfer.traffic import Mover, direct_move

logger = logging.getLogger(__name__)


class BlockCache(Protocol):
    """What ``KVStoreIO`` needs of an engine's paged KV cache: blocks addressed by id, each
    one Full Block of ``layout`` in the store's byte order. Our ``PagedKVCache`` is one; a
    cache another engine owns (vLLM's) can be another, converting to and from its own order.
    """

    layout: KVLayout

    def host_view(self, block_id: int) -> np.ndarray | None:
        """A zero-copy uint8 Full Block view of block ``block_id`` for the store to read into,
        or None when the block's bytes are not host memory in the store's order."""
        ...

    def layer_view(self, layer: int, block_ids: Sequence[int]) -> np.ndarray | None:
        """``KVPages.layer_view``: a zero-copy host view of one layer of the blocks, or None."""
        ...

    def load_full_block(self, block_id: int, full_block: np.ndarray) -> None:
        """Copy a Full Block read from the store into block ``block_id``."""
        ...

    def copy_full_block(self, block_id: int) -> np.ndarray:
        """Block ``block_id`` as a new host Full Block (the caller may keep it)."""
        ...


class _AlreadyStored(Exception):
    """A persisted block the store already held (another engine or turn wrote it first)."""


class KVStoreIO:
    def __init__(
        self,
        store: KVStore,
        cache: BlockCache,
        *,
        num_io_threads: int,
        max_pending_write_bytes: int,
        mover: Mover = direct_move,
    ) -> None:
        self.store = store
        self.cache = cache
        self._max_pending_write_bytes = max_pending_write_bytes
        self._mover = mover
        self._readers = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kv-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-write")
        self._pending: deque[tuple[Future[bool], int]] = deque()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        # Keys queued or being written, with how many writes of each are outstanding.
        self._pending_keys: Counter[BlockKey] = Counter()
        self._num_unfinished_writes = 0  # the Counter's total: writes queued or running

    def lookup(self, keys: list[BlockKey]) -> int:
        """Number of leading blocks of ``keys`` the store holds (no data moves)."""
        try:
            return self.store.lookup(keys)
        except KVStoreError as exc:
            logger.warning("store lookup failed, treating as a miss: %s", exc)
            return 0

    def load(self, keys: list[BlockKey], block_ids: list[int]) -> int:
        """Read ``keys[i]`` into device block ``block_ids[i]``; return how many leading blocks
        loaded. A failure at block i discards blocks i.. (they will be recomputed)."""
        futures = [
            self._readers.submit(self._read_one, key, block_id)
            for key, block_id in zip(keys, block_ids, strict=True)
        ]
        is_loaded = [future.result() for future in futures]  # wait for all: none left running
        return is_loaded.index(False) if False in is_loaded else len(is_loaded)

    def _read_one(self, key: BlockKey, block_id: int) -> bool:
        """Straight into the block when its bytes are host memory in the store's order: the
        whole Full Block (our cache), or each layer's page (vLLM's: one positioned read
        scatters the file into them); through a host copy otherwise."""
        cache = self.cache
        host = cache.host_view(block_id)
        layers = None if host is not None else self._layer_views(block_id)
        nbytes = cache.layout.full_block_bytes
        try:
            if layers is not None:
                self._mover("snic", nbytes, lambda: self.store.read_layers(key, layers))
                return True
            data = self._mover("snic", nbytes, lambda: self.store.read(key, out=host))
        except KVStoreError as exc:
            logger.warning("block %s unreadable, recomputing from it: %s", key, exc)
            return False
        if host is None:
            cache.load_full_block(block_id, data)
        return True

    def _layer_views(self, block_id: int) -> list[np.ndarray] | None:
        layers = range(self.cache.layout.num_layers)
        views = [self.cache.layer_view(layer, (block_id,)) for layer in layers]
        if any(view is None for view in views):
            return None
        return [view[0] for view in views]

    def persist(self, key: BlockKey, block_id: int) -> None:
        """Queue device block ``block_id`` for writing under ``key``; returns at once."""
        data = self.cache.copy_full_block(block_id)
        self._reap()
        while self._pending and self._pending_bytes + data.nbytes > self._max_pending_write_bytes:
            self._pop_oldest()
        with self._lock:
            self._pending_keys[key] += 1
            self._num_unfinished_writes += 1
        self._pending.append((self._writer.submit(self._write_one, key, data), data.nbytes))
        self._pending_bytes += data.nbytes

    def pending(self, keys: Iterable[BlockKey]) -> tuple[BlockKey, ...]:
        """Those of ``keys`` with a write still queued or running (a snapshot: thread-safe)."""
        with self._lock:
            return tuple(key for key in keys if key in self._pending_keys)

    def _write_one(self, key: BlockKey, data: np.ndarray) -> bool:
        def write() -> None:
            if not self.store.write(key, data):
                raise _AlreadyStored  # nothing crossed the SNIC: the mover drops the movement

        try:
            self._mover("snic", data.nbytes, write)
            return True
        except _AlreadyStored:
            return False
        except KVStoreError as exc:
            logger.warning("block %s not persisted: %s", key, exc)
            return False
        finally:
            with self._lock:
                self._num_unfinished_writes -= 1
                self._pending_keys[key] -= 1
                if not self._pending_keys[key]:
                    del self._pending_keys[key]

    def _pop_oldest(self) -> None:
        future, size = self._pending.popleft()
        future.result()
        self._pending_bytes -= size

    def _reap(self) -> None:
        while self._pending and self._pending[0][0].done():
            self._pop_oldest()

    @property
    def num_unfinished_writes(self) -> int:
        """Full Blocks queued or being written (a finished write stops counting at once, before
        it is reaped from the write queue): the node's SNIC still has to move them, so they
        count in its storage queue (the scheduler's ``write_q``)."""
        return self._num_unfinished_writes

    def flush(self, timeout_s: float | None = None) -> int:
        """Block until every queued write has finished (or failed and been counted).

        With ``timeout_s``, give up then (a store that hangs, e.g. a cut-off network mount)
        and return how many writes are still unfinished; 0 when all are done.
        """
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while self._pending:
            future, _ = self._pending[0]
            if deadline_s is not None:
                try:
                    future.result(max(0.0, deadline_s - time.monotonic()))
                except TimeoutError:
                    return len(self._pending)
            self._pop_oldest()
        return 0

    def close(self) -> None:
        self.flush()
        self._readers.shutdown(wait=True)
        self._writer.shutdown(wait=True)

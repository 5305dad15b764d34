"""The external KV store's interface: Full Blocks keyed by chained hashes, one namespace per
model fingerprint.

``KVStore`` is the interface the engine uses; ``FileKVStore`` (``file_store.py``) keeps one
plain file per Full Block on a local directory or any distributed POSIX mount, and
``MemoryKVStore`` here is an in-process dict with the same semantics, the fake for tests of
code that uses a ``KVStore`` (the ``oracle`` mode uses a ``FileKVStore`` too, on /dev/shm in
the benchmarks). Both keep their index in the same LRU order (``LruIndex``), and both keep an
agent session's blocks against capacity pressure while the session may come back
(``retain``; ``retention.py`` says how).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from dualpath.errors import BlockNotFound
from dualpath.kv.hashing import BlockKey, key_to_bytes
from dualpath.kv.layout import BlockBuffer, KVLayout
from dualpath.kv.retention import RetainedKeys


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters since the store object was created; a snapshot, never updated in place."""

    lookups: int = 0  # lookup() calls
    hit_blocks: int = 0  # leading keys lookup() found
    miss_blocks: int = 0  # keys lookup() was asked about past the first miss
    reads: int = 0  # successful reads
    read_bytes: int = 0  # payload (Full Block) bytes of successful reads
    writes: int = 0  # blocks written
    write_bytes: int = 0  # payload bytes of blocks written
    duplicate_writes: int = 0  # writes skipped because the block was present
    evictions: int = 0  # blocks removed to stay within capacity_bytes
    corrupt_blocks: int = 0  # damaged blocks found (and deleted)
    missing_on_read: int = 0  # reads of blocks that were gone (evicted or deleted elsewhere)
    write_errors: int = 0  # writes that raised StoreWriteError
    # Of ``evictions``: blocks evicted while retained (``retain``), nothing else being left.
    retained_evictions: int = 0


STAT_NAMES = tuple(field.name for field in dataclasses.fields(StoreStats))


class KVStore(ABC):
    """Full Blocks keyed by chained hashes, one namespace per model fingerprint.

    Every method is thread-safe. A block's bytes never change once written (keys are content
    addresses), so a write of a present key is a no-op. A block may disappear at any time
    (eviction, another process, damage): ``lookup`` is a hint and ``read`` is the truth.
    """

    layout: KVLayout
    fingerprint: str

    @abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of consecutive leading ``keys`` present (the cached prefix, in blocks).

        Stops at the first absent key: a gap ends the hit. Marks the hit blocks recently used,
        the first key most recently, so eviction takes a prefix's tail before its root.
        """

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether ``key`` is present; does not count as a use."""

    @abstractmethod
    def read(self, key: BlockKey, out: np.ndarray | None = None) -> np.ndarray:
        """The whole Full Block as ``uint8 [L, bs, bpt]``, written into ``out`` if given.

        ``out`` must be a writeable C-contiguous ``uint8`` array of ``layout.full_block_shape``;
        after a failed read its contents are undefined. Raises ``BlockNotFound`` if the block is
        absent and ``CorruptBlock`` if it is damaged (it is then deleted).
        """

    def read_layers(self, key: BlockKey, layer_blocks: Sequence[np.ndarray]) -> None:
        """The Full Block with Layer Block l written into ``layer_blocks[l]`` (writeable
        C-contiguous ``uint8`` arrays of ``layout.layer_block_shape``, e.g. an engine's pages,
        one tensor per layer); errors as ``read``. Here through a host copy; a store that can
        scatter its read (``FileKVStore``) lands it in them directly."""
        full_block = self.read(key)
        for layer, layer_block in enumerate(check_layer_blocks(layer_blocks, self.layout)):
            layer_block[...] = full_block[layer]

    @abstractmethod
    def write(self, key: BlockKey, full_block: BlockBuffer) -> bool:
        """Store ``full_block`` under ``key``; ``False`` if it was already present.

        Atomic and idempotent: readers see the whole block or nothing. ``full_block`` is left
        untouched. Raises ``ValueError`` if its size is not ``layout.full_block_bytes`` and
        ``StoreWriteError`` if nothing could be stored.
        """

    @abstractmethod
    def retain(self, keys: Sequence[BlockKey], retention_s: float) -> None:
        """Keep ``keys`` against capacity pressure for ``retention_s`` from now (an agent
        session's blocks, ``retention.py``): eviction passes them over while it has anything
        else to evict. Keys need not be present yet (a block still being written). May
        repeat: a later deadline extends an earlier one. A no-op for a store without a
        capacity: it evicts nothing."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""

    @abstractmethod
    def close(self) -> None:
        """Release the store; later calls other than ``stats`` are a caller bug. May repeat."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Sized(Protocol):
    size_bytes: int


_EntryT = TypeVar("_EntryT", bound=_Sized)


class LruIndex(Generic[_EntryT]):
    """Keys in least-recently-used-first order with their sizes, and the retained ones
    (``retention.py``). Not thread-safe by itself."""

    def __init__(self, capacity_bytes: int | None, *, max_num_retained_keys: int = 1) -> None:
        """``max_num_retained_keys``: at most this many marks (e.g. the capacity in blocks)."""
        self.capacity_bytes = capacity_bytes
        self.total_bytes = 0
        self._key_to_entry: OrderedDict[str, _EntryT] = OrderedDict()
        self._retained = RetainedKeys(max_num_retained_keys)

    def __contains__(self, key: str) -> bool:
        return key in self._key_to_entry

    def get(self, key: str) -> _EntryT | None:
        return self._key_to_entry.get(key)

    def add(self, key: str, entry: _EntryT) -> bool:
        """Insert as most recently used; ``False`` (and no change) if already present."""
        if key in self._key_to_entry:
            return False
        self._key_to_entry[key] = entry
        self.total_bytes += entry.size_bytes
        return True

    def pop(self, key: str) -> _EntryT | None:
        entry = self._key_to_entry.pop(key, None)
        if entry is not None:
            self.total_bytes -= entry.size_bytes
        return entry

    def touch(self, key: str) -> _EntryT | None:
        """Mark ``key`` most recently used; ``None`` if absent."""
        entry = self._key_to_entry.get(key)
        if entry is not None:
            self._key_to_entry.move_to_end(key)
        return entry

    def retain(self, keys: Sequence[str], until_s: float, now_s: float) -> None:
        """Pass ``keys`` over in eviction until ``until_s`` (``KVStore.retain``); nothing to
        do for an index without a capacity, which never evicts."""
        if self.capacity_bytes is None:
            return
        self._retained.expire(now_s)
        self._retained.retain(keys, until_s)

    @property
    def num_retained_keys(self) -> int:
        """Marks held (retained keys, present or not, some maybe expired)."""
        return len(self._retained)

    def evict_over_capacity(
        self, *, keep: str | None = None, now_s: float = 0.0
    ) -> tuple[list[str], int]:
        """Remove least-recently-used keys until within capacity, never ``keep``, passing
        over the keys retained beyond ``now_s``; if only those are left, the least recently
        used of them go too. The keys removed, and how many of them were retained."""
        evicted: list[str] = []
        if self.capacity_bytes is None:
            return evicted, 0
        retained = self._retained
        passed_over: list[str] = []
        for key in list(self._key_to_entry):
            if self.total_bytes <= self.capacity_bytes:
                return evicted, 0
            if key == keep:
                continue
            if retained and retained.is_retained(key, now_s):
                passed_over.append(key)
                continue
            self.pop(key)
            evicted.append(key)
        num_retained = 0
        for key in passed_over:  # capacity is a hard bound: retained blocks, oldest first
            if self.total_bytes <= self.capacity_bytes:
                break
            self.pop(key)
            retained.discard(key)
            evicted.append(key)
            num_retained += 1
        return evicted, num_retained


class MemoryKVStore(KVStore):
    """An in-process dict with ``FileKVStore``'s semantics (the same LRU eviction, errors and
    statistics): the fake for tests of code that uses a ``KVStore``.

    ``capacity_bytes`` counts payload bytes (``full_block_bytes`` per block); ``clock``
    (seconds) times retention (``retain``).
    """

    def __init__(
        self,
        layout: KVLayout,
        fingerprint: str,
        *,
        capacity_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        key_to_bytes(fingerprint, what="fingerprint")
        if capacity_bytes is not None and capacity_bytes < layout.full_block_bytes:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} cannot hold one full block of "
                f"{layout.full_block_bytes} bytes ({layout})"
            )
        self.layout = layout
        self.fingerprint = fingerprint
        self._clock = clock
        self._lock = threading.Lock()
        self._index: LruIndex[_MemoryEntry] = LruIndex(
            capacity_bytes,
            max_num_retained_keys=(capacity_bytes or 0) // layout.full_block_bytes or 1,
        )
        self._stat_name_to_count = dict.fromkeys(STAT_NAMES, 0)
        self._is_closed = False

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        keys = list(keys)
        for key in keys:
            key_to_bytes(key)
        with self._lock:
            self._check_open()
            num_hits = 0
            while num_hits < len(keys) and keys[num_hits] in self._index:
                num_hits += 1
            for key in reversed(keys[:num_hits]):  # root last, as in FileKVStore.lookup
                self._index.touch(key)
            self._stat_name_to_count["lookups"] += 1
            self._stat_name_to_count["hit_blocks"] += num_hits
            self._stat_name_to_count["miss_blocks"] += len(keys) - num_hits
        return num_hits

    def contains(self, key: BlockKey) -> bool:
        key_to_bytes(key)
        with self._lock:
            self._check_open()
            return key in self._index

    def read(self, key: BlockKey, out: np.ndarray | None = None) -> np.ndarray:
        key_to_bytes(key)
        full_block = check_out(out, self.layout) if out is not None else None
        with self._lock:
            self._check_open()
            entry = self._index.touch(key)
            if entry is None:
                self._stat_name_to_count["missing_on_read"] += 1
                raise BlockNotFound(f"block {key} is not in the store")
            self._stat_name_to_count["reads"] += 1
            self._stat_name_to_count["read_bytes"] += entry.size_bytes
        stored = self.layout.as_full_block(entry.data)
        if full_block is None:
            return stored.copy()
        np.copyto(full_block, stored)
        return full_block

    def write(self, key: BlockKey, full_block: BlockBuffer) -> bool:
        key_to_bytes(key)
        data = self.layout.as_full_block(full_block).tobytes()
        with self._lock:
            self._check_open()
            if not self._index.add(key, _MemoryEntry(len(data), data)):
                self._stat_name_to_count["duplicate_writes"] += 1
                return False
            self._stat_name_to_count["writes"] += 1
            self._stat_name_to_count["write_bytes"] += len(data)
            evicted, num_retained = self._index.evict_over_capacity(keep=key, now_s=self._clock())
            self._stat_name_to_count["evictions"] += len(evicted)
            self._stat_name_to_count["retained_evictions"] += num_retained
        return True

    def retain(self, keys: Sequence[BlockKey], retention_s: float) -> None:
        for key in keys:
            key_to_bytes(key)
        now_s = self._clock()
        with self._lock:
            self._check_open()
            self._index.retain(keys, now_s + retention_s, now_s)

    def remove(self, key: BlockKey) -> bool:
        """Drop ``key`` as if another process had deleted it; ``False`` if absent."""
        with self._lock:
            return self._index.pop(key) is not None

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**self._stat_name_to_count)

    def close(self) -> None:
        with self._lock:
            self._is_closed = True

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError("caller bug: MemoryKVStore is closed")


@dataclass(frozen=True, slots=True)
class _MemoryEntry:
    size_bytes: int
    data: bytes


def check_layer_blocks(layer_blocks: Sequence[np.ndarray], layout: KVLayout) -> list[np.ndarray]:
    if len(layer_blocks) != layout.num_layers or not all(
        isinstance(b, np.ndarray)
        and b.dtype == np.uint8
        and b.shape == layout.layer_block_shape
        and b.flags.c_contiguous
        and b.flags.writeable
        for b in layer_blocks
    ):
        raise ValueError(
            f"layer_blocks must be {layout.num_layers} writeable C-contiguous uint8 arrays of "
            f"shape {layout.layer_block_shape}"
        )
    return list(layer_blocks)


def check_out(out: np.ndarray, layout: KVLayout) -> np.ndarray:
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.uint8
        or out.shape != layout.full_block_shape
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(
            f"out must be a writeable C-contiguous uint8 array of shape {layout.full_block_shape}"
            f", got {getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}"
        )
    return out

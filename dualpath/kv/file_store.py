"""``FileKVStore``: the ``KVStore`` (``store.py``) that keeps one plain file per Full Block on a
local directory or any distributed POSIX mount (NFS, CephFS, GlusterFS, 3FS). The layout on
disk, the block file's header and the atomic write live in ``block_file.py``; this module holds
the store object: its index of the directory, LRU eviction, retention and statistics.

Sharing rules (several engine processes may share one directory, each with its own store
object): writes go to a temp file and are published with ``os.replace``, so a block file is
either absent or complete; there are no locks, no mmap and no database. Each object's index is
only a cache of the directory: a miss is checked with ``os.stat``, and a block another process
evicted is noticed when its read finds the file gone (``BlockNotFound``). Eviction is
``os.unlink``, which is safe while readers are active: a reader that already opened the file
reads it to the end (POSIX keeps the inode alive); a reader racing the unlink gets
``BlockNotFound``. The engine recomputes any block it cannot read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dualpath.config import KVStoreConfig
from dualpath.errors import BlockNotFound, CorruptBlock, KVStoreError, StoreWriteError
from dualpath.kv.block_file import (
    BLOCK_FILE_SUFFIX,
    BlockFileFormat,
    ensure_namespace_file,
    is_temp_name,
    payload_checksum,
    publish_block_file,
    same_file,
)
from dualpath.kv.hashing import BlockKey, key_to_bytes
from dualpath.kv.layout import BlockBuffer, KVLayout
from dualpath.kv.store import (
    STAT_NAMES,
    KVStore,
    LruIndex,
    StoreStats,
    check_layer_blocks,
    check_out,
)

logger = logging.getLogger(__name__)

# A temp file this old belongs to a writer that died; a live write takes milliseconds.
_STALE_TMP_AGE_S = 3600.0
# Refresh a used block's mtime (the LRU order other processes' scans see) at most this often:
# on a network mount every utime is a metadata round trip.
_TOUCH_INTERVAL_S = 60.0


NUM_FANOUT_DIRS = 256  # <key[:2]>: two hex digits


@dataclass(slots=True)
class _FileEntry:
    size_bytes: int
    mtime_s: float  # wall-clock time of the file's mtime as we last saw or set it


class FileKVStore(KVStore):
    """One file per Full Block under ``root_dir/<fingerprint>/``; see the module docstring.

    ``capacity_bytes`` bounds the block files (header included) this object knows of; beyond
    it the least-recently-used blocks are deleted after each write, and at start-up if the
    directory is already over budget. Blocks other processes wrote join the budget once this
    object sees them, so the directory can overshoot by blocks nobody here has looked up yet.
    Retained blocks (``retain``) are this object's marks, like its LRU order: a session's
    blocks are kept by the engines that served it, the ones that write (and so evict) them.
    An eviction racing a rewrite of the same key can leave the index naming a deleted file
    (there are no locks on disk); ``read`` then raises ``BlockNotFound`` and drops the key.
    """

    def __init__(
        self,
        root_dir: Path,
        layout: KVLayout,
        fingerprint: str,
        *,
        capacity_bytes: int | None = None,
        verify_checksums: bool = True,
        fsync_writes: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` (seconds) times retention (``retain``; mtimes use the wall clock)."""
        self.layout = layout
        self.fingerprint = fingerprint
        self._format = BlockFileFormat(layout, fingerprint)
        # Cached: read() is on the hot path and these are computed properties.
        self._full_block_shape = layout.full_block_shape
        self._full_block_bytes = layout.full_block_bytes
        self._block_file_bytes = self._format.block_file_bytes
        if capacity_bytes is not None and capacity_bytes < self._block_file_bytes:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} cannot hold one block file of "
                f"{self._block_file_bytes} bytes ({layout})"
            )
        self._verify_checksums = verify_checksums
        self._fsync_writes = fsync_writes
        self._namespace_dir = os.path.join(os.fspath(root_dir), fingerprint)
        self._clock = clock
        self._lock = threading.Lock()
        self._index: LruIndex[_FileEntry] = LruIndex(
            capacity_bytes,
            max_num_retained_keys=(capacity_bytes or 0) // self._block_file_bytes or 1,
        )
        self._stat_name_to_count = dict.fromkeys(STAT_NAMES, 0)
        self._is_closed = False
        try:
            is_new = not os.path.isdir(self._namespace_dir)
            os.makedirs(self._namespace_dir, exist_ok=True)
            if is_new:
                # Every fan-out directory at once: on a distributed file system each mkdir is
                # a round trip to every server, which the first write into it would pay.
                for fanout in range(NUM_FANOUT_DIRS):
                    os.makedirs(f"{self._namespace_dir}/{fanout:02x}", exist_ok=True)
        except OSError as exc:
            raise StoreWriteError(
                f"cannot create store namespace {self._namespace_dir}: {exc}"
            ) from exc
        ensure_namespace_file(self._namespace_dir, layout, fingerprint)
        self._load_index()

    @classmethod
    def from_config(cls, config: KVStoreConfig, layout: KVLayout, fingerprint: str) -> FileKVStore:
        if config.root_dir is None:
            raise ValueError("KVStoreConfig.root_dir is None: the store is disabled")
        return cls(
            config.root_dir,
            layout,
            fingerprint,
            capacity_bytes=config.capacity_bytes,
            verify_checksums=config.verify_checksums,
            fsync_writes=config.fsync_writes,
        )

    # -- the KVStore interface -----------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        self._check_open()
        keys = list(keys)
        num_hits = 0
        for key in keys:
            if not self._is_present(key):
                break
            num_hits += 1
        with self._lock:
            self._count("lookups")
            self._count("hit_blocks", num_hits)
            self._count("miss_blocks", len(keys) - num_hits)
            # Deepest block first, so the prefix's root ends most recently used: a trie loses
            # its leaves before its root, never leaving unreachable children behind.
            paths_to_touch = [self._mark_used(key) for key in reversed(keys[:num_hits])]
        self._touch_files(paths_to_touch)
        return num_hits

    def contains(self, key: BlockKey) -> bool:
        self._check_open()
        return self._is_present(key)

    def read(self, key: BlockKey, out: np.ndarray | None = None) -> np.ndarray:
        full_block = (
            check_out(out, self.layout)
            if out is not None
            else np.empty(self._full_block_shape, dtype=np.uint8)
        )
        self._read(key, [full_block])
        return full_block

    def read_layers(self, key: BlockKey, layer_blocks: Sequence[np.ndarray]) -> None:
        """One positioned read scatters the file's Layer Blocks straight into
        ``layer_blocks`` (``preadv``): no copy through a Full Block."""
        self._read(key, check_layer_blocks(layer_blocks, self.layout))

    def _read(self, key: BlockKey, payload: Sequence[np.ndarray]) -> None:
        """Read block ``key``'s payload into ``payload`` (its bytes in order)."""
        self._check_open()
        key_bytes = key_to_bytes(key)
        path = self._block_path(key)
        with self._lock:
            entry_before_open = self._index.get(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            with self._lock:
                # Drop the entry we trusted, not one a writer has just added (file and all).
                if entry_before_open is not None and self._index.get(key) is entry_before_open:
                    self._index.pop(key)
                self._count("missing_on_read")
            raise BlockNotFound(f"block {key} is not in the store (no file {path})") from None
        except OSError as exc:
            raise KVStoreError(f"cannot open block {key} at {path}: {exc}") from exc
        try:
            problem = self._format.read(
                fd, key_bytes, payload, verify_checksum=self._verify_checksums
            )
            if problem is not None:
                self._delete_corrupt(key, path, fd, problem)
        except OSError as exc:
            raise KVStoreError(f"reading block {key} from {path} failed: {exc}") from exc
        finally:
            os.close(fd)
        with self._lock:
            self._count("reads")
            self._count("read_bytes", self._full_block_bytes)
            path_to_touch = self._mark_used(key)
        self._touch_files([path_to_touch])

    def write(self, key: BlockKey, full_block: BlockBuffer) -> bool:
        self._check_open()
        key_bytes = key_to_bytes(key)
        payload = self.layout.as_full_block(full_block)
        if self._is_present(key):
            with self._lock:
                self._count("duplicate_writes")
            return False
        header = self._format.pack_header(key_bytes, payload_checksum([payload]))
        try:
            publish_block_file(self._namespace_dir, key, header, payload, fsync=self._fsync_writes)
        except OSError as exc:
            with self._lock:
                self._count("write_errors")
            raise StoreWriteError(
                f"writing block {key} ({self._block_file_bytes} bytes) under "
                f"{self._namespace_dir} failed: {exc}"
            ) from exc
        with self._lock:
            self._index.add(key, _FileEntry(self._block_file_bytes, time.time()))
            self._index.touch(key)
            self._count("writes")
            self._count("write_bytes", self._full_block_bytes)
            evicted, num_retained = self._index.evict_over_capacity(keep=key, now_s=self._clock())
            self._count("evictions", len(evicted))
            self._count("retained_evictions", num_retained)
        self._unlink_evicted(evicted)
        return True

    def retain(self, keys: Sequence[BlockKey], retention_s: float) -> None:
        self._check_open()
        for key in keys:
            key_to_bytes(key)
        now_s = self._clock()
        with self._lock:
            self._index.retain(keys, now_s + retention_s, now_s)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**self._stat_name_to_count)

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            self._index = LruIndex(self._index.capacity_bytes)

    # -- paths and the index -------------------------------------------------------------------

    def _block_path(self, key: str) -> str:
        return f"{self._namespace_dir}/{key[:2]}/{key}{BLOCK_FILE_SUFFIX}"

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError(f"caller bug: store {self._namespace_dir} is closed")

    def _count(self, name: str, amount: int = 1) -> None:
        """Caller holds the lock."""
        self._stat_name_to_count[name] += amount

    def _is_present(self, key: str) -> bool:
        """Index hit, or a complete file on disk (which then joins the index)."""
        key_to_bytes(key)
        with self._lock:
            if key in self._index:
                return True
        path = self._block_path(key)
        try:
            stat = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise KVStoreError(f"cannot stat block {key} at {path}: {exc}") from exc
        if stat.st_size != self._block_file_bytes:
            return False  # damaged; a read or the next start-up scan deletes it
        with self._lock:
            self._index.add(key, _FileEntry(stat.st_size, stat.st_mtime))
        return True

    def _mark_used(self, key: str) -> str | None:
        """Move ``key`` to most recently used; the path whose mtime is due a refresh, if any.

        Caller holds the lock. A key missing from the index (evicted while being read) stays
        missing: its file may be gone.
        """
        entry = self._index.touch(key)
        if entry is None:
            return None
        now_s = time.time()
        if now_s - entry.mtime_s < _TOUCH_INTERVAL_S:
            return None
        entry.mtime_s = now_s
        return self._block_path(key)

    def _touch_files(self, paths: Sequence[str | None]) -> None:
        """Best-effort mtime refresh, so other processes' start-up scans see the use."""
        for path in paths:
            if path is None:
                continue
            with contextlib.suppress(OSError):  # evicted or read-only mount: recency is a hint
                os.utime(path)

    def _load_index(self) -> None:
        """Index the namespace's block files, oldest mtime first; evict if over capacity."""
        found: list[tuple[float, str, int]] = []
        now_s = time.time()
        try:
            fanout_dirs = [entry for entry in os.scandir(self._namespace_dir) if entry.is_dir()]
            for fanout_dir in fanout_dirs:
                for entry in os.scandir(fanout_dir.path):
                    block = self._scan_entry(fanout_dir.name, entry, now_s)
                    if block is not None:
                        found.append(block)
        except OSError as exc:
            raise KVStoreError(f"cannot scan store namespace {self._namespace_dir}: {exc}") from exc
        found.sort()
        with self._lock:
            for mtime_s, key, size_bytes in found:
                self._index.add(key, _FileEntry(size_bytes, mtime_s))
            evicted, _ = self._index.evict_over_capacity()  # (nothing is retained yet)
            self._count("evictions", len(evicted))
            total_bytes = self._index.total_bytes
        self._unlink_evicted(evicted)
        logger.info("store %s: %d blocks, %d bytes", self._namespace_dir, len(found), total_bytes)

    def _scan_entry(
        self, fanout_name: str, entry: os.DirEntry[str], now_s: float
    ) -> tuple[float, str, int] | None:
        """``(mtime_s, key, size_bytes)`` of a sound-looking block file; cleans up the rest."""
        name = entry.name
        try:
            if is_temp_name(name):
                if now_s - entry.stat().st_mtime > _STALE_TMP_AGE_S:
                    os.unlink(entry.path)
                return None
            key = name.removesuffix(BLOCK_FILE_SUFFIX)
            if key == name or key[:2] != fanout_name or not _is_key(key):
                return None  # not ours; leave it alone
            stat = entry.stat()
            if stat.st_size != self._block_file_bytes:
                os.unlink(entry.path)
                logger.warning(
                    "deleted block file %s: %d bytes, expected %d",
                    entry.path,
                    stat.st_size,
                    self._block_file_bytes,
                )
                with self._lock:
                    self._count("corrupt_blocks")
                return None
        except FileNotFoundError:
            return None  # removed by another process meanwhile
        return (stat.st_mtime, key, stat.st_size)

    def _unlink_evicted(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                os.unlink(self._block_path(key))
            except FileNotFoundError:
                pass  # already gone: evicted or deleted by another process
            except OSError as exc:
                logger.warning("could not evict block %s: %s", key, exc)

    # -- damaged files -------------------------------------------------------------------------

    def _delete_corrupt(self, key: str, path: str, fd: int, problem: str) -> None:
        """Delete the damaged file ``fd`` was opened from, count it, raise ``CorruptBlock``."""
        is_gone = False
        try:
            # Only unlink the file we read: a writer may have replaced it meanwhile.
            if same_file(os.fstat(fd), os.stat(path)):
                os.unlink(path)
                is_gone = True
        except FileNotFoundError:
            is_gone = True
        except OSError as exc:
            logger.warning("could not delete corrupt block file %s: %s", path, exc)
        with self._lock:
            if is_gone:
                self._index.pop(key)
            self._count("corrupt_blocks")
        logger.warning("deleted corrupt block %s (%s): %s", key, path, problem)
        raise CorruptBlock(f"block {key} at {path} was corrupt and has been dropped: {problem}")


def _is_key(text: str) -> bool:
    try:
        key_to_bytes(text)
    except ValueError:
        return False
    return True

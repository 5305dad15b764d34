"""The block file: how ``FileKVStore`` (``file_store.py``) lays one Full Block out on disk, and
the positioned, atomic file I/O that reads and publishes it. Layout on disk::

    root_dir/<fingerprint>/namespace.json          human-readable description, never read back
    root_dir/<fingerprint>/<key[:2]>/<key>.kvb     one Full Block: header + payload
    root_dir/<fingerprint>/<key[:2]>/.<key>.kvb.tmp-<pid>-<random>   a write in progress

Block file = 68-byte little-endian header, then the Full Block's bytes ``[L, bs, bpt]``:

    offset  0  magic b"DPKV"       4  format version u32    8  fingerprint (16 raw bytes)
           24  block key (16)     40  num_layers u32       44  block_size_tokens u32
           48  bytes_per_token_per_layer u32               52  payload length u64
           60  xxh3_64 of the payload u64                  68  payload

A block file is written to a temp file beside it and published with ``os.replace``
(``publish_block_file``), so it is either absent or complete. The temp file's name is
``.<final name>.<no dots>``, the pattern of rsync's temp files, which GlusterFS's distribute
layer places where the final name hashes (its default ``rsync-hash-regex``): the rename stays
on one brick. A temp file placed by its own name lands elsewhere half the time on two bricks,
and its rename then leaves a link file on the final name's brick (more round trips for the
write, an inode more on the bricks). ``BlockFileFormat`` packs the header of a namespace's
block files and checks one on read; the store object, its index and its eviction live in
``file_store.py``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from dualpath.kv.hashing import FORMAT_VERSION, BlockKey, key_to_bytes
from dualpath.kv.layout import KVLayout

logger = logging.getLogger(__name__)

MAGIC = b"DPKV"
_HEADER = struct.Struct("<4sI16s16sIIIQQ")
HEADER_BYTES = _HEADER.size
_KEY_OFFSET = 24  # see the header diagram in the module docstring
_CHECKSUM_OFFSET = 60
assert HEADER_BYTES == _CHECKSUM_OFFSET + 8, "header offsets out of step with its struct"
BLOCK_FILE_SUFFIX = ".kvb"
TMP_MARKER = ".tmp-"  # in a temp file's name (``temp_path``, ``is_temp_name``)
NAMESPACE_FILE = "namespace.json"


class BlockFileFormat:
    """The header every block file of one namespace (``layout``, ``fingerprint``) carries.

    Every field but the key and the checksum is fixed by the namespace, so ``read`` compares
    them in one go (the fast path) and names the wrong field only when they differ.
    """

    __slots__ = (
        "fingerprint",
        "fingerprint_bytes",
        "full_block_shape",
        "full_block_bytes",
        "block_file_bytes",
        "_header_head",
        "_header_tail",
    )

    def __init__(self, layout: KVLayout, fingerprint: str) -> None:
        """``ValueError`` for a ``fingerprint`` that is not 32 hex digits."""
        self.fingerprint = fingerprint
        self.fingerprint_bytes = key_to_bytes(fingerprint, what="fingerprint")
        self.full_block_shape = layout.full_block_shape
        self.full_block_bytes = layout.full_block_bytes
        self.block_file_bytes = HEADER_BYTES + self.full_block_bytes
        # The header of every block file here, split around its key (and minus its checksum).
        expected_header = self.pack_header(bytes(16), 0)
        self._header_head = expected_header[:_KEY_OFFSET]
        self._header_tail = expected_header[_KEY_OFFSET + 16 : _CHECKSUM_OFFSET]

    def pack_header(self, key_bytes: bytes, checksum: int) -> bytes:
        """The header of block ``key_bytes`` whose payload has xxh3-64 ``checksum``."""
        return _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            self.fingerprint_bytes,
            key_bytes,
            *self.full_block_shape,
            self.full_block_bytes,
            checksum,
        )

    def read(
        self,
        fd: int,
        key_bytes: bytes,
        payload: Sequence[np.ndarray],
        *,
        verify_checksum: bool,
    ) -> str | None:
        """Read header and payload (straight into ``payload``'s arrays, in order); what is
        wrong, or ``None``."""
        header = bytearray(HEADER_BYTES)
        num_read = _preadv_full(fd, [header, *payload], self.block_file_bytes)
        if num_read < HEADER_BYTES:
            return f"file is {num_read} bytes, shorter than the {HEADER_BYTES}-byte header"
        # Fast path: every header field but the checksum is known; compare them in one go.
        if header[:_CHECKSUM_OFFSET] == self._header_head + key_bytes + self._header_tail:
            checksum = int.from_bytes(header[_CHECKSUM_OFFSET:], "little")
            if num_read != self.block_file_bytes:
                return f"file is {num_read} bytes, expected {self.block_file_bytes}"
            if verify_checksum and payload_checksum(payload) != checksum:
                return "payload checksum mismatch"
            return None
        return self._header_problem(header, key_bytes)

    def _header_problem(self, header: bytearray, key_bytes: bytes) -> str:
        """Which header field is wrong (the slow path, for the error message)."""
        magic, version, fingerprint, key_in_header, *shape, payload_bytes, _checksum = (
            _HEADER.unpack(header)
        )
        if magic != MAGIC:
            return f"bad magic {magic!r}"
        if version != FORMAT_VERSION:
            return f"format version {version}, expected {FORMAT_VERSION}"
        if fingerprint != self.fingerprint_bytes:
            return f"fingerprint {fingerprint.hex()}, expected {self.fingerprint}"
        if key_in_header != key_bytes:
            return f"header names block {key_in_header.hex()}"
        if tuple(shape) != self.full_block_shape:
            return f"shape {tuple(shape)}, expected {self.full_block_shape}"
        assert payload_bytes != self.full_block_bytes, "the fast path accepts this header"
        return f"payload length {payload_bytes}, expected {self.full_block_bytes}"


def block_file_path(root_dir: Path, fingerprint: str, key: BlockKey) -> Path:
    """Where ``FileKVStore`` keeps ``key``'s file: for tools, tests and benchmarks only."""
    return Path(root_dir) / fingerprint / key[:2] / f"{key}{BLOCK_FILE_SUFFIX}"


def payload_checksum(payload: Sequence[np.ndarray]) -> int:
    """xxh3-64 of the payload's bytes in order (streamed: the same as of their concatenation)."""
    if len(payload) == 1:
        return xxhash.xxh3_64_intdigest(payload[0])
    hasher = xxhash.xxh3_64()
    for part in payload:
        hasher.update(part)
    return hasher.intdigest()


def temp_path(path: str) -> str:
    """A new temp file's path beside ``path``, for a write published by renaming it there."""
    directory, name = os.path.split(path)
    return f"{directory}/.{name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}"


def is_temp_name(name: str) -> bool:
    """Whether a file name is a temp file's (``temp_path``; ``.tmp``-suffixed ones are
    older versions')."""
    return name.startswith(".") and (TMP_MARKER in name or name.endswith(".tmp"))


def publish_block_file(
    namespace_dir: str, key: str, header: bytes, payload: np.ndarray, *, fsync: bool
) -> None:
    """Write a temp file in the block's directory and rename it into place.

    On any error the temp file is removed, so no partial block is ever visible. ``fsync``
    also persists the data and the rename before returning.
    """
    fanout_dir = f"{namespace_dir}/{key[:2]}"
    path = f"{fanout_dir}/{key}{BLOCK_FILE_SUFFIX}"
    tmp_path = temp_path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(tmp_path, flags, 0o644)
    except FileNotFoundError:
        os.makedirs(fanout_dir, exist_ok=True)  # first block of this fan-out dir
        fd = os.open(tmp_path, flags, 0o644)
    try:
        try:
            _pwritev_full(fd, [header, payload])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)
        raise
    if fsync:
        _fsync_dir(fanout_dir)


def ensure_namespace_file(namespace_dir: str, layout: KVLayout, fingerprint: str) -> None:
    """(Re)write ``namespace.json`` if missing or not what we would write. Never trusted."""
    path = os.path.join(namespace_dir, NAMESPACE_FILE)
    info = {
        "note": "informational only: dualpath never reads this file back",
        "fingerprint": fingerprint,
        "format_version": FORMAT_VERSION,
        "num_layers": layout.num_layers,
        "block_size_tokens": layout.block_size_tokens,
        "bytes_per_token_per_layer": layout.bytes_per_token_per_layer,
        "header_bytes": HEADER_BYTES,
        "block_file_bytes": HEADER_BYTES + layout.full_block_bytes,
    }
    try:
        with open(path, encoding="utf-8") as file:
            if json.load(file) == info:
                return
    except (OSError, ValueError):
        pass  # missing or damaged: rewrite below
    tmp_path = temp_path(path)
    try:
        with open(tmp_path, "w", encoding="utf-8") as file:
            json.dump(info, file, indent=2)
            file.write("\n")
        os.replace(tmp_path, path)
    except OSError as exc:
        # A read-only mount can still serve reads; the file is only documentation.
        logger.warning("could not write %s: %s", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _byte_views(buffers: Sequence[bytes | bytearray | np.ndarray]) -> list[memoryview]:
    return [memoryview(buffer).cast("B") for buffer in buffers]


def _preadv_full(fd: int, buffers: Sequence[bytearray | np.ndarray], num_wanted: int) -> int:
    """Fill ``buffers`` (``num_wanted`` bytes in all) from offset 0, in one syscall if possible.

    Returns the bytes read; fewer than ``num_wanted`` only at end of file.
    """
    num_read = os.preadv(fd, buffers, 0)
    if num_read == num_wanted:
        return num_read  # the usual case: one syscall
    views = _advance(_byte_views(buffers), num_read)
    while views:
        num_new = os.preadv(fd, views, num_read)
        if num_new == 0:
            break
        num_read += num_new
        views = _advance(views, num_new)
    return num_read


def _pwritev_full(fd: int, buffers: Sequence[bytes | np.ndarray]) -> None:
    views = _byte_views(buffers)
    num_written = 0
    while views:
        num_new = os.pwritev(fd, views, num_written)
        if num_new == 0:
            raise OSError(errno.EIO, f"write made no progress after {num_written} bytes")
        num_written += num_new
        views = _advance(views, num_new)


def _advance(views: list[memoryview], num_bytes: int) -> list[memoryview]:
    """Drop the first ``num_bytes`` bytes (after a short read or write)."""
    while views and num_bytes >= len(views[0]):
        num_bytes -= len(views[0])
        views = views[1:]
    if num_bytes:
        views = [views[0][num_bytes:], *views[1:]]
    return views


def _fsync_dir(path: str) -> None:
    """Persist a rename; best effort, since some network file systems refuse directory fsync."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.debug("fsync of directory %s failed: %s", path, exc)

"""Store keys: model fingerprints and chained prefix hashes of Full Blocks (SPEC §3).

A block's key depends on its parent's key and its own token ids, so the keys of one prompt form
a path in a trie of Full Blocks, and a request's hit length is the longest run of leading keys
the store holds::

    tokens   [t0 .. t63][t64 .. t127][t128 .. t191][t192 .. t200]
    keys     k0 ------> k1 ---------> k2              (partial tail: no key)
             k0 = H(fingerprint, root, t0..t63)
             k1 = H(fingerprint, k0, t64..t127)

The model fingerprint namespaces every key: two checkpoints that differ in weights,
architecture, KV dtype, block size or format version never share a block. All hashes are
xxh3_128, written as 32 lowercase hex characters. No torch.

**Cache salts** (vLLM's ``cache_salt``, a tenant's namespace) start a prompt's chain at a root
of their own, and every key after follows from it::

    unsalted   k0 = H(fingerprint, 0x00 + 16 zero bytes,       t0..t63)
    salted     k0 = H(fingerprint, 0x02 + xxh3_128(salt utf-8), t0..t63)
    any        k1 = H(fingerprint, 0x01 + k0,                   t64..t127)

so a salted prompt shares no key with the same tokens unsalted or under another salt, while
the prompts of one salt still share their common prefix. The parent field is 17 bytes in all
three forms and its tag byte says which form it is, so a salted root's field never equals a
child's (whatever block key it holds) nor the plain root's, whatever the salt. Unsalted keys
are those of format 1 unchanged: a store written before salts existed stays readable. The store's layout (one
directory per fingerprint, the fingerprint in each block's header) does not see salts. The
separation is as strong as xxh3_128 is collision-free, which is not a cryptographic
guarantee (``docs/serving.md``, "Tenants").
"""

from __future__ import annotations

import array
import json
import os
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import xxhash

# Bump when the key derivation or the block file format changes; it is part of every fingerprint.
FORMAT_VERSION: int = 1

BlockKey = str  # 32 lowercase hex characters: an xxh3_128 digest

_KEY_RE = re.compile(r"[0-9a-f]{32}")
_DIGEST_CHUNK_BYTES = 1 << 20  # 1 MiB: big enough to stream at disk speed, small enough for RAM
_MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as little-endian uint32
# One tag byte keeps "no parent" apart from any 16-byte parent digest, and a salt's root
# apart from both (module docstring).
_ROOT_TAG = b"\x00" + bytes(16)
_CHILD_TAG = b"\x01"
_SALTED_ROOT_TAG = b"\x02"
assert array.array("I").itemsize == 4, "token hashing assumes a 4-byte C unsigned int"


def digest_files(paths: Sequence[Path]) -> str:
    """xxh3_128 over the files' bytes, in the given order, as hex.

    Each file's base name and size are mixed in before its bytes, so renaming, reordering or
    moving bytes between files changes the digest while moving the whole directory does not.
    Streams 1 MiB at a time. ``OSError`` (a missing or unreadable file) propagates; callers
    that load checkpoints translate it.
    """
    hasher = xxhash.xxh3_128()
    chunk = bytearray(_DIGEST_CHUNK_BYTES)
    chunk_view = memoryview(chunk)
    for path in paths:
        path = Path(path)
        with path.open("rb", buffering=0) as file:
            size_bytes = os.fstat(file.fileno()).st_size
            name = path.name.encode()
            hasher.update(struct.pack("<Q", len(name)) + name + struct.pack("<Q", size_bytes))
            while num_read := file.readinto(chunk_view):
                hasher.update(chunk_view[:num_read])
    return hasher.hexdigest()


def model_fingerprint(
    *,
    weights_digest: str,
    architecture: Mapping[str, object],
    kv_dtype: str,
    block_size_tokens: int,
    format_version: int = FORMAT_VERSION,
) -> str:
    """The namespace of a model's KV blocks, as 32 hex characters.

    ``architecture`` must be JSON-able (e.g. the checkpoint's config); it is serialized with
    sorted keys, so key order does not matter but any value change does.
    """
    if not weights_digest:
        raise ValueError("weights_digest must be a non-empty string")
    if not kv_dtype:
        raise ValueError("kv_dtype must be a non-empty string")
    if block_size_tokens <= 0:
        raise ValueError(f"block_size_tokens must be > 0, got {block_size_tokens}")
    fields = {
        "architecture": dict(architecture),
        "block_size_tokens": block_size_tokens,
        "format_version": format_version,
        "kv_dtype": kv_dtype,
        "weights_digest": weights_digest,
    }
    try:
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"architecture must be JSON-able: {exc}") from exc
    return xxhash.xxh3_128_hexdigest(canonical.encode())


def key_to_bytes(key: str, *, what: str = "block key") -> bytes:
    """The 16 raw bytes of a block key or fingerprint; ``ValueError`` if it is not 32 hex chars."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"{what} must be 32 lowercase hex characters, got {key!r}")
    return bytes.fromhex(key)


def chain_key(
    parent: BlockKey | None,
    token_ids: Sequence[int],
    fingerprint: str,
    *,
    cache_salt: str | None = None,
) -> BlockKey:
    """Key of the Full Block holding ``token_ids``; ``parent=None`` for a prompt's first block,
    chained to ``cache_salt``'s root if one is given (``_parent_tag``)."""
    token_bytes = _token_bytes(token_ids)
    if not token_bytes:
        raise ValueError("a block needs at least one token id")
    parent_tag = _parent_tag(parent, cache_salt)
    fingerprint_bytes = key_to_bytes(fingerprint, what="fingerprint")
    return xxhash.xxh3_128_hexdigest(fingerprint_bytes + parent_tag + token_bytes)


def _parent_tag(parent: BlockKey | None, cache_salt: str | None) -> bytes:
    """The 17 bytes a block's key hashes for what comes before it: its parent's key, else the
    plain root, else (salted) the salt's root. A parent already carries the salt of its
    chain, so ``cache_salt`` only matters for a first block."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
    if parent is not None:
        return _CHILD_TAG + key_to_bytes(parent)
    if cache_salt is None:
        return _ROOT_TAG
    return _SALTED_ROOT_TAG + xxhash.xxh3_128_digest(cache_salt.encode("utf-8"))


def block_keys(
    token_ids: Sequence[int],
    block_size_tokens: int,
    fingerprint: str,
    parent: BlockKey | None = None,
    *,
    cache_salt: str | None = None,
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``, block i chained to block i-1.

    ``parent`` is the key of the block just before ``token_ids`` (to extend a known prefix);
    ``cache_salt`` the tenant namespace the chain starts in when there is none (module
    docstring). A partial tail block gets no key. Equal to calling ``chain_key`` block by
    block.
    """
    if block_size_tokens <= 0:
        raise ValueError(f"block_size_tokens must be > 0, got {block_size_tokens}")
    fingerprint_bytes = key_to_bytes(fingerprint, what="fingerprint")
    parent_tag = _parent_tag(parent, cache_salt)
    token_bytes = _token_bytes(token_ids)
    block_bytes = 4 * block_size_tokens
    keys: list[BlockKey] = []
    for start in range(0, len(token_bytes) - block_bytes + 1, block_bytes):
        digest = xxhash.xxh3_128_digest(
            fingerprint_bytes + parent_tag + token_bytes[start : start + block_bytes]
        )
        keys.append(digest.hex())
        parent_tag = _CHILD_TAG + digest
    return keys


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes, converted in one pass (no per-block work)."""
    if isinstance(token_ids, np.ndarray):
        return _array_token_bytes(token_ids)
    try:
        # array("I") converts a list of ints about 3x faster than numpy and range-checks them.
        ids = array.array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from exc
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


def _array_token_bytes(ids: np.ndarray) -> bytes:
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(f"token_ids must be a flat array of ints, got {ids.dtype} {ids.shape}")
    if ids.size == 0:
        return b""
    lowest, highest = int(ids.min()), int(ids.max())
    if lowest < 0 or highest > _MAX_TOKEN_ID:
        raise ValueError(f"token ids must be in [0, 2**32), got min {lowest} max {highest}")
    return ids.astype("<u4", copy=False).tobytes()


def extend_block_keys(
    keys: list[BlockKey],
    token_ids: Sequence[int],
    num_blocks: int,
    block_size_tokens: int,
    fingerprint: str,
    *,
    cache_salt: str | None = None,
) -> None:
    """Extend ``keys``, the keys of the first ``len(keys)`` full blocks of ``token_ids`` under
    ``cache_salt``, to its first ``num_blocks``: a growing sequence's chain, each key computed
    once (what both engines persist a block under as it fills)."""
    if num_blocks <= len(keys):
        return
    start = len(keys) * block_size_tokens
    tokens = token_ids[start : num_blocks * block_size_tokens]
    parent = keys[-1] if keys else None
    keys.extend(block_keys(tokens, block_size_tokens, fingerprint, parent, cache_salt=cache_salt))

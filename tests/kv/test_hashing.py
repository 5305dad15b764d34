"""Chained block keys, model fingerprints and file digests."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from dualpath.kv.hashing import (
    FORMAT_VERSION,
    block_keys,
    chain_key,
    digest_files,
    model_fingerprint,
)

BLOCK_SIZE = 4
FINGERPRINT_FIELDS = {
    "weights_digest": "0123abcd",
    "architecture": {"num_layers": 2, "hidden_size": 8, "rope": {"theta": 10000.0}},
    "kv_dtype": "float32",
    "block_size_tokens": BLOCK_SIZE,
}
FINGERPRINT = model_fingerprint(**FINGERPRINT_FIELDS)
TOKEN_IDS = list(range(100, 100 + 4 * BLOCK_SIZE))  # exactly four full blocks


def test_keys_are_32_lowercase_hex() -> None:
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    for key in [FINGERPRINT, *keys]:
        assert re.fullmatch(r"[0-9a-f]{32}", key), key
    assert len(set(keys)) == 4


def test_key_derivation_is_pinned() -> None:
    # Keys name files that outlive the process: a change here orphans every stored block, so
    # it must come with a FORMAT_VERSION bump (which changes every fingerprint) and a new pin.
    assert FORMAT_VERSION == 1
    assert chain_key(None, [1, 2, 3, 4], "0" * 32) == "d75cc454108cfc0e43630817d12342d6"
    fingerprint = model_fingerprint(
        weights_digest="w", architecture={"a": 1}, kv_dtype="float16", block_size_tokens=64
    )
    assert fingerprint == "1646e382859e0b657022e9c5e96d6065"


def test_block_keys_equal_chain_key_block_by_block() -> None:
    parent = None
    expected = []
    for start in range(0, len(TOKEN_IDS), BLOCK_SIZE):
        parent = chain_key(parent, TOKEN_IDS[start : start + BLOCK_SIZE], FINGERPRINT)
        expected.append(parent)
    assert block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT) == expected


def test_changing_block_0_changes_every_key() -> None:
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    changed = block_keys([TOKEN_IDS[0] + 1, *TOKEN_IDS[1:]], BLOCK_SIZE, FINGERPRINT)
    assert all(a != b for a, b in zip(keys, changed, strict=True))


def test_changing_block_2_keeps_keys_0_and_1() -> None:
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    token_ids = list(TOKEN_IDS)
    token_ids[2 * BLOCK_SIZE + 3] += 1
    changed = block_keys(token_ids, BLOCK_SIZE, FINGERPRINT)
    assert changed[:2] == keys[:2]
    assert changed[2] != keys[2] and changed[3] != keys[3]


def test_same_block_under_another_prefix_gets_another_key() -> None:
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    assert chain_key(None, TOKEN_IDS[4:8], FINGERPRINT) != keys[1]


def test_partial_tail_block_gets_no_key() -> None:
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    assert block_keys(TOKEN_IDS[:-1], BLOCK_SIZE, FINGERPRINT) == keys[:3]
    assert block_keys(TOKEN_IDS + [7, 8, 9], BLOCK_SIZE, FINGERPRINT) == keys
    assert block_keys(TOKEN_IDS[: BLOCK_SIZE - 1], BLOCK_SIZE, FINGERPRINT) == []
    assert block_keys([], BLOCK_SIZE, FINGERPRINT) == []


def test_parent_extends_a_known_prefix() -> None:
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    tail = block_keys(TOKEN_IDS[2 * BLOCK_SIZE :], BLOCK_SIZE, FINGERPRINT, parent=keys[1])
    assert tail == keys[2:]


def test_numpy_and_list_token_ids_give_the_same_keys() -> None:
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    for dtype in (np.int64, np.uint32, np.int32):
        assert block_keys(np.array(TOKEN_IDS, dtype=dtype), BLOCK_SIZE, FINGERPRINT) == keys
    assert block_keys(tuple(TOKEN_IDS), BLOCK_SIZE, FINGERPRINT) == keys


def test_fingerprint_namespaces_every_key() -> None:
    other = model_fingerprint(**{**FINGERPRINT_FIELDS, "kv_dtype": "bfloat16"})
    keys = block_keys(TOKEN_IDS, BLOCK_SIZE, FINGERPRINT)
    other_keys = block_keys(TOKEN_IDS, BLOCK_SIZE, other)
    assert not set(keys) & set(other_keys)


@pytest.mark.parametrize(
    "bad_token_ids",
    [[-1], [2**32], [1.5], ["7"], [[1, 2]], np.array([-1]), np.array([2**32]), np.array([1.0])],
)
def test_bad_token_ids_raise_value_error(bad_token_ids: object) -> None:
    with pytest.raises(ValueError, match="token"):
        block_keys(bad_token_ids, 1, FINGERPRINT)
    with pytest.raises(ValueError, match="token"):
        chain_key(None, bad_token_ids, FINGERPRINT)


def test_largest_token_id_is_accepted() -> None:
    assert chain_key(None, [0, 2**32 - 1], FINGERPRINT) != chain_key(None, [0, 0], FINGERPRINT)


@pytest.mark.parametrize("bad_key", ["", "xyz", "A" * 32, "0" * 31, 12])
def test_bad_parent_or_fingerprint_raises_value_error(bad_key: object) -> None:
    with pytest.raises(ValueError, match="block key must be 32 lowercase hex"):
        chain_key(bad_key, [1], FINGERPRINT)
    with pytest.raises(ValueError, match="fingerprint must be 32 lowercase hex"):
        chain_key(None, [1], bad_key)
    with pytest.raises(ValueError, match="fingerprint must be 32 lowercase hex"):
        block_keys([1], 1, bad_key)


def test_empty_block_and_bad_block_size_raise_value_error() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        chain_key(None, [], FINGERPRINT)
    with pytest.raises(ValueError, match="block_size_tokens"):
        block_keys(TOKEN_IDS, 0, FINGERPRINT)


@pytest.mark.parametrize(
    "change",
    [
        {"weights_digest": "0123abce"},
        {"architecture": {"num_layers": 3, "hidden_size": 8, "rope": {"theta": 10000.0}}},
        {"architecture": {"num_layers": 2, "hidden_size": 8, "rope": {"theta": 10001.0}}},
        {"architecture": {"num_layers": 2, "hidden_size": 8}},
        {"kv_dtype": "bfloat16"},
        {"block_size_tokens": BLOCK_SIZE * 2},
        {"format_version": FORMAT_VERSION + 1},
    ],
)
def test_fingerprint_changes_with_each_field(change: dict) -> None:
    assert model_fingerprint(**{**FINGERPRINT_FIELDS, **change}) != FINGERPRINT


def test_fingerprint_ignores_architecture_key_order() -> None:
    reordered = {"rope": {"theta": 10000.0}, "hidden_size": 8, "num_layers": 2}
    assert model_fingerprint(**{**FINGERPRINT_FIELDS, "architecture": reordered}) == FINGERPRINT


@pytest.mark.parametrize(
    "change",
    [
        {"weights_digest": ""},
        {"kv_dtype": ""},
        {"block_size_tokens": 0},
        {"architecture": {"not_json": object()}},
        {"architecture": {"nan": float("nan")}},
    ],
)
def test_fingerprint_rejects_bad_fields(change: dict) -> None:
    with pytest.raises(ValueError):
        model_fingerprint(**{**FINGERPRINT_FIELDS, **change})


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_digest_files_covers_contents_order_names_and_boundaries(tmp_path: Path) -> None:
    a = _write(tmp_path / "ckpt" / "a.safetensors", b"weights-a" * 1000)
    b = _write(tmp_path / "ckpt" / "b.safetensors", b"weights-b")
    digest = digest_files([a, b])
    assert len(digest) == 32
    # Same bytes and names in another directory: same digest (the checkpoint moved).
    a2 = _write(tmp_path / "moved" / "a.safetensors", a.read_bytes())
    b2 = _write(tmp_path / "moved" / "b.safetensors", b.read_bytes())
    assert digest_files([a2, b2]) == digest
    assert digest_files([b, a]) != digest
    renamed = _write(tmp_path / "renamed" / "c.safetensors", b.read_bytes())
    assert digest_files([a, renamed]) != digest
    # The same concatenated bytes split differently between the files.
    a3 = _write(tmp_path / "split" / "a.safetensors", a.read_bytes() + b"w")
    b3 = _write(tmp_path / "split" / "b.safetensors", b"eights-b")
    assert digest_files([a3, b3]) != digest
    b.write_bytes(b"weights-B")
    assert digest_files([a, b]) != digest


def test_digest_files_streams_files_bigger_than_a_chunk(tmp_path: Path) -> None:
    data = np.random.default_rng(0).bytes((1 << 20) * 2 + 123)
    big = _write(tmp_path / "big.bin", data)
    flipped = bytearray(data)
    flipped[(1 << 20) + 5] ^= 1  # in the second chunk
    other = _write(tmp_path / "other" / "big.bin", bytes(flipped))
    assert digest_files([big]) != digest_files([other])


def test_digest_files_raises_os_error_for_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        digest_files([tmp_path / "missing.safetensors"])

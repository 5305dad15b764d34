"""Factories for the KV tests: a tiny layout (64-byte Full Blocks), a fingerprint, blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dualpath.kv.block_file import HEADER_BYTES
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.hashing import block_keys, model_fingerprint
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import KVStore, MemoryKVStore

TINY_LAYOUT = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=8)
TINY_FINGERPRINT = model_fingerprint(
    weights_digest="tiny-weights",
    architecture={"num_layers": 2, "hidden_size": 8},
    kv_dtype="uint8",
    block_size_tokens=TINY_LAYOUT.block_size_tokens,
)


def make_keys(num_blocks: int, *, first_token_id: int = 0) -> list[str]:
    """Chained keys of ``num_blocks`` Full Blocks of consecutive token ids."""
    token_ids = range(first_token_id, first_token_id + num_blocks * TINY_LAYOUT.block_size_tokens)
    return block_keys(list(token_ids), TINY_LAYOUT.block_size_tokens, TINY_FINGERPRINT)


def make_block(seed: int) -> np.ndarray:
    """A distinct random Full Block of ``TINY_LAYOUT``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=TINY_LAYOUT.full_block_shape, dtype=np.uint8)


def capacity_for(store_kind: str, num_blocks: float) -> int:
    """``capacity_bytes`` that holds ``num_blocks`` blocks (files count their header)."""
    block_bytes = TINY_LAYOUT.full_block_bytes + (HEADER_BYTES if store_kind == "file" else 0)
    return int(num_blocks * block_bytes)


StoreFactory = Callable[..., KVStore]


@pytest.fixture(params=["file", "memory"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_store(store_kind: str, tmp_path: Path) -> StoreFactory:
    """Builds a store of ``store_kind``; file stores share ``tmp_path / "store"``."""

    def make(*, capacity_blocks: float | None = None) -> KVStore:
        capacity_bytes = (
            None if capacity_blocks is None else capacity_for(store_kind, capacity_blocks)
        )
        if store_kind == "file":
            return FileKVStore(
                tmp_path / "store", TINY_LAYOUT, TINY_FINGERPRINT, capacity_bytes=capacity_bytes
            )
        return MemoryKVStore(TINY_LAYOUT, TINY_FINGERPRINT, capacity_bytes=capacity_bytes)

    return make

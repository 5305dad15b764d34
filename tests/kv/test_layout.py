"""KVLayout: Layer Blocks are views of the Full Block and concatenate back to it exactly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.kv.layout import KVLayout

LAYOUT = KVLayout(num_layers=3, block_size_tokens=4, bytes_per_token_per_layer=2)


def make_full_block(layout: KVLayout, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=layout.full_block_shape, dtype=np.uint8)


def test_sizes_and_shapes() -> None:
    assert LAYOUT.layer_block_bytes == 8
    assert LAYOUT.full_block_bytes == 24
    assert LAYOUT.layer_block_shape == (4, 2)
    assert LAYOUT.full_block_shape == (3, 4, 2)
    empty = LAYOUT.empty_full_block()
    assert empty.dtype == np.uint8 and empty.shape == (3, 4, 2) and not empty.any()


@pytest.mark.parametrize("field", ["num_layers", "block_size_tokens", "bytes_per_token_per_layer"])
@pytest.mark.parametrize("bad_value", [0, -1, True, 2.0])
def test_rejects_non_positive_or_non_int_fields(field: str, bad_value: object) -> None:
    fields = {"num_layers": 1, "block_size_tokens": 1, "bytes_per_token_per_layer": 1}
    with pytest.raises(ValueError, match=field):
        KVLayout(**{**fields, field: bad_value})


def test_layer_block_is_a_view_of_the_full_block() -> None:
    full_block = make_full_block(LAYOUT)
    layer_block = LAYOUT.layer_block(full_block, 1)
    assert layer_block.shape == (4, 2)
    assert np.shares_memory(layer_block, full_block)
    layer_block[:] = 7
    assert (full_block[1] == 7).all()
    assert not (full_block[0] == 7).all()


@pytest.mark.parametrize("layer", [-1, 3])
def test_layer_block_rejects_bad_layer(layer: int) -> None:
    with pytest.raises(ValueError, match=f"got {layer}"):
        LAYOUT.layer_block(make_full_block(LAYOUT), layer)


def test_layer_block_rejects_wrong_shape() -> None:
    with pytest.raises(ValueError, match="shape"):
        LAYOUT.layer_block(np.zeros((3, 4, 3), dtype=np.uint8), 0)


@given(
    num_layers=st.integers(1, 5),
    block_size_tokens=st.integers(1, 6),
    bytes_per_token_per_layer=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_layer_blocks_concatenate_to_exactly_the_full_block(
    num_layers: int, block_size_tokens: int, bytes_per_token_per_layer: int, seed: int
) -> None:
    layout = KVLayout(num_layers, block_size_tokens, bytes_per_token_per_layer)
    full_block = make_full_block(layout, seed)
    layer_blocks = [layout.layer_block(full_block, layer) for layer in range(num_layers)]
    rebuilt = layout.concat_layer_blocks(layer_blocks)
    assert np.array_equal(rebuilt, full_block)
    assert not np.shares_memory(rebuilt, full_block)
    # And in the other direction: independent Layer Blocks land at their layer, in order.
    rng = np.random.default_rng(seed + 1)
    separate = [
        rng.integers(0, 256, size=layout.layer_block_shape, dtype=np.uint8)
        for _ in range(num_layers)
    ]
    joined = layout.concat_layer_blocks(separate)
    assert joined.tobytes() == b"".join(layer_block.tobytes() for layer_block in separate)
    for layer, layer_block in enumerate(separate):
        assert np.array_equal(layout.layer_block(joined, layer), layer_block)


def test_concat_accepts_layer_blocks_as_1_bs_bpt_bytes_or_other_dtypes() -> None:
    full_block = make_full_block(LAYOUT)
    layer_blocks = [
        full_block[0][None],  # [1, bs, bpt], the Layer Block layout of SPEC §3
        full_block[1].tobytes(),
        full_block[2].copy().view(np.uint16),  # e.g. fp16 KV: reinterpreted as bytes
    ]
    assert np.array_equal(LAYOUT.concat_layer_blocks(layer_blocks), full_block)


def test_concat_rejects_wrong_count_and_size() -> None:
    full_block = make_full_block(LAYOUT)
    with pytest.raises(ValueError, match="expected 3 layer blocks, got 2"):
        LAYOUT.concat_layer_blocks([full_block[0], full_block[1]])
    with pytest.raises(ValueError, match="layer block 2 must be 8 bytes, got 7"):
        LAYOUT.concat_layer_blocks([full_block[0], full_block[1], bytes(7)])


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "uint8", "float32"])
def test_as_full_block_views_any_buffer(kind: str) -> None:
    data = bytearray(range(24))
    buf = {
        "bytes": bytes(data),
        "bytearray": data,
        "memoryview": memoryview(data),
        "uint8": np.frombuffer(data, dtype=np.uint8).reshape(2, 12),
        "float32": np.frombuffer(data, dtype=np.float32),
    }[kind]
    full_block = LAYOUT.as_full_block(buf)
    assert full_block.shape == (3, 4, 2) and full_block.dtype == np.uint8
    assert full_block.tobytes() == bytes(data)
    if kind != "bytes":
        assert np.shares_memory(full_block, np.frombuffer(data, dtype=np.uint8))


def test_as_full_block_rejects_wrong_size_and_strided_arrays() -> None:
    with pytest.raises(ValueError, match="must be 24 bytes .* got 23"):
        LAYOUT.as_full_block(bytes(23))
    strided = np.zeros(48, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        LAYOUT.as_full_block(strided)
    with pytest.raises(ValueError, match="C-contiguous"):
        LAYOUT.as_full_block(memoryview(strided))

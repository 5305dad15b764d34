"""vLLM's CPU pages as Layer Blocks, without vLLM: whole pages move as they are, a token range
of a page lands where ``page_entries`` (the page's meaning, token by token) says it is, in
float32 and bfloat16. That this packing is the kernel's own is ``check_packing``'s business,
run against vLLM's op when an engine starts (tests/vllm/test_setup.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualpath.kv.layout import KVLayout
from dualpath.vllm.cache import page_entries, pages
from dualpath.vllm.layouts import CpuAttentionPages

NUM_PAGES, HEADS, BLOCK, DIM, LAYERS = 9, 3, 16, 8, 2


def _cache(dtype: torch.dtype, *, seed: int | None = None) -> CpuAttentionPages:
    shape = (NUM_PAGES, HEADS, BLOCK, 2 * DIM)
    if seed is None:
        layers = [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
    else:
        generator = torch.Generator().manual_seed(seed)
        layers = [torch.randn(shape, generator=generator).to(dtype) for _ in range(LAYERS)]
    itemsize = layers[0].element_size()
    layout = KVLayout(LAYERS, BLOCK, 2 * HEADS * DIM * itemsize)
    return CpuAttentionPages(layers, layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_move_whole_and_token_ranges_land_at_their_tokens(dtype: torch.dtype) -> None:
    source = _cache(dtype, seed=0)
    block_ids = [7, 2, 5, 0]
    out = np.empty((len(block_ids), *source.layout.layer_block_shape), np.uint8)
    source.read_layer(1, block_ids, out)
    assert np.array_equal(out.reshape(len(block_ids), -1), pages(source.layers[1])[block_ids])

    by_pages, by_tokens = _cache(dtype), _cache(dtype)
    for page, block_id in zip(out, block_ids, strict=True):
        by_pages.write_layer(1, (block_id,), page[None])
        # In two ranges, to check the offsets too.
        by_tokens.write_layer(1, (block_id,), page[None], 0, 5)
        by_tokens.write_layer(1, (block_id,), page[None], 5, BLOCK - 5)
    assert torch.equal(by_pages.layers[1], by_tokens.layers[1])
    for block_id in block_ids:
        assert torch.equal(by_pages.layers[1][block_id], source.layers[1][block_id])
    untouched = [p for p in range(NUM_PAGES) if p not in block_ids]
    assert not by_pages.layers[1][untouched].any() and not by_pages.layers[0].any()

    # A range writes its tokens' K and V and nothing else of the page.
    partial = _cache(dtype)
    partial.write_layer(0, (3,), out[:1], 4, 6)
    got, expected = page_entries(partial.layers[0], 3), page_entries(source.layers[1], 7)
    assert torch.equal(got[4:10], expected[4:10])
    assert not got[:4].any() and not got[10:].any()


def test_page_entries_reads_k_dim_major_and_v_token_major() -> None:
    kv = torch.arange(NUM_PAGES * HEADS * BLOCK * 2 * DIM, dtype=torch.float32)
    kv = kv.view(NUM_PAGES, HEADS, BLOCK, 2 * DIM)
    entries = page_entries(kv, 4)
    assert entries.shape == (BLOCK, 2, HEADS, DIM)
    head_page = kv[4, 1].flatten()  # one head: K [DIM][BLOCK], then V [BLOCK][DIM]
    token, dim = 5, 3
    assert entries[token, 0, 1, dim] == head_page[dim * BLOCK + token]
    assert entries[token, 1, 1, dim] == head_page[BLOCK * DIM + token * DIM + dim]


def test_full_blocks_round_trip_through_the_store_order() -> None:
    source, target = _cache(torch.float32, seed=1), _cache(torch.float32)
    full_block = source.copy_full_block(6)
    for layer in range(LAYERS):
        assert np.array_equal(full_block[layer].reshape(-1), pages(source.layers[layer])[6])
    target.load_full_block(2, full_block)
    for layer in range(LAYERS):
        assert torch.equal(target.layers[layer][2], source.layers[layer][6])


def test_a_cache_whose_pages_are_not_the_layouts_layer_blocks_is_refused() -> None:
    layers = [torch.zeros((NUM_PAGES, HEADS, BLOCK, 2 * DIM)) for _ in range(LAYERS)]
    with pytest.raises(ValueError, match="-token pages of"):
        CpuAttentionPages(layers, KVLayout(LAYERS, BLOCK, 2 * HEADS * DIM * 2))
    with pytest.raises(ValueError, match="layers of"):
        CpuAttentionPages(layers, KVLayout(LAYERS + 1, BLOCK, 2 * HEADS * DIM * 4))

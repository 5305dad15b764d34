"""The moves between our entries and vLLM's CPU pages, without vLLM: whole blocks
(``write_blocks`` / ``read_blocks``, the connector's hot path) and token ranges
(``write_tokens``) agree on one page layout, in float32 and bfloat16. That this layout is the
kernel's own is ``check_packing``'s business, run against vLLM's op when an engine starts
(tests/vllm/test_setup.py)."""

from __future__ import annotations

import pytest
import torch

from dualpath.vllm.cache import read_blocks, write_blocks, write_tokens

NUM_PAGES, HEADS, BLOCK, DIM = 9, 3, 16, 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_blocks_and_token_ranges_share_one_page_layout(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    entries = torch.randn((4, BLOCK, 2, HEADS, DIM), generator=generator).to(dtype)
    block_ids = [7, 2, 5, 0]
    by_blocks = torch.zeros((NUM_PAGES, HEADS, BLOCK, 2 * DIM), dtype=dtype)
    write_blocks(by_blocks, block_ids, entries)
    by_tokens = torch.zeros_like(by_blocks)
    for i, block_id in enumerate(block_ids):  # in two ranges, to check the offsets too
        write_tokens(by_tokens, block_id, 0, entries[i, :5])
        write_tokens(by_tokens, block_id, 5, entries[i, 5:])
    assert torch.equal(by_blocks, by_tokens)
    back = torch.empty_like(entries)
    read_blocks(by_blocks, block_ids, back)
    assert torch.equal(back, entries)
    untouched = [p for p in range(NUM_PAGES) if p not in block_ids]
    assert not by_blocks[untouched].any()
    # K is stored transposed: a page's first half is [head_dim][block_size].
    k_page = by_blocks[7, 1].reshape(2, DIM * BLOCK)[0].reshape(DIM, BLOCK)
    assert torch.equal(k_page, entries[0, :, 0, 1].T)

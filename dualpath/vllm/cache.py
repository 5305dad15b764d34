"""vLLM's paged CPU KV cache as the store's blocks: a Layer Block *is* a vLLM page.

vLLM's CPU attention backend gives each layer one tensor ``[num_blocks, kv_heads, block_size,
2 * head_dim]``; block b of a layer is one contiguous page, which its kernel packs per head::

    one head of a page, 2 * block_size * head_dim elements
    |<------ K: [head_dim][block_size] ------>|<------ V: [block_size][head_dim] ------>|
               dim-major (K transposed)                   token-major

A vLLM engine's Layer Block holds that page byte for byte (the order ``VLLM_CPU_PAGE_ORDER``
names in the store fingerprint), so every whole-block move of vLLM KV -- store to buffer,
buffer to page, page to a DE's buffer, page to the store -- is one contiguous copy per page,
never a reorder. Only a token range of a page (the partial last block of a prompt) needs the
packing above. The packing is the kernel's choice (it differs by ISA), so ``check_packing``
compares it with vLLM's own packing op at start and refuses to run on a mismatch: a page in
another order can never reach the store under this name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import torch

from dualpath.model.identity import VLLM_CPU_PAGE_ORDER

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """The layer number in a vLLM attention layer's name (``model.layers.N.self_attn.attn``)."""
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"vLLM layer name {layer_name!r} has no '.layers.N.'")
    return int(match.group(1))


def layers_in_order(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's per-layer caches (``register_kv_caches``' dict) in layer order."""
    indexed = [(layer_index(name), kv) for name, kv in kv_caches.items()]
    indexed.sort(key=lambda pair: pair[0])
    if [index for index, _ in indexed] != list(range(len(indexed))):
        raise ValueError(f"vLLM's KV layers are not 0..{len(indexed) - 1}: {sorted(kv_caches)}")
    return [kv for _, kv in indexed]


def pages(kv: torch.Tensor) -> np.ndarray:
    """Every page of one layer as uint8 rows ``[num_blocks, page_bytes]`` (a view, no copy)."""
    return kv.view(torch.uint8).numpy().reshape(kv.shape[0], -1)


def head_views(
    page: np.ndarray, num_heads: int, block_size: int, itemsize: int
) -> tuple[np.ndarray, np.ndarray]:
    """K ``[kv_heads, head_dim, block_size]`` and V ``[kv_heads, block_size, head_dim]`` of
    one uint8 page, as same-sized integers (views; numpy has no bfloat16)."""
    raw = page.view({4: np.int32, 2: np.int16}[itemsize])
    head_dim = raw.size // (2 * num_heads * block_size)
    keys = raw.reshape(num_heads, 2, head_dim, block_size)[:, 0]
    values = raw.reshape(num_heads, 2, block_size, head_dim)[:, 1]
    return keys, values


def page_entries(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """Block ``block_id`` of one layer as token entries ``[block_size, 2, kv_heads, head_dim]``
    (K then V, our native engine's entry; a copy): what the page means, token by token."""
    _, num_heads, block_size, two_dims = kv.shape
    keys = kv[block_id].reshape(num_heads, 2, two_dims // 2 * block_size)[:, 0]
    keys = keys.unflatten(-1, (two_dims // 2, block_size)).permute(2, 0, 1)
    values = kv[block_id].reshape(num_heads, 2, block_size, two_dims // 2)[:, 1].permute(1, 0, 2)
    return torch.stack([keys, values], dim=1).contiguous()


def check_packing(num_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """``RuntimeError`` unless vLLM's CPU kernel packs a page in ``VLLM_CPU_PAGE_ORDER``:
    every element of two pages written by vLLM's own op is found at its token, head and
    dimension by ``page_entries`` (each value encodes its position)."""
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_dim)
    kv = torch.zeros(2, num_heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv.view(2, num_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    num_tokens = 2 * block_size
    # Distinct, exactly representable codes (small integers, exact even in bfloat16 below 256).
    index = torch.arange(num_tokens * num_heads * head_dim, dtype=torch.float64)
    code = (index % 251 + 1).view(num_tokens, num_heads, head_dim).to(dtype)
    ops.cpu_attn_reshape_and_cache(
        code, -code, key_cache, value_cache, torch.arange(2 * block_size), isa
    )
    for block_id in range(2):
        expected = code[block_id * block_size : (block_id + 1) * block_size]
        got = page_entries(kv, block_id)
        if not (torch.equal(got[:, 0], expected) and torch.equal(got[:, 1], -expected)):
            raise RuntimeError(
                f"vLLM's CPU attention kernel (ISA {isa!r}, {dtype}, block size {block_size}, "
                f"head dim {head_dim}) packs KV pages in an order other than the store's "
                f"{VLLM_CPU_PAGE_ORDER!r}: serving with it would put mislabelled blocks in the "
                "store, so this engine does not start"
            )

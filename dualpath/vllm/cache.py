"""vLLM's paged CPU KV cache seen as our Layer Blocks and Full Blocks.

vLLM's CPU attention backend gives each layer one tensor ``[num_blocks, kv_heads, block_size,
2 * head_dim]``, but its kernel packs every (block, head) page in its own order::

    page of (block b, head h), 2 * block_size * head_dim elements
    |<------ K: [head_dim][block_size] ------>|<------ V: [block_size][head_dim] ------>|
               dim-major (K transposed)                   token-major

Our entry of one token in one layer is ``[2, kv_heads, head_dim]`` (K then V), so a Layer
Block is ``[block_size, 2, kv_heads, head_dim]`` and a Full Block stacks the layers (SPEC §3).
A vLLM page and a Layer Block hold the same bytes in different orders; K and V need one
strided copy each. Since the packing is the kernel's choice (it differs by ISA),
``check_packing`` compares these views with vLLM's own packing op at start and refuses to run
on a mismatch, so a wrong order can never reach the store.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from dualpath.kv.layout import KVLayout

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


def _k_pages(kv: torch.Tensor) -> torch.Tensor:
    """K of every page: ``[num_blocks, kv_heads, head_dim, block_size]`` (a view)."""
    num_blocks, num_heads, block_size, two_dims = kv.shape
    head_dim = two_dims // 2
    return kv.view(num_blocks, num_heads, 2, head_dim * block_size)[:, :, 0].unflatten(
        -1, (head_dim, block_size)
    )


def _v_pages(kv: torch.Tensor) -> torch.Tensor:
    """V of every page: ``[num_blocks, kv_heads, block_size, head_dim]`` (a view)."""
    num_blocks, num_heads, block_size, two_dims = kv.shape
    return kv.view(num_blocks, num_heads, 2, block_size, two_dims // 2)[:, :, 1]


def write_tokens(kv: torch.Tensor, block_id: int, first: int, entries: torch.Tensor) -> None:
    """Write our entries ``[num, 2, kv_heads, head_dim]`` at tokens ``first ..`` of block
    ``block_id`` of one layer; the page's other tokens are left as they are."""
    num = entries.shape[0]
    _k_pages(kv)[block_id, :, :, first : first + num].copy_(entries[:, 0].permute(1, 2, 0))
    _v_pages(kv)[block_id, :, first : first + num].copy_(entries[:, 1].permute(1, 0, 2))


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s elements as same-sized integers in numpy (no copy): moving KV is moving
    bytes, and numpy has no bfloat16."""
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()]).numpy()


def _page_views(kv: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """K ``[blocks, kv_heads, head_dim, block_size]`` and V ``[blocks, kv_heads, block_size,
    head_dim]`` of every page, as numpy views."""
    num_blocks, num_heads, block_size, two_dims = kv.shape
    head_dim = two_dims // 2
    raw = _raw(kv)
    keys = raw.reshape(num_blocks, num_heads, 2, head_dim, block_size)[:, :, 0]
    values = raw.reshape(num_blocks, num_heads, 2, block_size, head_dim)[:, :, 1]
    return keys, values


def write_blocks(kv: torch.Tensor, block_ids: Sequence[int], entries: torch.Tensor) -> None:
    """Whole blocks of our entries ``[n, block_size, 2, kv_heads, head_dim]`` into pages
    ``block_ids`` of one layer. numpy's strided copies: torch's copy of a permuted view moves
    KV at a third of their speed here (measured on the K transpose)."""
    keys, values = _page_views(kv)
    source = _raw(entries)
    for i, block_id in enumerate(block_ids):
        np.copyto(keys[block_id], source[i, :, 0].transpose(1, 2, 0))
        np.copyto(values[block_id], source[i, :, 1].transpose(1, 0, 2))


def read_blocks(kv: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor) -> None:
    """Pages ``block_ids`` of one layer, whole, into our entries ``out`` ``[n, block_size, 2,
    kv_heads, head_dim]`` (``write_blocks`` backwards)."""
    keys, values = _page_views(kv)
    target = _raw(out)
    for i, block_id in enumerate(block_ids):
        np.copyto(target[i, :, 0], keys[block_id].transpose(2, 0, 1))
        np.copyto(target[i, :, 1], values[block_id].transpose(1, 0, 2))


def check_packing(num_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """``RuntimeError`` unless vLLM's CPU kernel packs a page the way ``read_blocks`` reads it:
    every element of two pages written by vLLM's own op is read back at its token, head and
    dimension (each value encodes its position)."""
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
        got = torch.empty((1, block_size, 2, num_heads, head_dim), dtype=dtype)
        read_blocks(kv, [block_id], got)
        got = got[0]
        if not (torch.equal(got[:, 0], expected) and torch.equal(got[:, 1], -expected)):
            raise RuntimeError(
                f"vLLM's CPU attention kernel (ISA {isa!r}, {dtype}, block size {block_size}, "
                f"head dim {head_dim}) packs KV pages in an order dualpath cannot map: serving "
                "with it would corrupt the store, so this engine does not start"
            )


class VllmPagedCache:
    """vLLM's cache of one engine as blocks of ``layout`` (a ``kv_io.BlockCache``): store
    reads and writes move Full Blocks through a host copy (a vLLM block is no contiguous Full
    Block, so ``host_view`` is None); the connector moves token ranges of one layer."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout) -> None:
        num_blocks, num_heads, block_size, two_dims = layers[0].shape
        self.num_heads = num_heads
        self.head_dim = two_dims // 2
        self.dtype = layers[0].dtype
        entry_bytes = 2 * num_heads * self.head_dim * layers[0].element_size()
        if len(layers) != layout.num_layers or block_size != layout.block_size_tokens:
            raise ValueError(
                f"vLLM's cache has {len(layers)} layers of {block_size}-token blocks; the "
                f"store's layout has {layout.num_layers} of {layout.block_size_tokens}"
            )
        if entry_bytes != layout.bytes_per_token_per_layer:
            raise ValueError(
                f"vLLM caches {entry_bytes} bytes per token per layer; the store's layout has "
                f"{layout.bytes_per_token_per_layer}"
            )
        self.layers = list(layers)
        self.layout = layout
        self.num_blocks = num_blocks

    @property
    def entry_shape(self) -> tuple[int, int, int]:
        return (2, self.num_heads, self.head_dim)

    def as_entries(self, layer_blocks: np.ndarray) -> torch.Tensor:
        """uint8 Layer Blocks ``[..., block_size, bytes_per_token_per_layer]`` viewed as our
        entries ``[..., block_size, 2, kv_heads, head_dim]`` (no copy)."""
        return torch.from_numpy(layer_blocks).view(self.dtype).unflatten(-1, self.entry_shape)

    def write_layer(self, layer: int, block_id: int, first: int, entries: torch.Tensor) -> None:
        write_tokens(self.layers[layer], block_id, first, entries)

    def write_layer_blocks(
        self, layer: int, block_ids: Sequence[int], entries: torch.Tensor
    ) -> None:
        """Whole blocks of one layer: ``entries`` ``[n, block_size, 2, kv_heads, head_dim]``."""
        write_blocks(self.layers[layer], block_ids, entries)

    def read_layer_blocks(self, layer: int, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Whole blocks of one layer into ``out`` ``[n, block_size, 2, kv_heads, head_dim]``."""
        read_blocks(self.layers[layer], block_ids, out)

    # --- kv_io.BlockCache -------------------------------------------------------------------

    def host_view(self, block_id: int) -> np.ndarray | None:
        return None

    def load_full_block(self, block_id: int, full_block: np.ndarray) -> None:
        entries = self.as_entries(full_block)
        for layer, kv in enumerate(self.layers):
            write_blocks(kv, [block_id], entries[layer : layer + 1])

    def copy_full_block(self, block_id: int) -> np.ndarray:
        full_block = self.layout.empty_full_block()
        entries = self.as_entries(full_block)
        for layer, kv in enumerate(self.layers):
            read_blocks(kv, [block_id], entries[layer : layer + 1])
        return full_block

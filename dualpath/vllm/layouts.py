"""vLLM 0.32's KV pages, per attention backend, as the store's Layer Blocks (``KVPages``).

What a connector is given (``register_kv_caches``) is one view per attention layer, made by
``allocate_kv_cache`` (``vllm/v1/worker/utils.py``) through ``create_kv_cache_views``
(``vllm/v1/kv_cache_interface.py``). Every backend gets the same logical shape::

    [num_blocks, H, block_size, C]      block b of a layer is kv[b]; a slot is b * block_size + t

    dense (FLASH_ATTN, TRITON_ATTN, FLASHINFER, CPU_ATTN)    H = kv heads, C = 2 * head_dim:
        kv[b, h, t] = [ K of token t, head h | V of token t, head h ]     (head_dim each)
        the kernels' view: key, value = kv.transpose(1, 2).split(head_dim, -1)
        (FlashInfer: kv.permute(*layout.layer_view_order), then the same split)
    MLA (CPU_MLA, AMX_MLA, FLASHMLA, TRITON_MLA)              H = 1, C = 576 for DeepSeek:
        kv[b, 0, t] = [ latent (kv_lora_rank 512) | rope (qk_rope_head_dim 64) ]
        the kernels' view: kv.squeeze(1), [num_blocks, block_size, C]

There is no K/V split dimension any more (RFC #42082): K and V of one token and head are one
cell. Where the cells sit is the engine's ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``),
one stride order of [L, B, H, N, C] resolved at start among those every backend accepts
(``supported_kv_cache_layouts``: CPU_ATTN only LBHNC; FlashInfer all but LHBNC; the others
any). Within a block the cells are token-major (NHD) or head-major (HND)::

    LBNHC "NHD"  | block 0: t0 [h0 K|V][h1 K|V] t1 [h0 K|V][h1 K|V] ... | block 1 ...
    LBHNC "HND"  | block 0: h0 [t0 K|V][t1 K|V] ... h1 [t0 K|V] ...     | block 1 ...
    BLNHC, BLHNC the same block, but block b of every layer side by side:
                 | block 0: layer 0 | layer 1 | ... | block 1: layer 0 | ...
    LHBNC, BHLNC heads outside blocks: one layer of one block is num_heads separate runs

A vLLM Layer Block is one block of one layer in the page's own memory order, so wherever that
block is one run of memory it moves as one copy (``layer_view`` is a zero-copy host view when a
run of adjacent blocks is one run too). Its ``order`` names that order in the store
fingerprint: ``VLLM_NHD_ORDER``, ``VLLM_HND_ORDER``, ``VLLM_MLA_ORDER`` and, for the CPU
kernel, ``VLLM_CPU_PAGE_ORDER`` (``cache.py``: within an HND page the kernel packs each head's
K dim-major, an order of its own that ``check_packing`` verifies at start). An order names no
backend: FlashAttention, Triton and FlashInfer pages in one order hold the same bytes.

Writes into device pages run on a side stream (``pages.CudaCopier``; ``HostCopier`` its CPU twin).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from dualpath.engine.pages import (
    CudaCopier,
    HostCopier,
    LayerBlockPages,
    PageCopier,
    adjacent,
)
from dualpath.kv.layout import KVLayout
from dualpath.model.identity import (
    VLLM_CPU_PAGE_ORDER,
    VLLM_HND_ORDER,
    VLLM_MLA_ORDER,
    VLLM_NHD_ORDER,
)
from dualpath.vllm.cache import check_packing, head_views, layers_in_order, pages

# Backend names as vLLM's ``get_name()`` gives them.
DENSE_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")
MLA_BACKENDS = ("CPU_MLA", "AMX_MLA", "FLASHMLA", "TRITON_MLA")
CPU_ATTN = "CPU_ATTN"


def _token_slice(
    layout: KVLayout, block_ids: Sequence[int], blocks: np.ndarray, first: int, num: int | None
) -> slice:
    """Tokens ``first .. first + num`` (to the block's end when ``num`` is None), after
    checking ``blocks`` holds one Layer Block per block id."""
    expected = (len(block_ids), *layout.layer_block_shape)
    if blocks.shape != expected or blocks.dtype != np.uint8:
        raise ValueError(
            f"expected uint8 Layer Blocks {expected}, got {blocks.dtype} {blocks.shape}"
        )
    end = layout.block_size_tokens if num is None else first + num
    if not 0 <= first <= end <= layout.block_size_tokens:
        raise ValueError(
            f"tokens {first}..{end} are not in a {layout.block_size_tokens}-token block"
        )
    return slice(first, end)


class CpuAttentionPages(LayerBlockPages):
    """vLLM's CPU attention pages (``cpu_attn.py``: LBHNC, contiguous layers, each head's cells
    packed by the kernel, see ``cache.py``): a Layer Block *is* a page, byte for byte, so whole
    blocks move as one contiguous copy; only a token range follows the packing."""

    backend = CPU_ATTN
    order = VLLM_CPU_PAGE_ORDER

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout) -> None:
        _, num_heads, block_size, two_dims = layers[0].shape
        self.num_heads = num_heads
        self.itemsize = layers[0].element_size()
        page_bytes = num_heads * block_size * two_dims * self.itemsize
        if (len(layers), block_size, page_bytes) != (
            layout.num_layers,
            layout.block_size_tokens,
            layout.layer_block_bytes,
        ):
            raise ValueError(
                f"vLLM's cache has {len(layers)} layers of {block_size}-token pages of "
                f"{page_bytes} bytes; the store's Layer Blocks are {layout.num_layers} layers "
                f"of {layout.block_size_tokens} tokens, {layout.layer_block_bytes} bytes"
            )
        self.layers = list(layers)
        self.pages = [pages(kv) for kv in self.layers]  # per layer: [num_blocks, page_bytes]
        # The same bytes as Layer Blocks, per layer [num_blocks, *layer_block_shape] (views).
        self._blocks = [p.reshape(len(p), *layout.layer_block_shape) for p in self.pages]
        self.layout = layout

    def write_layer(self, layer, block_ids, blocks, first=0, num=None) -> None:  # noqa: ANN001
        tokens = _token_slice(self.layout, block_ids, blocks, first, num)
        layer_pages = self.pages[layer]
        block_size = self.layout.block_size_tokens
        if tokens.stop - tokens.start == block_size:
            for block_id, block in zip(block_ids, blocks, strict=True):
                layer_pages[block_id] = block.reshape(-1)
            return
        shape = (self.num_heads, block_size, self.itemsize)
        for block_id, block in zip(block_ids, blocks, strict=True):
            source_keys, source_values = head_views(block.reshape(-1), *shape)
            keys, values = head_views(layer_pages[block_id], *shape)
            keys[:, :, tokens] = source_keys[:, :, tokens]
            values[:, tokens] = source_values[:, tokens]

    def read_layer(self, layer: int, block_ids: Sequence[int], out: np.ndarray) -> None:
        np.take(self.pages[layer], block_ids, axis=0, out=out.reshape(len(block_ids), -1))

    def layer_view(self, layer: int, block_ids: Sequence[int]) -> np.ndarray | None:
        if not block_ids or not adjacent(block_ids):
            return None
        return self._blocks[layer][block_ids[0] : block_ids[-1] + 1]


class StridedPages(LayerBlockPages):
    """vLLM's ``[num_blocks, H, block_size, C]`` views of a GPU backend or an MLA backend, in
    any ``KVCacheLayout``, on any device: each layer is addressed through its strides as bytes
    ``[num_blocks, *block]``, ``block`` being ``[block_size, H, C]`` (token-major pages) or
    ``[H, block_size, C]`` (head-major), the order a block's bytes have in memory."""

    def __init__(
        self, layers: Sequence[torch.Tensor], layout: KVLayout, copier: PageCopier, backend: str
    ) -> None:
        kv = layers[0]
        _, num_heads, block_size, content = kv.shape
        is_head_major = kv.stride(1) > kv.stride(2)
        if backend in MLA_BACKENDS:
            self.order = VLLM_MLA_ORDER
        else:
            self.order = VLLM_HND_ORDER if is_head_major else VLLM_NHD_ORDER
        bytes_per_token = num_heads * content * kv.element_size()
        if (len(layers), block_size, bytes_per_token) != layout.full_block_shape:
            raise ValueError(
                f"vLLM's {backend} cache has {len(layers)} layers of {block_size}-token blocks "
                f"of {bytes_per_token} bytes a token; the store's Layer Blocks are "
                f"{layout.full_block_shape} (layers, tokens, bytes a token)"
            )
        # uint8 (C's bytes are contiguous in every layout), the block in its memory order.
        interior = (1, 2, 3) if is_head_major else (2, 1, 3)
        self.pages = [k.view(torch.uint8).permute(0, *interior) for k in layers]
        self.token_axis = 2 if is_head_major else 1
        self.layout = layout
        self.copier = copier
        self.backend = backend

    def write_layer(self, layer, block_ids, blocks, first=0, num=None) -> None:  # noqa: ANN001
        tokens = _token_slice(self.layout, block_ids, blocks, first, num)
        pages = self.pages[layer]
        # (block, *block's dims) with the token dim cut to the range.
        cut = (slice(None),) * (self.token_axis - 1) + (tokens,)

        def put(source: torch.Tensor) -> None:
            index = torch.as_tensor(block_ids, dtype=torch.long, device=pages.device)
            source = source.view(len(block_ids), *pages.shape[1:])
            pages[(index, *cut)] = source[(slice(None), *cut)]

        self.copier.write(layer, blocks, put)

    def read_layer(self, layer: int, block_ids: Sequence[int], out: np.ndarray) -> None:
        pages = self.pages[layer]
        index = torch.as_tensor(block_ids, dtype=torch.long, device=pages.device)
        self.copier.read(layer, lambda: pages[index], out)

    def layer_view(self, layer: int, block_ids: Sequence[int]) -> np.ndarray | None:
        pages = self.pages[layer]
        if pages.device.type != "cpu" or not block_ids or not adjacent(block_ids):
            return None
        run = pages[block_ids[0] : block_ids[-1] + 1]
        if not run.is_contiguous():  # block-outer (other layers between) or head-outer
            return None
        return run.numpy().reshape(len(block_ids), *self.layout.layer_block_shape)

    def fence(self, layer: int) -> None:
        self.copier.fence(layer)


VllmPages = CpuAttentionPages | StridedPages


def choose_layout(
    kv_caches: Mapping[str, torch.Tensor], backend: str, layout: KVLayout
) -> VllmPages:
    """The adapter of the pages a vLLM engine registered (``register_kv_caches``' dict, layer
    name to view) for attention backend ``backend`` (vLLM's ``get_name()``), as blocks of
    ``layout`` (whose ``block_size_tokens`` is vLLM's block size, the unit of its block ids).
    The page order is read from the views' strides, never assumed from a shape. ``ValueError``
    naming the backend, shape and strides when the pages cannot be mapped, among them views in
    kernel blocks smaller than vLLM's blocks (as vLLM splits them for a backend with a fixed
    kernel block size, e.g. CPU_MLA's 16 tokens)."""
    layers = layers_in_order(kv_caches)
    kv = layers[0]

    def unmappable(why: str) -> ValueError:
        return ValueError(
            f"cannot map vLLM backend {backend!r}'s KV cache (shape {tuple(kv.shape)}, stride "
            f"{kv.stride()}, {kv.dtype}, {kv.device}): {why}"
        )

    if kv.dim() != 4 or kv.stride(3) != 1:
        raise unmappable("expected [num_blocks, H, block_size, C] views with contiguous C")
    if any(k.shape != kv.shape or k.stride() != kv.stride() or k.dtype != kv.dtype for k in layers):
        raise unmappable("its layers differ in shape, stride or dtype")
    if backend == CPU_ATTN:
        if kv.device.type != "cpu" or not all(k.is_contiguous() for k in layers):
            raise unmappable("CPU attention pages are host-resident LBHNC (contiguous) layers")
        _, num_heads, block_size, two_dims = kv.shape
        check_packing(num_heads, block_size, two_dims // 2, kv.dtype)
        return CpuAttentionPages(layers, layout)
    if backend in MLA_BACKENDS and kv.shape[1] != 1:
        raise unmappable("an MLA cache has one latent entry a token (H = 1)")
    if backend not in DENSE_BACKENDS + MLA_BACKENDS:
        raise unmappable(
            f"no adapter for this backend (known: {CPU_ATTN}, "
            f"{', '.join(DENSE_BACKENDS + MLA_BACKENDS)})"
        )
    copier = CudaCopier(kv.device, len(layers)) if kv.device.type == "cuda" else HostCopier()
    return StridedPages(layers, layout, copier, backend)

"""The engine's paged KV cache: device tensors, and the bytes that move to and from the store.

One tensor holds every block: ``[num_blocks, num_layers, block_size, 2, num_kv_heads, head_dim]``.
Block ``b`` is therefore one contiguous Full Block (SPEC §3) whose bytes are exactly what the
store keeps (``[num_layers, block_size, bytes_per_token_per_layer]``, K before V per token), and
``cache[b, layer]`` is one Layer Block. No re-layout happens between the store and the cache.
"""

from __future__ import annotations

import numpy as np
import torch

from dualpath.kv.layout import KVLayout
from dualpath.model.config import ModelConfig


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.layout = KVLayout(
            num_layers=config.num_layers,
            block_size_tokens=block_size,
            bytes_per_token_per_layer=config.kv_bytes_per_token_per_layer(itemsize),
        )
        # torch.empty: pages are touched only when a block is written.
        self.kv = torch.empty(
            (num_blocks, config.num_layers, block_size, 2, config.num_kv_heads, config.head_dim),
            dtype=dtype,
            device=device,
        )
        self._kv_shape_per_block = tuple(self.kv.shape[1:])

    @staticmethod
    def num_blocks_for_bytes(
        config: ModelConfig, block_size: int, itemsize: int, budget: int
    ) -> int:
        full_block_bytes = (
            block_size * config.num_layers * config.kv_bytes_per_token_per_layer(itemsize)
        )
        return budget // full_block_bytes

    # --- compute side -----------------------------------------------------------------------

    def gather(
        self, layer: int, block_table: list[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first ``num_tokens`` tokens in ``layer``: [n, Hkv, D] each."""
        if num_tokens == 0:
            empty = self.kv.new_empty((0, *self.kv.shape[4:]))
            return empty, empty
        num_blocks = -(-num_tokens // self.block_size)
        ids = torch.tensor(block_table[:num_blocks], device=self.device)
        kv = self.kv[ids, layer].reshape(num_blocks * self.block_size, *self.kv.shape[3:])
        return kv[:num_tokens, 0], kv[:num_tokens, 1]

    def scatter(
        self,
        layer: int,
        block_ids: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Write new tokens' K/V of ``layer`` at (block, offset) slots, one slot per row."""
        self.kv[block_ids, layer, offsets, 0] = k
        self.kv[block_ids, layer, offsets, 1] = v

    # --- store side -------------------------------------------------------------------------

    def host_view(self, block_id: int) -> np.ndarray | None:
        """Zero-copy uint8 view of a block for the store to read into; None off the CPU."""
        if self.device.type != "cpu":
            return None
        return self.kv[block_id].view(torch.uint8).numpy().reshape(self.layout.full_block_shape)

    def load_full_block(self, block_id: int, full_block: np.ndarray) -> None:
        """Copy a Full Block read from the store into device block ``block_id``."""
        src = torch.from_numpy(full_block).view(self.dtype).view(self._kv_shape_per_block)
        self.kv[block_id].copy_(src, non_blocking=False)

    def copy_full_block(self, block_id: int) -> np.ndarray:
        """A host copy of block ``block_id`` as the store's Full Block bytes (safe to keep)."""
        data = self.kv[block_id].to("cpu", copy=True).view(torch.uint8)
        return data.numpy().reshape(self.layout.full_block_shape)

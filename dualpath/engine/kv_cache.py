"""The engine's paged KV cache: device tensors, and the bytes that move to and from the store.

One tensor holds every block: ``[num_blocks, num_layers, block_size, *entry_shape]``, where
``entry_shape`` is what the model caches per token per layer (``layerwise.py``: K and V of a
dense model, a latent of MLA). Block ``b`` is therefore one contiguous Full Block (SPEC §3)
whose bytes are exactly what the store keeps (``[num_layers, block_size,
bytes_per_token_per_layer]``), and ``cache[b, layer]`` is one Layer Block. No re-layout
happens between the store and the cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dualpath.kv.layout import KVLayout


@dataclass(frozen=True)
class PastBlocks:
    """A step's cached-token locations: every sequence's blocks back to back, and per sequence
    the split sizes ``(num_tokens, unused slots of its last block)`` that cut them apart again."""

    block_ids: torch.Tensor  # int64 [sum of blocks], on the cache's device
    split_sizes: list[int]  # 2 per sequence


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        entry_shape: tuple[int, ...],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.entry_shape = entry_shape
        self.layout = KVLayout(
            num_layers=num_layers,
            block_size_tokens=block_size,
            bytes_per_token_per_layer=entry_bytes(entry_shape, dtype),
        )
        # torch.empty: pages are touched only when a block is written.
        self.kv = torch.empty(
            (num_blocks, num_layers, block_size, *entry_shape), dtype=dtype, device=device
        )
        self._kv_shape_per_block = tuple(self.kv.shape[1:])

    # --- compute side -----------------------------------------------------------------------

    def past_blocks(self, block_tables: list[list[int]], num_tokens: tuple[int, ...]) -> PastBlocks:
        """Where the first ``num_tokens[i]`` tokens of each sequence live, for ``gather``
        (computed once per step, used by every layer)."""
        block_ids: list[int] = []
        split_sizes: list[int] = []
        for table, n in zip(block_tables, num_tokens, strict=True):
            num_blocks = -(-n // self.block_size)
            block_ids.extend(table[:num_blocks])
            split_sizes.extend((n, num_blocks * self.block_size - n))
        return PastBlocks(
            torch.tensor(block_ids, dtype=torch.long, device=self.device), split_sizes
        )

    def gather(self, layer: int, past: PastBlocks) -> list[torch.Tensor]:
        """Each sequence's cached entries in ``layer``: [n_i, *entry_shape], views into one
        copy of all their blocks (one ``index_select`` for the whole step, not one advanced
        index per sequence: on a CPU that was most of a batch-16 decode step)."""
        blocks = self.kv[:, layer].index_select(0, past.block_ids)
        entries = blocks.view(-1, *self.entry_shape)  # [num_blocks * block_size, *entry]
        return list(entries.split(past.split_sizes)[::2])

    def padded_rows(
        self, block_tables: list[list[int]], num_cached_tokens: tuple[int, ...]
    ) -> torch.Tensor:
        """For ``gather_padded``: the cache rows of layer 0 that fill ``PaddedPast``'s slots of a
        decode step, [num_seqs, max(c_i) + 1] (computed once per step, used by every layer).

        A row is one token's entry in one layer; with the cache's layout, token p of a
        sequence is row ``(table[p // block_size] * num_layers + layer) * block_size
        + p % block_size``. Slot c_i is the new token's own slot (its block is allocated, its
        bytes not written yet: attention overwrites the copy); the filler slots beyond repeat
        the sequence's token 0, finite and its own, never another request's leftovers.
        """
        assert all(c > 0 for c in num_cached_tokens), "a decode step has cached tokens"
        width = max(num_cached_tokens) + 1
        positions = np.arange(width)[None, :]
        positions = np.where(positions <= np.array(num_cached_tokens)[:, None], positions, 0)
        max_blocks = -(-width // self.block_size)
        tables = np.array([(t + t[:1] * max_blocks)[:max_blocks] for t in block_tables])
        blocks = np.take_along_axis(tables, positions // self.block_size, axis=1)
        rows = blocks * (self.layout.num_layers * self.block_size) + positions % self.block_size
        return torch.from_numpy(rows).to(self.device)

    def gather_padded(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """One copy of ``layer``'s entries at ``padded_rows``: [num_seqs, width, *entry_shape]."""
        per_row = self.kv.view(-1, *self.entry_shape)  # [all rows, *entry]
        layer_rows = rows.view(-1) + layer * self.block_size
        return per_row.index_select(0, layer_rows).view(*rows.shape, *self.entry_shape)

    def scatter(
        self, layer: int, block_ids: torch.Tensor, offsets: torch.Tensor, entries: torch.Tensor
    ) -> None:
        """Write new tokens' entries of ``layer`` at (block, offset) slots, one slot per row."""
        self.kv[block_ids, layer, offsets] = entries

    # --- KV pages (``pages.KVPages``): the courier's side ------------------------------------

    def write_layer(self, layer, block_ids, blocks, first=0, num=None) -> None:  # noqa: ANN001
        end = self.block_size if num is None else first + num
        for block_id, block in zip(block_ids, blocks, strict=True):
            target = self.kv[block_id, layer].view(torch.uint8).view(self.layout.layer_block_shape)
            target[first:end].copy_(torch.from_numpy(block[first:end]), non_blocking=True)

    def read_layer(self, layer: int, block_ids: Sequence[int], out: np.ndarray) -> None:
        index = torch.as_tensor(list(block_ids), device=self.device)
        blocks = self.kv[:, layer].index_select(0, index).view(torch.uint8).cpu()
        out[...] = blocks.numpy().reshape(out.shape)

    def layer_view(self, layer: int, block_ids: Sequence[int]) -> np.ndarray | None:
        """Only a single block's layer is contiguous (a block holds all its layers)."""
        if self.device.type != "cpu" or len(block_ids) != 1:
            return None
        view = self.kv[block_ids[0], layer].view(torch.uint8).numpy()
        return view.reshape(1, *self.layout.layer_block_shape)

    def fence(self, layer: int) -> None:
        """Writes are on the compute stream, in order: nothing to wait for."""

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


def entry_bytes(entry_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one token's cache entry in one layer."""
    return math.prod(entry_shape) * torch.empty((), dtype=dtype).element_size()


def num_blocks_for_bytes(
    num_layers: int, entry_shape: tuple[int, ...], block_size: int, dtype: torch.dtype, budget: int
) -> int:
    """How many blocks of the cache ``budget`` bytes hold."""
    return budget // (block_size * num_layers * entry_bytes(entry_shape, dtype))

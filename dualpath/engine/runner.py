"""Runs one forward step for a batch of (sequence, new tokens) on the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dualpath.engine.kv_cache import PagedKVCache
from dualpath.engine.sequence import Sequence
from dualpath.model.layerwise import LayerPast, LayerwiseModel, PackedBatch, PaddedPast


@dataclass(frozen=True)
class ScheduledSeq:
    """``seq`` computes tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``."""

    seq: Sequence
    num_new_tokens: int

    @property
    def is_sampling(self) -> bool:
        """True when this chunk reaches the sequence's last token, so its logits sample."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class ModelRunner:
    def __init__(self, model: LayerwiseModel, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache

    @torch.inference_mode()
    def execute(self, work: list[ScheduledSeq]) -> torch.Tensor:
        """Compute the scheduled tokens' KV into the cache; return logits [num_sampling, V]
        (float32, CPU) for the entries whose ``is_sampling`` is true, in ``work`` order."""
        device = self.cache.device
        block_size = self.cache.block_size
        batch = PackedBatch(
            num_cached_tokens=tuple(w.seq.num_computed_tokens for w in work),
            num_new_tokens=tuple(w.num_new_tokens for w in work),
        )
        input_ids: list[int] = []
        slot_blocks: list[int] = []
        for w in work:
            start = w.seq.num_computed_tokens
            input_ids.extend(w.seq.all_token_ids[start : start + w.num_new_tokens])
            table = w.seq.block_table
            slot_blocks.extend(
                table[p // block_size] for p in range(start, start + w.num_new_tokens)
            )
        block_ids = torch.tensor(slot_blocks, device=device)
        offsets = batch.positions(device) % block_size
        hidden = self.model.forward_layers(
            torch.tensor(input_ids, device=device),
            batch,
            self._gatherer(work, batch),
            lambda layer, new: self.cache.scatter(layer, block_ids, offsets, new),
        )
        rows = [row for w, row in zip(work, batch.last_rows(), strict=True) if w.is_sampling]
        if not rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.logits(hidden[rows]).cpu()

    def _gatherer(self, work: list[ScheduledSeq], batch: PackedBatch) -> Callable[[int], LayerPast]:
        """Each layer's cached entries for this step: padded for one attention call when every
        sequence decodes one token after cached ones, else one tensor per sequence."""
        tables = [w.seq.block_table for w in work]
        if all(n == 1 for n in batch.num_new_tokens) and all(batch.num_cached_tokens):
            rows = self.cache.padded_rows(tables, batch.num_cached_tokens)
            return lambda layer: PaddedPast(self.cache.gather_padded(layer, rows))
        blocks = self.cache.past_blocks(tables, batch.num_cached_tokens)
        return lambda layer: self.cache.gather(layer, blocks)

"""What every served architecture shares: packed batches, the cache entry, the layer loop.

A model caches one *entry* per token per layer, a tensor of the model's ``cache_entry_shape``:
``(2, num_kv_heads, head_dim)`` (K then V) for the dense decoders (``llama.py``), one flat
latent vector for MLA (``deepseek.py``: the compressed KV, the rope key and, in V3.2, the
indexer's key). Engines, the paged cache, Full and Layer Blocks, the store and the transfers
only ever see entries of that shape and its bytes (``KVLayout.bytes_per_token_per_layer``);
nothing below the model knows what is inside one. One call shape serves prefill with a cached
prefix, chunked prefill and decode::

    hidden = model.embed(input_ids)                      # [T, H], T = all new tokens, packed
    rope = model.rope(positions)                         # once per batch
    for layer in range(model.num_layers):
        hidden, new = model.forward_layer(layer, hidden, rope, batch, past[layer])
        # past[layer][i]: sequence i's cached entries, [c_i, *cache_entry_shape]
        # new: [T, *cache_entry_shape], the new tokens' entries for this layer
    logits = model.logits(hidden[last_token_rows])

The caller owns the cache: it decides where each layer's cached entries come from (a paged
cache, a buffer filled from storage, a remote engine) and where the new ones go. That is what
lets a prefill engine hold only one layer of cached KV at a time (SPEC §3, layer-wise prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PackedBatch:
    """How the packed rows of one forward split into sequences.

    Sequence i owns rows ``row_offsets[i] : row_offsets[i + 1]`` of the hidden states; those are
    its new tokens, at positions ``num_cached_tokens[i] ...`` in its context.
    """

    num_cached_tokens: tuple[int, ...]
    num_new_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.num_cached_tokens) != len(self.num_new_tokens):
            raise RuntimeError("caller bug: num_cached_tokens and num_new_tokens differ in length")
        if any(n <= 0 for n in self.num_new_tokens):
            raise ValueError(f"every sequence needs >= 1 new token, got {self.num_new_tokens}")

    @property
    def num_seqs(self) -> int:
        return len(self.num_new_tokens)

    @property
    def row_offsets(self) -> list[int]:
        offsets = [0]
        for n in self.num_new_tokens:
            offsets.append(offsets[-1] + n)
        return offsets

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Position of every packed row in its sequence: [T] int64."""
        return torch.cat(
            [
                torch.arange(c, c + n, device=device, dtype=torch.long)
                for c, n in zip(self.num_cached_tokens, self.num_new_tokens, strict=True)
            ]
        )

    def last_rows(self) -> list[int]:
        """The row of each sequence's last new token (the one whose logits sample)."""
        return [offset - 1 for offset in self.row_offsets[1:]]


@dataclass(frozen=True)
class PaddedPast:
    """One layer's cached entries for a decode step (one new token per sequence, >= 1 cached
    token each), padded so that attention runs once for all sequences: ``entries`` is
    ``[num_seqs, width, *cache_entry_shape]`` with sequence i's cached entries at
    ``entries[i, :c_i]`` (c_i = ``num_cached_tokens[i]``), its new token's slot at
    ``entries[i, c_i]`` and, beyond, finite filler (copies of its own tokens) that attention
    masks. The layer writes the new entries into their slots: ``entries`` is the caller's
    scratch for one layer call::

        sequence 0: | c_0 cached          | new | filler |
        sequence 1: | c_1 cached    | new | filler       |
    """

    entries: torch.Tensor


# Per sequence: its cached entries [c_i, *cache_entry_shape]; or, for a decode step, padded.
LayerPast = Sequence[torch.Tensor] | PaddedPast


class LayerwiseModel(nn.Module):
    """A causal LM driven one layer at a time by its caller (module doc). Subclasses give their
    backbone (named ``model`` so parameter names match Hugging Face's: ``embed_tokens``,
    ``layers``, ``norm``) and define ``rope_inv_freq``, ``rope``, ``forward_layer`` and
    ``cache_entry_shape``; the embedding, the head and the layer loop are this class's."""

    def __init__(self, config, backbone: nn.Module, device: torch.device | str | None) -> None:
        """``device="meta"`` builds the structure without allocating or initialising weights
        (the loader then assigns the checkpoint's tensors)."""
        super().__init__()
        self.config = config
        self.model = backbone
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", self.rope_inv_freq(), persistent=False)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def cache_entry_shape(self) -> tuple[int, ...]:
        """What one token caches in one layer (its dtype is the model's)."""
        raise NotImplementedError

    def rope_inv_freq(self) -> torch.Tensor:
        """float32 rotation per position of each rotated pair (the ``inv_freq`` buffer, which
        a model built on "meta" lacks until the loader sets it from this)."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward_layer(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: PackedBatch,
        past: LayerPast,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one layer; return (hidden, new entries ``[T, *cache_entry_shape]``). Inputs are
        left untouched, except a ``PaddedPast``, which is scratch."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, returned in float32 for sampling."""
        return self.lm_head(self.model.norm(hidden)).float()

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        batch: PackedBatch,
        past_of: Callable[[int], LayerPast],
        on_layer: Callable[[int, torch.Tensor], None],
    ) -> torch.Tensor:
        """The model driven one layer at a time, as every engine drives it; returns the last
        layer's hidden states (``logits`` of the rows that sample).

        ``past_of(layer)`` gives the layer's cached entries (``forward_layer``'s ``past``): the
        single-node engine gathers them from its paged cache, a PE from its buffers and the
        DE's (loading the next layer's meanwhile). ``on_layer(layer, new)`` takes the new
        tokens' entries before the next layer runs: into the paged cache, or on to the DE.
        """
        hidden = self.embed(input_ids)
        rope = self.rope(batch.positions(input_ids.device))
        for layer_idx in range(self.num_layers):
            past = past_of(layer_idx)
            hidden, new = self.forward_layer(layer_idx, hidden, rope, batch, past)
            del past  # a layer's past is freed before the next is loaded
            on_layer(layer_idx, new)
        return hidden

    @torch.inference_mode()
    def forward_full(
        self, input_ids: torch.Tensor, batch: PackedBatch, past: Sequence[LayerPast]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """All layers in one call: (logits of every row, per-layer new entries). A convenience
        for tests and simple callers; engines use ``forward_layers``."""
        new: list[torch.Tensor] = []
        hidden = self.forward_layers(
            input_ids, batch, past.__getitem__, lambda _, entries: new.append(entries)
        )
        return self.logits(hidden), new

    def empty_past(self, num_seqs: int = 1) -> list[list[torch.Tensor]]:
        """Per layer, ``num_seqs`` sequences with nothing cached (a prompt from its start)."""
        param = next(self.parameters())
        empty = torch.empty((0, *self.cache_entry_shape), dtype=param.dtype, device=param.device)
        return [[empty] * num_seqs for _ in range(self.num_layers)]

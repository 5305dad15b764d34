"""The Llama / Qwen2 / Qwen3 / Mistral decoder, written for serving: a layer-wise forward
over packed sequences.

One call shape serves prefill with a cached prefix, chunked prefill and decode::

    hidden = model.embed(input_ids)                      # [T, H], T = all new tokens, packed
    rope = model.rope(positions)                         # once per batch
    for layer in range(model.num_layers):
        hidden, k_new, v_new = model.forward_layer(layer, hidden, rope, batch, past[layer])
        # past[layer][i] = (k, v) of sequence i's cached tokens, each [c_i, num_kv_heads, head_dim]
        # k_new / v_new: [T, num_kv_heads, head_dim], the new tokens' KV for this layer
    logits = model.logits(hidden[last_token_rows])

The caller owns the KV: it decides where each layer's cached KV comes from (a paged cache, a
buffer filled from storage, a remote engine) and where the new KV goes. That is what lets a
prefill engine hold only one layer of cached KV at a time (SPEC §3, layer-wise prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dualpath.model.config import ModelConfig
from dualpath.model.rope import rope_inv_freq

Device = torch.device | str | None


@dataclass(frozen=True)
class PaddedPast:
    """One layer's cached K and V for a decode step (one new token per sequence, >= 1 cached
    token each), padded so that attention runs once for all sequences: ``kv`` is
    ``[num_seqs, width, 2, Hkv, D]`` with sequence i's cached tokens at ``kv[i, :c_i]``
    (c_i = ``num_cached_tokens[i]``), its new token's slot at ``kv[i, c_i]`` and, beyond,
    finite filler (copies of its own tokens) that attention masks. Attention writes the new
    K/V into the slots: ``kv`` is the caller's scratch for one layer call::

        sequence 0: | c_0 cached          | new | filler |
        sequence 1: | c_1 cached    | new | filler       |
    """

    kv: torch.Tensor


# Per sequence: (k, v) [c_i, Hkv, D]; or, for a decode step, all of them padded.
LayerPast = Sequence[tuple[torch.Tensor, torch.Tensor]] | PaddedPast


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
        return torch.cat(
            [
                torch.arange(c, c + n, device=device, dtype=torch.long)
                for c, n in zip(self.num_cached_tokens, self.num_new_tokens, strict=True)
            ]
        )

    def last_rows(self) -> list[int]:
        """Row of each sequence's last new token (the one whose logits predict the next)."""
        return [end - 1 for end in self.row_offsets[1:]]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, device: Device = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias, device=device)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, device=device)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, device=device)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_proj_bias, device=device)
        self.has_qk_norm = config.has_qk_norm
        if self.has_qk_norm:  # Qwen3: each head's q and k are RMS-normalised before rope
            self.q_norm = RMSNorm(d, config.rms_norm_eps, device)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, device)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: PackedBatch,
        past: LayerPast,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_rows = x.shape[0]
        q = self.q_proj(x).view(num_rows, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_rows, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_rows, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rope(q, rope), _apply_rope(k, rope)
        if isinstance(past, PaddedPast):
            out = _attend_padded(q, past.kv, batch.num_cached_tokens, k, v)
            return self.o_proj(out.reshape(num_rows, -1)), k, v
        out = torch.empty_like(q)
        offsets = batch.row_offsets
        for i in range(batch.num_seqs):
            rows = slice(offsets[i], offsets[i + 1])
            past_k, past_v = past[i]
            out[rows] = _attend(q[rows], past_k, past_v, k[rows], v[rows])
        return self.o_proj(out.reshape(num_rows, -1)), k, v


def _attend(
    q: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of n new queries over c cached + n new keys (GQA), returns [n, Hq, D].

    Query j (position c + j) sees keys 0 .. c + j::

        keys:    | c cached | n new  |
        query 0:  xxxxxxxxxx x.......
        query j:  xxxxxxxxxx xxxx....   (j + 1 new keys)
    """
    num_cached, num_new = past_k.shape[0], q.shape[0]
    k = torch.cat([past_k, new_k]) if num_cached else new_k
    v = torch.cat([past_v, new_v]) if num_cached else new_v
    mask = None
    is_causal = False
    if num_new > 1:
        if num_cached:
            mask = torch.ones(num_new, num_cached + num_new, dtype=torch.bool, device=q.device)
            mask = mask.tril(diagonal=num_cached)
        else:
            is_causal = True
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=is_causal,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def _attend_padded(
    q: torch.Tensor,
    kv: torch.Tensor,
    num_cached_tokens: tuple[int, ...],
    new_k: torch.Tensor,
    new_v: torch.Tensor,
) -> torch.Tensor:
    """One new query per sequence over its cached keys and its new key (``PaddedPast``), all
    sequences in one call: one call per sequence cost more than the attention itself on a CPU.
    Returns [num_seqs, Hq, D]."""
    num_seqs, width = kv.shape[:2]
    rows = torch.arange(num_seqs, device=q.device)
    cached = torch.tensor(num_cached_tokens, device=q.device)
    kv[rows, cached, 0] = new_k
    kv[rows, cached, 1] = new_v
    mask = None
    if num_seqs > 1:
        mask = torch.arange(width, device=q.device) <= cached[:, None]  # [B, width]
        mask = mask[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        kv[:, :, 0].transpose(1, 2),  # [B, Hkv, width, D]
        kv[:, :, 1].transpose(1, 2),
        attn_mask=mask,
        enable_gqa=q.shape[1] != kv.shape[3],
    )
    return out.squeeze(2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope  # [T, 1, D]
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, device: Device = None) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, device=device)
        self.up_proj = nn.Linear(h, i, bias=False, device=device)
        self.down_proj = nn.Linear(i, h, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, device: Device = None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device)
        self.self_attn = Attention(config, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device)
        self.mlp = MLP(config, device)


class _Backbone(nn.Module):
    """Named ``model`` inside the causal LM so parameter names match Hugging Face's."""

    def __init__(self, config: ModelConfig, device: Device = None) -> None:
        super().__init__()
        # An explicit weight skips the random init (which on "meta" imports torch's refs: ~2 s).
        embedding = torch.empty(config.vocab_size, config.hidden_size, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(DecoderLayer(config, device) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)


class DecoderModel(nn.Module):
    """A causal LM whose forward is driven one layer at a time by the caller (see module doc)."""

    def __init__(self, config: ModelConfig, device: Device = None) -> None:
        """``device="meta"`` builds the structure without allocating or initialising weights
        (the loader then assigns the checkpoint's tensors)."""
        super().__init__()
        self.config = config
        self.model = _Backbone(config, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for the packed rows, computed in float32 like the reference, once per batch.

        Both are scaled by the rope's attention factor (YaRN's; 1.0, an exact no-op, otherwise).
        """
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.config.rope.attention_factor
        cos, sin = emb.cos() * scale, emb.sin() * scale
        dtype = self.model.embed_tokens.weight.dtype
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def forward_layer(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: PackedBatch,
        past: LayerPast,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run one decoder layer; return (hidden, k_new, v_new) for the packed new tokens.

        ``past[i]`` must hold sequence i's cached K and V for this layer, each
        ``[num_cached_tokens[i], num_kv_heads, head_dim]``. Inputs are left untouched, except
        a ``PaddedPast`` (a decode step's, in one tensor), which is scratch.
        """
        layer = self.model.layers[layer_idx]
        attn_out, k_new, v_new = layer.self_attn(layer.input_layernorm(hidden), rope, batch, past)
        hidden = hidden + attn_out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, k_new, v_new

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, returned in float32 for sampling."""
        return self.lm_head(self.model.norm(hidden)).float()

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        batch: PackedBatch,
        past_of: Callable[[int], LayerPast],
        on_layer: Callable[[int, torch.Tensor, torch.Tensor], None],
    ) -> torch.Tensor:
        """The model driven one layer at a time, as every engine drives it; returns the last
        layer's hidden states (``logits`` of the rows that sample).

        ``past_of(layer)`` gives the layer's cached KV (``forward_layer``'s ``past``): the
        single-node engine gathers it from its paged cache, a PE from its buffers and the DE's
        (loading the next layer's meanwhile). ``on_layer(layer, k_new, v_new)`` takes the new
        tokens' KV before the next layer runs: into the paged cache, or on to the DE.
        """
        hidden = self.embed(input_ids)
        rope = self.rope(batch.positions(input_ids.device))
        for layer_idx in range(self.num_layers):
            past = past_of(layer_idx)
            hidden, k_new, v_new = self.forward_layer(layer_idx, hidden, rope, batch, past)
            del past  # a layer's past is freed before the next is loaded
            on_layer(layer_idx, k_new, v_new)
        return hidden

    @torch.inference_mode()
    def forward_full(
        self, input_ids: torch.Tensor, batch: PackedBatch, past: Sequence[LayerPast]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """All layers in one call: (logits of every row, per-layer (k_new, v_new)).

        A convenience for tests and simple callers; engines use ``forward_layers``.
        """
        new_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        hidden = self.forward_layers(
            input_ids, batch, past.__getitem__, lambda _, k, v: new_kv.append((k, v))
        )
        return self.logits(hidden), new_kv

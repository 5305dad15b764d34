"""The Llama / Qwen2 / Qwen3 / Mistral decoder, written for serving: a layer-wise forward
over packed sequences (the call shape and the cache entry: ``layerwise.py``).

One token's cache entry in one layer is its K and V, ``[2, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dualpath.model.config import ModelConfig
from dualpath.model.layerwise import LayerPast, LayerwiseModel, PackedBatch, PaddedPast
from dualpath.model.rope import rope_inv_freq

Device = torch.device | str | None


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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, the new tokens' entries [T, 2, Hkv, D])."""
        num_rows = x.shape[0]
        q = self.q_proj(x).view(num_rows, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_rows, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_rows, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rope(q, rope), _apply_rope(k, rope)
        kv = torch.stack((k, v), dim=1)
        if isinstance(past, PaddedPast):
            out = _attend_padded(q, past.entries, batch.num_cached_tokens, kv)
            return self.o_proj(out.reshape(num_rows, -1)), kv
        out = torch.empty_like(q)
        offsets = batch.row_offsets
        for i in range(batch.num_seqs):
            rows = slice(offsets[i], offsets[i + 1])
            out[rows] = _attend(q[rows], past[i], kv[rows])
        return self.o_proj(out.reshape(num_rows, -1)), kv


def _attend(q: torch.Tensor, past_kv: torch.Tensor, new_kv: torch.Tensor) -> torch.Tensor:
    """Causal attention of n new queries over c cached + n new keys (GQA), returns [n, Hq, D];
    ``past_kv`` [c, 2, Hkv, D], ``new_kv`` [n, 2, Hkv, D].

    Query j (position c + j) sees keys 0 .. c + j::

        keys:    | c cached | n new  |
        query 0:  xxxxxxxxxx x.......
        query j:  xxxxxxxxxx xxxx....   (j + 1 new keys)
    """
    num_cached, num_new = past_kv.shape[0], q.shape[0]
    kv = torch.cat([past_kv, new_kv]) if num_cached else new_kv
    k, v = kv[:, 0], kv[:, 1]
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
    q: torch.Tensor, kv: torch.Tensor, num_cached_tokens: tuple[int, ...], new_kv: torch.Tensor
) -> torch.Tensor:
    """One new query per sequence over its cached keys and its new key (``PaddedPast``), all
    sequences in one call: one call per sequence cost more than the attention itself on a CPU.
    Returns [num_seqs, Hq, D]."""
    num_seqs, width = kv.shape[:2]
    rows = torch.arange(num_seqs, device=q.device)
    cached = torch.tensor(num_cached_tokens, device=q.device)
    kv[rows, cached] = new_kv
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


class DecoderModel(LayerwiseModel):
    """A causal LM whose forward is driven one layer at a time by the caller (``layerwise``)."""

    def __init__(self, config: ModelConfig, device: Device = None) -> None:
        super().__init__(config, _Backbone(config, device), device)

    @property
    def cache_entry_shape(self) -> tuple[int, ...]:
        return (2, self.config.num_kv_heads, self.config.head_dim)

    def rope_inv_freq(self) -> torch.Tensor:
        return rope_inv_freq(self.config)

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.model.layers[layer_idx]
        attn_out, kv_new = layer.self_attn(layer.input_layernorm(hidden), rope, batch, past)
        hidden = hidden + attn_out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, kv_new

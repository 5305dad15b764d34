"""The DeepSeek-V3 / DeepSeek-V3.2 decoder, written for serving: a layer-wise forward over packed
sequences, like ``llama.DecoderModel``, whose per-token cache is one flat vector per layer. Its
configuration and cache entry layout, which need no torch, are in ``deepseek_config``; the two
attention computations of a decode step are timed by ``python -m dualpath.bench.mla_bench``.

The call shape and the cache entry are every model's (``layerwise.py``). One token's entry in one layer (``cache_entry_spec``; 576 values for DeepSeek-V3, 704 for V3.2)::

    | latent: kv_lora_rank | rope_key: qk_rope_head_dim | index_key: index_head_dim (V3.2) |

``latent`` is ``kv_a_layernorm`` of the compressed KV, ``rope_key`` the shared rotary key after
rope, in transformers' layout (each rotated pair's first elements, then their second ones: a fixed
permutation of DeepSeek's interleaved layout that leaves every dot product unchanged), and
``index_key`` the V3.2 lightning indexer's key after its LayerNorm and rope. Attention runs from
the entries alone: ``absorb=False`` expands the latents through ``kv_b_proj`` into per-head keys
and values (as transformers does); ``absorb=True`` folds ``kv_b_proj`` into the query and the
output and attends in the latent space, so the cached latents are read as they are; by default
decode steps absorb and prefill expands (``DeepseekDecoderModel``).

Checked against transformers 5.24 (``DeepseekV3ForCausalLM``, ``DeepseekV32ForCausalLM``) by
tests/model/test_deepseek.py. Parameter names are transformers' in-memory state-dict names; a
checkpoint on disk (per-expert weights, as DeepSeek publishes them and as transformers'
``save_pretrained`` writes them) goes through ``deepseek_moe.stack_expert_weights`` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dualpath.model.deepseek_config import CacheEntrySpec, DeepseekConfig, cache_entry_spec
from dualpath.model.deepseek_moe import MLP, MoE
from dualpath.model.layerwise import LayerPast, LayerwiseModel, PackedBatch, PaddedPast
from dualpath.model.llama import RMSNorm
from dualpath.model.rope import yarn_inv_freq

Device = torch.device | str | None

# q_a/kv_a_layernorm and the indexer's k_norm ignore rms_norm_eps
_SUBLAYER_NORM_EPS = 1e-6


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on the two halves of ``x`` (Llama's layout): the indexer's, and MLA's without
    ``rope_interleave``."""
    return x * cos + _rotate_half(x) * sin


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA's rope on pairs (x0, x1), (x2, x3), ...; returns the rotated first elements, then the
    rotated second ones (transformers' ``apply_rotary_pos_emb_interleave``)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Indexer(nn.Module):
    """V3.2's lightning indexer: scores each query against every visible key with a few cheap
    heads, ``sum_h w_h * relu(q_h . k / sqrt(d))``, and keeps the ``topk`` best keys.

    DeepSeek's kernel Hadamard-rotates q and k (orthogonal: the dot products stay) and scores in
    FP8; like transformers, this scores in float32 instead, so near-ties may break otherwise.
    """

    def __init__(self, config: DeepseekConfig, device: Device = None) -> None:
        super().__init__()
        assert config.indexer is not None and config.q_lora_rank is not None, "V3.2 only"
        self.num_heads, self.head_dim = config.indexer.num_heads, config.indexer.head_dim
        self.topk, self.rope_dim = config.indexer.topk, config.qk_rope_head_dim
        h = config.hidden_size
        self.wq_b = nn.Linear(
            config.q_lora_rank, self.num_heads * self.head_dim, bias=False, device=device
        )
        self.wk = nn.Linear(h, self.head_dim, bias=False, device=device)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=_SUBLAYER_NORM_EPS, device=device)
        self.weights_proj = nn.Linear(h, self.num_heads, bias=False, device=device)

    def key(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[T, head_dim]: each new token's index key, as cached in its entry."""
        k = self.k_norm(self.wk(x))
        k_rot, k_pass = k.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([_rope_half(k_rot, *rope), k_pass], dim=-1)

    def query(
        self, x: torch.Tensor, q_resid: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The new tokens' ``index`` queries [T, heads, head_dim] and ``index_weights``
        [T, heads] (float32)."""
        q = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        q_rot, q_pass = q.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        cos, sin = rope
        q = torch.cat([_rope_half(q_rot, cos[:, None], sin[:, None]), q_pass], dim=-1)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        return {"index": q, "index_weights": weights * self.num_heads**-0.5}

    def select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Narrow ``visible`` [B, n, L] (bool) to each query's top-k keys.

        q: [B, n, heads, head_dim]; weights: [B, n, heads]; keys: [B, L, head_dim].
        """
        b, n, num_heads, head_dim = q.shape
        scores = torch.bmm(q.float().reshape(b, n * num_heads, head_dim), keys.float().mT)
        scores = F.relu(scores * head_dim**-0.5).view(b, n, num_heads, -1)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, n, L]
        index_scores = index_scores.masked_fill(~visible, float("-inf"))
        # Equal scores (relu makes exact zeros common) go to the earlier key: topk breaks ties
        # by where they sit in the tensor it is given, which padding a decode step changes,
        # and the tokens must not depend on which sequences share a step.
        order = index_scores.sort(dim=-1, descending=True, stable=True).indices
        chosen = order[..., : min(self.topk, keys.shape[1])]
        return visible & torch.zeros_like(visible).scatter_(-1, chosen, True)


class _Queries(NamedTuple):
    """The new tokens' queries; leading dims [T] as projected, [B, n] inside ``_attend``."""

    nope: torch.Tensor  # [..., heads, qk_nope_head_dim]
    pe: torch.Tensor  # [..., heads, qk_rope_head_dim], after rope
    index: torch.Tensor | None  # V3.2: the indexer's, [..., index_heads, index_head_dim]
    index_weights: torch.Tensor | None  # V3.2: the indexer's per-head weights, float32

    def take(self, key: tuple[slice | None, ...]) -> _Queries:
        """Each tensor indexed by ``key``."""
        return _Queries(*(None if t is None else t[key] for t in self))


class Attention(nn.Module):
    """Multi-head latent attention (MLA) whose cache is the entry of ``cache_entry_spec``."""

    def __init__(self, config: DeepseekConfig, device: Device = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.latent_dim = config.v_head_dim, config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        self.rope_fn = _rope_interleaved if config.rope_interleave else _rope_half
        h, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        qk_dim = self.nope_dim + self.rope_dim
        self.has_q_lora = config.q_lora_rank is not None
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk_dim, bias=False, device=device)
        else:
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias, device=device)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _SUBLAYER_NORM_EPS, device)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_dim, bias=False, device=device)
        self.kv_a_proj_with_mqa = nn.Linear(
            h, self.latent_dim + self.rope_dim, bias=bias, device=device
        )
        self.kv_a_layernorm = RMSNorm(self.latent_dim, _SUBLAYER_NORM_EPS, device)
        self.kv_b_proj = nn.Linear(
            self.latent_dim, heads * (self.nope_dim + self.v_dim), bias=False, device=device
        )
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=bias, device=device)
        self.indexer = Indexer(config, device) if config.indexer is not None else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: PackedBatch,
        past: LayerPast,
        absorb: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention output [T, hidden], new entries [T, entry_dim]); see ``forward_layer``."""
        num_rows = x.shape[0]
        cos, sin = rope
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if self.has_q_lora else None
        q = self.q_b_proj(q_resid) if self.has_q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(num_rows, self.num_heads, -1).split(
            [self.nope_dim, self.rope_dim], -1
        )
        q_pe = self.rope_fn(q_pe, cos[:, None], sin[:, None])
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], dim=-1)
        parts = [self.kv_a_layernorm(latent), self.rope_fn(k_pe, cos, sin)]
        queries = _Queries(q_nope, q_pe, None, None)
        if self.indexer is not None:
            queries = queries._replace(**self.indexer.query(x, q_resid, rope))
            parts.append(self.indexer.key(x, rope))
        new_entries = torch.cat(parts, dim=-1)
        if isinstance(past, PaddedPast):
            out = self._attend_padded(queries, new_entries, past.entries, batch, absorb)
        else:
            out = self._attend_each(queries, new_entries, past, batch, absorb)
        return self.o_proj(out.reshape(num_rows, -1)), new_entries

    def _attend_each(
        self,
        queries: _Queries,
        new_entries: torch.Tensor,
        past: Sequence[torch.Tensor],
        batch: PackedBatch,
        absorb: bool,
    ) -> torch.Tensor:
        """One sequence at a time: query j (position c + j) sees keys 0 .. c + j::

        keys:    | c cached | n new  |
        query 0:  xxxxxxxxxx x.......
        query j:  xxxxxxxxxx xxxx....   (j + 1 new keys)
        """
        out = new_entries.new_empty(new_entries.shape[0], self.num_heads, self.v_dim)
        offsets = batch.row_offsets
        for i, num_cached in enumerate(batch.num_cached_tokens):
            if past[i].shape[0] != num_cached:
                raise RuntimeError(
                    f"caller bug: sequence {i} has {past[i].shape[0]} cached entries, "
                    f"the batch says {num_cached}"
                )
            rows = slice(offsets[i], offsets[i + 1])
            keys = torch.cat([past[i], new_entries[rows]])
            num_new = rows.stop - rows.start
            visible = torch.ones(num_new, keys.shape[0], dtype=torch.bool, device=keys.device)
            visible = visible.tril(diagonal=num_cached)
            seq_queries = queries.take((None, rows))  # [1, n, ...]
            out[rows] = self._attend(seq_queries, keys[None], visible[None], absorb)[0]
        return out

    def _attend_padded(
        self,
        queries: _Queries,
        new_entries: torch.Tensor,
        entries: torch.Tensor,
        batch: PackedBatch,
        absorb: bool,
    ) -> torch.Tensor:
        """A decode step, all sequences in one call (see ``PaddedPast``)."""
        if any(n != 1 for n in batch.num_new_tokens) or entries.shape[0] != batch.num_seqs:
            raise RuntimeError("caller bug: PaddedPast is for one new token per sequence")
        seqs = torch.arange(batch.num_seqs, device=entries.device)
        cached = torch.tensor(batch.num_cached_tokens, device=entries.device)
        entries[seqs, cached] = new_entries
        visible = torch.arange(entries.shape[1], device=entries.device) <= cached[:, None]
        seq_queries = queries.take((slice(None), None))  # [B, 1, ...]
        return self._attend(seq_queries, entries, visible[:, None], absorb)[:, 0]

    def _attend(
        self,
        queries: _Queries,
        keys: torch.Tensor,
        visible: torch.Tensor,
        absorb: bool,
    ) -> torch.Tensor:
        """Attention of B sequences' n queries each over their L entries; returns [B, n, H, dv].

        keys: [B, L, entry_dim]; visible: [B, n, L], True where a query may look.
        """
        if self.indexer is not None:
            index_keys = keys[..., self.latent_dim + self.rope_dim :]
            visible = self.indexer.select(queries.index, queries.index_weights, index_keys, visible)
        attend = self._attend_absorbed if absorb else self._attend_naive
        return attend(queries.nope, queries.pe, keys, visible)

    def _attend_naive(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Expand each latent through kv_b_proj into per-head K_nope and V, as transformers does."""
        b, num_keys = keys.shape[:2]
        latent = keys[..., : self.latent_dim]
        k_pe = keys[..., self.latent_dim : self.latent_dim + self.rope_dim]
        kv = self.kv_b_proj(latent).view(b, num_keys, self.num_heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, self.num_heads, -1)], dim=-1)
        out = F.scaled_dot_product_attention(
            torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2),  # [B, H, n, dn + dr]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=visible[:, None],
            scale=self.softmax_scale,
        )
        return out.transpose(1, 2)

    def _attend_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Attend in the latent space: q_nope . (W_uk c) = (q_nope W_uk) . c, and the output is
        W_uv applied to the probability-weighted latents. All heads share one key per token (the
        entry's latent and rope key), so the heads are folded into the query rows."""
        b, n, num_heads, _ = q_nope.shape
        w_kv = self.kv_b_proj.weight.view(num_heads, self.nope_dim + self.v_dim, self.latent_dim)
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim :]
        q_latent = torch.einsum("bnhd,hdr->bnhr", q_nope, w_uk)
        q = torch.cat([q_latent, q_pe], dim=-1).reshape(b, n * num_heads, -1)
        scores = torch.bmm(q, keys[..., : self.latent_dim + self.rope_dim].mT) * self.softmax_scale
        scores = scores.view(b, n, num_heads, -1).masked_fill(~visible[:, :, None], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out_latent = torch.bmm(probs.view(b, n * num_heads, -1), keys[..., : self.latent_dim])
        return torch.einsum("bnhr,hvr->bnhv", out_latent.view(b, n, num_heads, -1), w_uv)


class DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekConfig, layer_idx: int, device: Device = None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, device)
        self.self_attn = Attention(config, device)
        self.post_attention_layernorm = RMSNorm(h, eps, device)
        is_moe = config.mlp_layer_types[layer_idx] == "sparse"
        self.mlp = MoE(config, device) if is_moe else MLP(h, config.intermediate_size, device)


class _Backbone(nn.Module):
    """Named ``model`` inside the causal LM so parameter names match Hugging Face's."""

    def __init__(self, config: DeepseekConfig, device: Device = None) -> None:
        super().__init__()
        embedding = torch.empty(config.vocab_size, config.hidden_size, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)


class DeepseekDecoderModel(LayerwiseModel):
    """A DeepSeek-V3 / V3.2 causal LM driven one layer at a time by the caller (see module doc).

    ``absorb`` picks the attention computation (both give the same result to rounding): True
    attends in the latent space, reading cached entries as they are; False expands every key's
    latent through kv_b_proj first, as transformers does; None (the default) absorbs in decode
    steps (every sequence one new token) and expands in prefill, the faster of the two for
    each on this host's CPU (``python -m dualpath.bench.mla_bench``: a decode step of 8 x 1,024
    cached tokens 14-19x faster absorbed, a prefill chunk of 512 over 1,024 cached 1.1-1.2x
    faster expanded). It may be changed between calls.
    """

    def __init__(
        self, config: DeepseekConfig, device: Device = None, absorb: bool | None = None
    ) -> None:
        super().__init__(config, _Backbone(config, device), device)
        self.absorb = absorb

    @property
    def cache_entry_spec(self) -> CacheEntrySpec:
        return cache_entry_spec(self.config)

    @property
    def cache_entry_shape(self) -> tuple[int, ...]:
        return (self.cache_entry_spec.dim,)

    def rope_inv_freq(self) -> torch.Tensor:
        config = self.config
        if config.rope.rope_type == "yarn":
            return yarn_inv_freq(config.rope, config.qk_rope_head_dim)
        dims = torch.arange(0, config.qk_rope_head_dim, 2, dtype=torch.float32)
        return 1.0 / (config.rope.theta ** (dims / config.qk_rope_head_dim))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, qk_rope_head_dim]`` for the packed rows, computed in float32 and scaled
        by the rope's attention factor, as transformers does, once per batch."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.config.rope.attention_factor
        dtype = self.model.embed_tokens.weight.dtype
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def forward_layer(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: PackedBatch,
        past: LayerPast,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one decoder layer; return (hidden, new entries ``[T, entry_dim]``).

        ``past[i]`` must hold sequence i's cached entries for this layer,
        ``[num_cached_tokens[i], entry_dim]`` (possibly 0 rows). Inputs are left untouched,
        except a ``PaddedPast`` (a decode step's, in one tensor), which is scratch.
        """
        layer = self.model.layers[layer_idx]
        absorb = self.absorb
        if absorb is None:
            absorb = all(n == 1 for n in batch.num_new_tokens)
        attn_out, new_entries = layer.self_attn(
            layer.input_layernorm(hidden), rope, batch, past, absorb
        )
        hidden = hidden + attn_out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden, new_entries

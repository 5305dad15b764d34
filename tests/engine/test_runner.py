"""The model runner's decode step: one padded attention call for all sequences gives what one
call per sequence gives, and bytes the cache never wrote cannot reach an output."""

from __future__ import annotations

from pathlib import Path

import torch

from dualpath import LLM, SamplingParams
from dualpath.model.layerwise import PackedBatch, PaddedPast
from dualpath.model.loader import load_model


def test_padded_decode_attention_matches_one_call_per_sequence(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir).model
    config = model.config
    num_cached = (5, 64, 17)
    gen = torch.Generator().manual_seed(0)
    shape = model.cache_entry_shape
    assert shape == (2, config.num_kv_heads, config.head_dim)
    past = [torch.randn(c, *shape, generator=gen) for c in num_cached]
    width = max(num_cached) + 1
    padded = torch.full((len(num_cached), width, *shape), float("nan"))  # slots c_i: unwritten
    for i, kv in enumerate(past):
        padded[i, : num_cached[i]] = kv
        padded[i, num_cached[i] + 1 :] = padded[i, 0]  # the filler: the sequence's token 0
    batch = PackedBatch(num_cached_tokens=num_cached, num_new_tokens=(1, 1, 1))
    hidden = torch.randn(3, config.hidden_size, generator=gen)
    rope = model.rope(batch.positions())
    with torch.inference_mode():
        expected = model.forward_layer(0, hidden, rope, batch, past)
        got = model.forward_layer(0, hidden, rope, batch, PaddedPast(padded))
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], expected[1])


def test_stale_cache_bytes_never_reach_an_output(tiny_model_dir: Path) -> None:
    """Every slot attention reads was written first: a cache full of NaN changes nothing (a
    freed block may hold another request's non-finite KV; masked is not enough, 0 * NaN)."""
    prompts = [
        torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (1, 5, 70, 130)
    ]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with LLM(tiny_model_dir) as llm:
        clean = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    with LLM(tiny_model_dir) as llm:
        llm.engine.cache.kv.fill_(float("nan"))
        poisoned = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.token_ids for o in poisoned] == [o.token_ids for o in clean]

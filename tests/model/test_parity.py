"""Our layer-wise model against the reference implementation in ``transformers``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dualpath import LLM, SamplingParams
from dualpath.model.layerwise import PackedBatch
from dualpath.model.loader import load_model

transformers = pytest.importorskip("transformers")


def _no_past(loaded, num_seqs: int = 1):
    return loaded.model.empty_past(num_seqs)


def _reference(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llama_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A Llama checkpoint written by transformers itself: GQA, tied embeddings, no QKV bias."""
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=2,
    )
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    out = tmp_path_factory.mktemp("llama")
    model.save_pretrained(out)
    shutil.copy(tiny_model_dir / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.mark.parametrize("which", ["tiny", "llama"])
def test_logits_match_transformers(which: str, tiny_model_dir: Path, llama_model_dir: Path) -> None:
    path = tiny_model_dir if which == "tiny" else llama_model_dir
    ours = load_model(path)
    ids = torch.randint(0, 1024, (150,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = _reference(path)(ids[None]).logits[0]
    logits, _ = ours.model.forward_full(ids, PackedBatch((0,), (150,)), _no_past(ours))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)


def test_cached_prefix_forward_equals_full_forward(tiny_model_dir: Path) -> None:
    """Prefill with a cached prefix is the same call as a full prefill (and decode)."""
    ours = load_model(tiny_model_dir)
    ids = torch.randint(0, 1024, (90,), generator=torch.Generator().manual_seed(4))
    full_logits, full_kv = ours.model.forward_full(ids, PackedBatch((0,), (90,)), _no_past(ours))
    past = [[kv[:70]] for kv in full_kv]
    tail_logits, tail_kv = ours.model.forward_full(ids[70:], PackedBatch((70,), (20,)), past)
    torch.testing.assert_close(tail_logits, full_logits[70:], rtol=1e-5, atol=1e-5)
    for kv, kv_tail in zip(full_kv, tail_kv, strict=True):
        assert kv_tail.shape == (20, 2, ours.config.num_kv_heads, ours.config.head_dim)
        torch.testing.assert_close(kv_tail, kv[70:], rtol=1e-5, atol=1e-5)


def test_packed_sequences_do_not_see_each_other(tiny_model_dir: Path) -> None:
    ours = load_model(tiny_model_dir)
    gen = torch.Generator().manual_seed(5)
    a, b = (
        torch.randint(0, 1024, (30,), generator=gen),
        torch.randint(0, 1024, (17,), generator=gen),
    )
    alone_a, _ = ours.model.forward_full(a, PackedBatch((0,), (30,)), _no_past(ours))
    alone_b, _ = ours.model.forward_full(b, PackedBatch((0,), (17,)), _no_past(ours))
    packed, _ = ours.model.forward_full(
        torch.cat([a, b]), PackedBatch((0, 0), (30, 17)), _no_past(ours, 2)
    )
    torch.testing.assert_close(packed[:30], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[30:], alone_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["tiny", "llama"])
def test_greedy_generation_matches_transformers(
    which: str, tiny_model_dir: Path, llama_model_dir: Path
) -> None:
    path = tiny_model_dir if which == "tiny" else llama_model_dir
    prompts = [
        torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(n))
        for n in (7, 64, 99)
    ]
    reference = _reference(path)
    with LLM(path) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p.tolist()} for p in prompts],
            SamplingParams(max_tokens=24, ignore_eos=True),
        )
    for prompt, out in zip(prompts, outs, strict=True):
        expected = reference.generate(
            prompt[None], max_new_tokens=24, do_sample=False, eos_token_id=None
        )[0, len(prompt) :]
        assert out.token_ids == expected.tolist()

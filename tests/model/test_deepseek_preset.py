"""The tiny DeepSeek presets (``make-model --preset tiny-deepseek``, V3.2, and
``tiny-deepseek-v3``) as the engine serves them, against transformers loading the same
directory; the published V3.2 config's KV bytes.

The greedy reference is transformers' *uncached* forward: each next token is the argmax of its
full forward over the prompt and the tokens so far. Its cached ``generate`` is not used for
V3.2: on this preset it departs from its own uncached forward (a 64-token prompt, the 12th
token, a top-2 logit gap of 0.39, no tie in the indexer's top-k), while ours decodes exactly
what its full forward gives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dualpath import LLM, SamplingParams
from dualpath.model.deepseek_config import DeepseekConfig
from dualpath.model.identity import kv_facts
from dualpath.model.layerwise import PackedBatch
from dualpath.model.loader import load_model
from dualpath.sim.profiles import MODELS
from tests.model.published import PUBLISHED_V3, PUBLISHED_V32, dequantized

transformers = pytest.importorskip("transformers", minversion="5.24")

NUM_TOKENS = 16


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# preset -> the architecture its config.json names
ARCHITECTURES = {
    "tiny-deepseek": "DeepseekV32ForCausalLM",
    "tiny-deepseek-v3": "DeepseekV3ForCausalLM",  # vLLM's CPU MLA head sizes (576 a token)
}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def preset_dir(request: pytest.FixtureRequest) -> Path:
    fixture = {"tiny-deepseek": "tiny_deepseek_dir", "tiny-deepseek-v3": "tiny_deepseek_v3_dir"}
    return request.getfixturevalue(fixture[request.param])


@pytest.fixture(scope="module")
def reference(preset_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(preset_dir, dtype=torch.float32).eval()


def test_the_preset_is_a_checkpoint_transformers_loads_with_the_same_logits(
    preset_dir: Path, reference
) -> None:
    ours = load_model(preset_dir)
    assert ours.config.architecture == ARCHITECTURES[preset_dir.name]
    ids = torch.tensor(_prompt(300, seed=1))
    if ours.config.indexer is not None:
        assert len(ids) > ours.config.indexer.topk  # the indexer keeps a strict subset
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    logits, _ = ours.model.forward_full(
        ids, PackedBatch((0,), (len(ids),)), ours.model.empty_past()
    )
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_the_engine_generates_transformers_greedy_tokens(preset_dir: Path, reference) -> None:
    prompts = [_prompt(n, seed=n) for n in (300, 150, 64)]
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    with LLM(preset_dir) as llm:  # the three decode together: padded steps
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        sequence = torch.tensor(prompt + list(out.token_ids))
        with torch.no_grad():
            logits = reference(sequence[None, :-1]).logits[0]
        expected = logits[len(prompt) - 1 :].argmax(dim=-1).tolist()
        assert list(out.token_ids) == expected, f"prompt of {len(prompt)} tokens"


def test_the_published_v32_configs_kv_bytes_are_spec_s_and_the_simulators() -> None:
    """Config only, no weights (its FP8 weight quantization says nothing of the KV). Served in
    bfloat16, a token caches 1,408 B per layer, 256 B (18%) of them the indexer's key; in
    DeepSeek's FP8 cache, SPEC §7's 656 B of MLA latent, scales and rope, plus 132 B of
    indexer key (40 KB + 8 KB per token over 61 layers), which the simulator quotes."""
    config = DeepseekConfig.from_dict(dequantized(PUBLISHED_V32))
    facts = kv_facts(config, "bfloat16")
    assert facts["cache_entry"] == {"latent": 512, "rope_key": 64, "index_key": 128}
    assert facts["kv_bytes_per_token_per_layer"] == (512 + 64 + 128) * 2 == 1408
    assert facts["kv_bytes_per_token"] == 61 * 1408
    assert config.fp8_cache_bytes_per_token_per_layer() == (656, 132)
    assert (61 * 656, 61 * 132) == (40_016, 8_052)  # SPEC: about 40 KB + 8 KB a token
    profile = MODELS["deepseek-v3.2-660b"]
    assert (profile.num_layers, profile.kv_bytes_per_token_per_layer) == (61, 656)
    assert profile.indexer_bytes_per_token_per_layer == 132
    v3 = DeepseekConfig.from_dict(dequantized(PUBLISHED_V3))
    assert v3.fp8_cache_bytes_per_token_per_layer() == (656, 0)
    assert kv_facts(v3, "bfloat16")["kv_bytes_per_token_per_layer"] == 1152

"""Long-context parity with transformers on checkpoints written by transformers itself.

Each checkpoint is a random-weight model built from transformers' own config class and saved
with ``save_pretrained``, so its config.json is spelled as transformers 5 writes it today
(``rope_parameters``, ``layer_types``, ...). Prompts are over 2,048 tokens: a rope error (a
misread theta, a missing scaling) barely moves the logits of a short prompt.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dualpath import LLM, SamplingParams
from dualpath.model.config import ModelConfig
from dualpath.model.layerwise import PackedBatch
from dualpath.model.loader import LoadedModel, load_model
from tests.model.weights import randomize_weights

# Checkpoints as transformers 5 writes them (rope_parameters); 4.x reads none of that.
transformers = pytest.importorskip("transformers", minversion="5")
from transformers.initialization import no_init_weights  # noqa: E402

NUM_PROMPT_TOKENS = 2100  # past 2,048, and not a multiple of the 64-token block
# Prefill in chunks, so later chunks attend to earlier ones through the engine's paged cache.
MAX_NUM_BATCHED_TOKENS = 768


@dataclass(frozen=True)
class Checkpoint:
    """A transformers config to write as a random checkpoint, and what to check on it."""

    make_config: Callable[[], object]
    num_generated_tokens: int = 12
    expected_rope_type: str = "default"


def _small(config_class: type, **fields: object) -> Callable[[], object]:
    shape = dict(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        eos_token_id=2,
    )
    return lambda: config_class(**{**shape, **fields})


def _llama3_rope() -> dict[str, object]:
    # Llama 3.1's values with a pre-training context short enough that, at head_dim 32, some
    # dims are slowed by the factor, some kept and two are on the smooth ramp between.
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }


CHECKPOINTS = {
    "llama-llama3-rope": Checkpoint(
        _small(transformers.LlamaConfig, rope_parameters=_llama3_rope(), tie_word_embeddings=True),
        expected_rope_type="llama3",
    ),
    "llama-linear-rope": Checkpoint(
        _small(
            transformers.LlamaConfig,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        ),
        expected_rope_type="linear",
    ),
    "llama-yarn-rope": Checkpoint(
        _small(
            transformers.LlamaConfig,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 2048,
            },
        ),
        expected_rope_type="yarn",
    ),
    "qwen2-qkv-bias": Checkpoint(
        _small(
            transformers.Qwen2Config, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}
        )
    ),
    "qwen3": Checkpoint(
        # head_dim 64 with hidden 128 and 4 heads: the q/o projections are not square.
        _small(transformers.Qwen3Config, head_dim=64, rope_parameters={"rope_theta": 1e6})
    ),
    "qwen3-attention-bias": Checkpoint(
        _small(transformers.Qwen3Config, head_dim=32, attention_bias=True)
    ),
    "mistral": Checkpoint(
        _small(transformers.MistralConfig, sliding_window=None, rope_parameters={"rope_theta": 1e6})
    ),
    # SmolLM2-135M's config.json, exactly; random weights. Long prompt, few tokens (it is slow).
    "smollm2-135m": Checkpoint(
        lambda: transformers.LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            hidden_act="silu",
            max_position_embeddings=8192,
            rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
            initializer_range=0.041666666666666664,
        ),
        num_generated_tokens=3,
    ),
}


def _write_checkpoint(config: object, out: Path, tokenizer_dir: Path) -> Path:
    """Random weights: norms near 1 so attention is sharp enough for positions to matter, and
    a final norm near 10 so logits spread (std ~20) and greedy picks win by wide margins
    rather than flip on rounding."""
    torch.manual_seed(0)
    with no_init_weights():  # every weight is drawn below; transformers' own init takes seconds
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # what from_config does after its init: a tied lm_head is not saved
    randomize_weights(model)
    model.save_pretrained(out)
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> tuple[Path, Checkpoint]:
    case = CHECKPOINTS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    return _write_checkpoint(case.make_config(), out, tiny_model_dir), case


def _logit_rows(num_tokens: int) -> torch.Tensor:
    """Rows whose logits are compared: spread over the prompt, and all of its last 64."""
    return torch.cat(
        [torch.arange(0, num_tokens - 64, 61), torch.arange(num_tokens - 64, num_tokens)]
    )


def _our_logits(loaded: LoadedModel, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Our layer-wise forward over the whole prompt, logits only at ``rows``."""
    model = loaded.model
    batch = PackedBatch((0,), (len(ids),))
    (empty,) = model.empty_past()[0]
    with torch.inference_mode():
        hidden = model.embed(ids)
        rope = model.rope(batch.positions())
        for layer_idx in range(model.num_layers):
            hidden, _ = model.forward_layer(layer_idx, hidden, rope, batch, [empty])
        return model.logits(hidden[rows])


def _reference(path: Path, ids: torch.Tensor, rows: torch.Tensor, num_generated: int):
    """transformers' logits at ``rows`` and its greedy continuation of ``ids``.

    Decodes as ``generate(do_sample=False)`` does (argmax over the cached forward), reusing the
    prefill whose logits are compared instead of paying for a second one.
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    keep = torch.cat([rows, torch.tensor([len(ids) - 1])])
    cache = transformers.DynamicCache(config=model.config)  # filled in place by each call
    with torch.no_grad():
        out = model(ids[None], past_key_values=cache, logits_to_keep=keep)
        generated = [int(out.logits[0, -1].argmax())]
        while len(generated) < num_generated:
            step = model(torch.tensor([[generated[-1]]]), past_key_values=cache)
            generated.append(int(step.logits[0, -1].argmax()))
    return out.logits[0, :-1], generated


# transformers 5.24 renames past_key_values to cache; the old name works until 5.40 and, unlike
# the new one, in every 5.x (an unknown keyword would be swallowed, leaving the decode uncached).
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_long_prompt_logits_and_greedy_tokens_match_transformers(
    checkpoint: tuple[Path, Checkpoint],
) -> None:
    path, case = checkpoint
    config = ModelConfig.from_file(path / "config.json")
    assert config.rope.rope_type == case.expected_rope_type
    ids = torch.randint(
        0, config.vocab_size, (NUM_PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)
    )
    rows = _logit_rows(NUM_PROMPT_TOKENS)
    expected_logits, expected_tokens = _reference(path, ids, rows, case.num_generated_tokens)

    ours = _our_logits(load_model(path), ids, rows)
    torch.testing.assert_close(ours, expected_logits, rtol=1e-5, atol=1e-4)
    with LLM(path, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, num_device_blocks=40) as llm:
        (out,) = llm.generate(
            [{"prompt_token_ids": ids.tolist()}],
            SamplingParams(max_tokens=case.num_generated_tokens, ignore_eos=True),
        )
    assert out.token_ids == expected_tokens

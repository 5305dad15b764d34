"""Our rope against transformers' own, config.json by config.json: the same file must give
bit-identical inverse frequencies and the same attention factor, in either spelling."""

from __future__ import annotations

import pytest
import torch

from dualpath.model.config import ModelConfig
from dualpath.model.rope import rope_inv_freq

# The rope of transformers 5 (rope_parameters), which our rope matches.
transformers = pytest.importorskip("transformers", minversion="5")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# (name, fields of config.json beyond the base, as some file in the wild or transformers
# itself writes them)
ROPE_FILES = [
    ("old default", {"rope_theta": 500000.0}),
    ("old default, no theta", {}),
    ("new default", {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}),
    ("old llama3 (Llama 3.1)", {"rope_theta": 500000.0, "rope_scaling": LLAMA3}),
    ("new llama3", {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}),
    ("old linear, 'type'", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    ("new linear", {"rope_parameters": {"rope_type": "linear", "factor": 2.5, "rope_theta": 1e6}}),
    (
        "old yarn, 'type' (Qwen2.5)",
        {
            "rope_theta": 1e6,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        },
    ),
    (
        "yarn with betas, mscale, no truncation",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "truncate": False,
            }
        },
    ),
    (
        "yarn with attention_factor, factor null",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": None,
                "original_max_position_embeddings": 32768,
                "attention_factor": 1.25,
            }
        },
    ),
    (
        "yarn, pre-training context only at top level",
        {
            "original_max_position_embeddings": 16384,
            "rope_parameters": {"rope_type": "yarn", "factor": 8.0},
        },
    ),
]


def _config_json(fields: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 1024,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,  # head_dim 128, as in Llama 3 and Qwen
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        **fields,
    }


@pytest.mark.parametrize("fields", [f for _, f in ROPE_FILES], ids=[n for n, _ in ROPE_FILES])
def test_rope_equals_transformers(fields: dict) -> None:
    raw = _config_json(fields)
    reference = LlamaRotaryEmbedding(transformers.LlamaConfig.from_dict(_copy(raw)))
    ours = ModelConfig.from_dict(_copy(raw))
    assert torch.equal(rope_inv_freq(ours), reference.inv_freq)
    assert ours.rope.attention_factor == reference.attention_scaling


def _copy(raw: dict) -> dict:
    """A deep copy: transformers standardizes the rope dicts it is given in place."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}

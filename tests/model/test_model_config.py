"""ModelConfig: both spellings of rope, the files transformers writes, eos ids from
generation_config.json, and a named refusal for every field we do not implement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dualpath.errors import CheckpointError
from dualpath.model.config import ModelConfig, RopeConfig
from dualpath.model.identity import kv_identity

LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

# SmolLM2-135M's config.json as published (written by transformers 4.40: rope_theta at top level).
SMOLLM2_HUB_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "vocab_size": 49152,
}


def _config(architecture: str = "LlamaForCausalLM", **fields: Any) -> dict[str, Any]:
    """A small config.json of ``architecture``; ``fields`` override (None deletes a field)."""
    raw: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "eos_token_id": 2,
    }
    raw.update(fields)
    return {k: v for k, v in raw.items() if v is not None}


@pytest.mark.parametrize(
    ("old", "new", "theta"),
    [
        ({"rope_theta": 100000.0}, {"rope_parameters": {"rope_theta": 100000.0}}, 100000.0),
        ({}, {"rope_parameters": {"rope_type": "default"}}, 10000.0),
        (
            {"rope_theta": 500000.0, "rope_scaling": LLAMA31_ROPE},
            {"rope_parameters": {**LLAMA31_ROPE, "rope_theta": 500000.0}},
            500000.0,
        ),
        (
            {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0}},
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e6,
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": True,
                }
            },
            1e6,
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": 2}},
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000}},
            10000.0,
        ),
    ],
    ids=["default", "no-theta", "llama3", "yarn", "linear"],
)
def test_old_and_new_rope_spellings_give_the_same_config(
    old: dict[str, Any], new: dict[str, Any], theta: float
) -> None:
    old_config = ModelConfig.from_dict(_config(**old))
    assert old_config == ModelConfig.from_dict(_config(**new))
    assert old_config.rope.theta == theta


def test_yarn_attention_factor_is_resolved_as_transformers_does() -> None:
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    assert ModelConfig.from_dict(_config(rope_parameters=rope)).rope == RopeConfig(
        theta=10000.0,
        rope_type="yarn",
        factor=4.0,
        original_max_position_embeddings=8192,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=True,
        attention_factor=0.1 * 1.3862943611198906 + 1.0,  # 0.1 ln(4) + 1
    )


def test_smollm2_as_published_and_as_transformers_5_rewrites_it_agree(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    transformers.LlamaConfig.from_dict(dict(SMOLLM2_HUB_CONFIG)).save_pretrained(tmp_path)
    rewritten = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in rewritten and rewritten["rope_parameters"]["rope_theta"] == 100000
    config = ModelConfig.from_dict(SMOLLM2_HUB_CONFIG)
    assert ModelConfig.from_dict(rewritten) == config
    assert (config.rope, config.head_dim, config.num_kv_heads) == (RopeConfig(100000.0), 64, 3)


@pytest.mark.parametrize("name", ["LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig"])
def test_transformers_default_config_files_load(name: str, tmp_path: Path) -> None:
    """save_pretrained of each config class at its defaults (Mistral: no sliding window)."""
    transformers = pytest.importorskip("transformers", minversion="5")
    fields = {"sliding_window": None} if name == "MistralConfig" else {}
    architecture = name.replace("Config", "ForCausalLM")  # what a model's save_pretrained adds
    config_class = getattr(transformers, name)
    config_class(num_hidden_layers=2, architectures=[architecture], **fields).save_pretrained(
        tmp_path
    )
    config = ModelConfig.from_file(tmp_path / "config.json")
    assert config.rope == RopeConfig(10000.0)
    assert config.has_qk_norm == (name == "Qwen3Config")
    assert config.attention_bias == (name == "Qwen2Config")
    assert not config.o_proj_bias


def test_qwen3_without_head_dim_gets_transformers_default_of_128() -> None:
    config = ModelConfig.from_dict(
        _config("Qwen3ForCausalLM", num_attention_heads=32, num_key_value_heads=None)
    )
    assert (config.head_dim, config.num_kv_heads) == (128, 32)


def test_attention_bias_means_all_four_projections_in_llama_and_qwen3_none_in_mistral() -> None:
    for architecture, expected in [
        ("LlamaForCausalLM", (True, True)),
        ("Qwen3ForCausalLM", (True, True)),
        ("Qwen2ForCausalLM", (True, False)),
        ("MistralForCausalLM", (False, False)),
    ]:
        config = ModelConfig.from_dict(
            _config(architecture, attention_bias=True, sliding_window=32768)
        )
        assert (config.attention_bias, config.o_proj_bias) == expected, architecture


@pytest.mark.parametrize(
    ("architecture", "fields"),
    [
        ("LlamaForCausalLM", {"attention_dropout": 0.1, "pretraining_tp": 2}),  # no effect
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 2}),  # none slide
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 32768}),  # hides none
        ("Qwen2ForCausalLM", {"layer_types": ["full_attention"] * 2, "use_sliding_window": True}),
        ("MistralForCausalLM", {"sliding_window": 32768}),  # as wide as the context
        ("LlamaForCausalLM", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1}}),
    ],
)
def test_fields_that_change_nothing_are_accepted(architecture: str, fields: dict) -> None:
    ModelConfig.from_dict(_config(architecture, **fields))


@pytest.mark.parametrize(
    ("architecture", "fields", "named"),
    [
        ("GemmaForCausalLM", {}, "architecture 'GemmaForCausalLM'"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
        ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias"),
        ("LlamaForCausalLM", {"quantization_config": {"quant_method": "awq"}}, "quantization"),
        ("LlamaForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("LlamaForCausalLM", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            "LlamaForCausalLM",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
            "partial_rotary_factor",
        ),
        (
            "LlamaForCausalLM",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            'rope_parameters.rope_type="dynamic"',
        ),
        (
            "LlamaForCausalLM",
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
            'rope_scaling.rope_type="longrope"',
        ),
        (
            "Qwen3ForCausalLM",
            {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
            "rope_parameters.full_attention",
        ),
        (
            "LlamaForCausalLM",
            {"rope_parameters": {**LLAMA31_ROPE, "mrope_section": [16, 24, 24]}},
            "rope_parameters.mrope_section",
        ),
        (
            "LlamaForCausalLM",
            {"rope_parameters": {**LLAMA31_ROPE, "low_freq_factor": None}},
            "rope_parameters.low_freq_factor",
        ),
        ("LlamaForCausalLM", {"rope_scaling": {"type": "linear"}}, "rope_scaling.factor"),
        ("LlamaForCausalLM", {"use_sliding_window": True}, "use_sliding_window"),
        (
            "Qwen2ForCausalLM",
            {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1},
            "use_sliding_window",
        ),
        (
            "Qwen3ForCausalLM",
            {"layer_types": ["full_attention", "sliding_attention"]},
            "layer_types[1]",
        ),
        ("MistralForCausalLM", {"sliding_window": 4096}, "sliding_window=4096"),
        ("MistralForCausalLM", {}, "sliding_window=4096"),  # MistralConfig's default
    ],
)
def test_unimplemented_fields_are_refused_by_name(
    architecture: str, fields: dict, named: str
) -> None:
    with pytest.raises(CheckpointError, match="config.json") as info:
        ModelConfig.from_dict(_config(architecture, **fields))
    assert named in str(info.value)


def _checkpoint(tmp_path: Path, eos: Any, generation: dict | str | None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(_config(eos_token_id=eos)))
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (tmp_path / "generation_config.json").write_text(text)
    return tmp_path / "config.json"


@pytest.mark.parametrize(
    ("eos", "generation", "expected"),
    [
        (2, None, (2,)),
        (2, {"eos_token_id": [2, 7]}, (2, 7)),  # Llama 3 instruct: <|eot_id|> only here
        ([5, 2], {"eos_token_id": 9, "bos_token_id": 1}, (5, 2, 9)),
        (None, {"eos_token_id": 3}, (3,)),
        (2, {"temperature": 0.7}, (2,)),
    ],
)
def test_eos_ids_are_the_union_with_generation_config(
    tmp_path: Path, eos: Any, generation: dict | None, expected: tuple[int, ...]
) -> None:
    assert ModelConfig.from_file(_checkpoint(tmp_path, eos, generation)).eos_token_ids == expected


@pytest.mark.parametrize(
    "generation", ["{not json", "[2]", {"eos_token_id": "</s>"}, {"eos_token_id": [2, None]}]
)
def test_malformed_generation_config_is_refused_naming_the_file(
    tmp_path: Path, generation: dict | str
) -> None:
    with pytest.raises(CheckpointError, match="generation_config.json"):
        ModelConfig.from_file(_checkpoint(tmp_path, 2, generation))


def test_rope_is_part_of_the_kv_store_fingerprint() -> None:
    def fingerprint(**fields: Any) -> str:
        return kv_identity(
            ModelConfig.from_dict(_config(**fields)), "w" * 8, "float32", 64
        ).fingerprint

    default = ModelConfig.from_dict(_config(rope_theta=1e6))
    assert default.architecture_dict()["rope"]["theta"] == 1e6
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    fingerprints = {
        fingerprint(rope_theta=1e6),
        fingerprint(rope_theta=1e4),
        fingerprint(rope_parameters=linear),
    }
    assert len(fingerprints) == 3
    assert fingerprint(rope_theta=1e6) == fingerprint(rope_parameters={"rope_theta": 1e6})

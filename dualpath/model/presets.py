"""Shapes of the generated checkpoints (``dualpath make-model --preset NAME``); torch-free.

``dualpath.model.make`` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
EOS_TOKEN = "<|im_end|>"

# ChatML with tool calls rendered as JSON inside <tool_call> tags, and tool results as a
# `tool` turn, so a conversation with tool use renders the same way on every turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}\n"
    "{%- if message.get('content') is string %}{{ message['content'] }}"
    "{%- elif message.get('content') %}{%- for part in message['content'] %}"
    "{%- if part.get('type') == 'text' %}{{ part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}\n<tool_call>"
    '{"name": {{ call["function"]["name"] | tojson }}, '
    '"arguments": {{ call["function"]["arguments"] | tojson }}}</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@dataclass(frozen=True, slots=True)
class Preset:
    """Shape of a generated checkpoint. All presets are Qwen2 (Llama with QKV bias)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    # Std of the LM head's logits for a unit-RMS hidden state. Random weights at the usual
    # 0.02 scale give near-uniform logits with top-2 gaps of ~1e-4, so greedy decoding would
    # flip on rounding noise; a wide logit spread gives gaps of order 1.
    logit_std: float = 6.0
    rope_theta: float = 1_000_000.0
    description: str = ""


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        max_position_embeddings=16384,
        description="embedded default: 4 layers, 2 KB of KV per token, fast on one CPU core",
    ),
    "small": Preset(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_attention_heads=8,
        num_kv_heads=8,
        max_position_embeddings=16384,
        description="benchmarks: 8 layers, 32 KB of KV per token (float32), ~27M parameters",
    ),
}


def preset_config(preset: Preset, vocab_size: int, eos_token_id: int) -> dict[str, object]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.hidden_size // preset.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": preset.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "dtype": "float32",
    }

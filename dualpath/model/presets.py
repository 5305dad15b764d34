"""Shapes of the generated checkpoints (``dualpath make-model --preset NAME``); torch-free.

``dualpath.model.make`` writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
EOS_TOKEN = "<|im_end|>"

# ChatML, with tools and tool calls as Qwen2.5-Instruct writes them (Hermes style): the tools'
# JSON schemas in the system turn, each call as `<tool_call>\n{"name": ..., "arguments": {...}}
# \n</tool_call>` in the assistant turn, and tool results as `<tool_response>`s in one user turn.
# A conversation with tool use renders the same way on every turn, so an agent's turn 2 repeats
# turn 1's prompt and answer (KV found in the store) when the answer was written this way.
# Unlike Qwen's, it adds no system prompt of its own, and writes a call's name with `tojson`.
CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content -%}
        {%- for part in content if part.type == 'text' -%}
            {{- part.text -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system %}
        {{- text_of(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- set content = text_of(message.content) %}
        {%- if content %}
            {{- '\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {{- '\n<tool_call>\n{"name": ' + call.name | tojson + ', "arguments": ' }}
            {{- call.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


@dataclass(frozen=True, slots=True)
class Preset:
    """Shape of a generated checkpoint: Qwen2 (Llama with QKV bias), or, with ``deepseek``,
    DeepSeek-V3 (MLA, MoE) whose other fields it gives: V3.2 (sparse attention) when they
    include the indexer's (``index_topk``)."""

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
    # config.json fields of DeepSeek-V3's or V3.2's own (its architecture then; None: Qwen2).
    deepseek: tuple[tuple[str, object], ...] | None = None


# The tiny DeepSeek presets' router and experts (and query compression): 8 routed experts, 2
# a token in 2 groups, 1 shared, after 1 dense layer.
_TINY_DEEPSEEK_MOE: tuple[tuple[str, object], ...] = (
    ("moe_intermediate_size", 64),
    ("first_k_dense_replace", 1),
    ("n_routed_experts", 8),
    ("n_shared_experts", 1),
    ("num_experts_per_tok", 2),
    ("n_group", 2),
    ("topk_group", 1),
    ("routed_scaling_factor", 2.5),
    ("norm_topk_prob", True),
    ("scoring_func", "sigmoid"),
    ("topk_method", "noaux_tc"),
    ("q_lora_rank", 64),
)

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
    # The paper's model family in miniature: every part of DeepSeek-V3.2 at a size one CPU
    # core serves. A token caches 80 values per layer (latent 32 + rope key 16 + indexer key
    # 32), 320 B in float32; the indexer keeps 64 keys per query, so prompts of a few hundred
    # tokens attend sparsely. 8 indexer heads, not 2: a key scores exactly 0 when every head's
    # relu is 0, and with 2 heads a quarter of them did, so the top 64 cut through ties.
    "tiny-deepseek": Preset(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=4,
        max_position_embeddings=16384,
        rope_theta=10_000.0,
        description="DeepSeek-V3.2 in miniature: MLA (latent 32, rope 16), 8 routed experts "
        "(2 per token, 2 groups) + 1 shared after 1 dense layer, indexer top-64; 320 B of KV "
        "per token per layer",
        deepseek=(
            *_TINY_DEEPSEEK_MOE,
            ("kv_lora_rank", 32),
            ("qk_nope_head_dim", 32),
            ("qk_rope_head_dim", 16),
            ("v_head_dim", 32),
            ("index_n_heads", 8),
            ("index_head_dim", 32),
            ("index_topk", 64),
            ("rope_interleave", True),
            ("attention_bias", False),
        ),
    ),
    # DeepSeek-V3 (no indexer) at the head sizes vLLM's CPU MLA backends accept, so that vLLM
    # and this engine serve the same checkpoint: they take a 576-value entry only, the
    # published latent 512 + rope key 64 (vLLM 0.32's mla/cpu_mla.py and amx_mla.py), so a
    # token caches 2,304 B per layer in float32, 1,152 B in bfloat16. The rest is
    # tiny-deepseek's; vLLM needs noaux_tc and sigmoid, or the router's e_score_correction_bias
    # has no home.
    "tiny-deepseek-v3": Preset(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=4,
        max_position_embeddings=16384,
        rope_theta=10_000.0,
        description="DeepSeek-V3 in miniature at vLLM's CPU MLA head sizes: MLA (latent 512, "
        "rope 64), 8 routed experts (2 per token, 2 groups) + 1 shared after 1 dense layer, no "
        "indexer; 2,304 B of KV per token per layer",
        deepseek=(
            *_TINY_DEEPSEEK_MOE,
            ("kv_lora_rank", 512),
            ("qk_nope_head_dim", 32),
            ("qk_rope_head_dim", 64),
            ("v_head_dim", 32),
            ("rope_interleave", True),
            ("attention_bias", False),
        ),
    ),
}


def preset_config(preset: Preset, vocab_size: int, eos_token_id: int) -> dict[str, object]:
    if preset.deepseek is not None:
        fields = dict(preset.deepseek)
        is_v32 = "index_topk" in fields  # V3.2 is V3 plus the indexer
        return {
            "architectures": ["DeepseekV32ForCausalLM" if is_v32 else "DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v32" if is_v32 else "deepseek_v3",
            "vocab_size": vocab_size,
            "hidden_size": preset.hidden_size,
            "intermediate_size": preset.intermediate_size,
            "num_hidden_layers": preset.num_layers,
            "num_attention_heads": preset.num_attention_heads,
            "num_key_value_heads": preset.num_kv_heads,
            **fields,
            "hidden_act": "silu",
            "max_position_embeddings": preset.max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_theta": preset.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": False,
            "bos_token_id": None,
            "eos_token_id": eos_token_id,
            "dtype": "float32",
        }
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

"""Architecture of a decoder-only checkpoint, parsed from its Hugging Face ``config.json``.

Supported: Llama (Llama 3.x rope scaling included), Qwen2, Qwen3 and Mistral without sliding
window — RMSNorm, RoPE (``default``, ``linear``, ``llama3`` and ``yarn``), grouped-query
attention, SwiGLU, the attention biases each architecture has, and Qwen3's per-head q/k RMSNorm.
Rope is read in both spellings: ``rope_parameters`` (transformers >= 5) and ``rope_theta`` /
``rope_scaling`` (older files), with transformers 5.24's defaults and precedence. A field that
would change the computation and is not implemented is refused with a ``CheckpointError`` that
names it; none is ignored. ``from_file`` also takes the end-of-sequence ids of
``generation_config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from dualpath.errors import CheckpointError

ConfigT = TypeVar("ConfigT")  # a frozen config dataclass with eos_token_ids

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")

# The parameters each rope type has besides theta, as transformers' _compute_*_parameters read
# them; every other parameter of a RopeConfig stays None.
_ROPE_TYPE_PARAMS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate"),
}
_ROPE_PARAM_NAMES = (
    "factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "truncate",
)
_ROPE_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# Keys a file's rope dict may hold per type (transformers' _validate_*_rope_parameters), besides
# those common ones; any other is refused rather than guessed at. yarn's attention_factor,
# mscale and mscale_all_dim resolve into one RopeConfig.attention_factor.
_ROPE_FILE_KEYS: dict[str, frozenset[str]] = {
    **{rope_type: frozenset(params) for rope_type, params in _ROPE_TYPE_PARAMS.items()},
    "yarn": frozenset(_ROPE_TYPE_PARAMS["yarn"]) | {"attention_factor", "mscale", "mscale_all_dim"},
}

# transformers' config classes default these differently per architecture; a file that omits
# the field gets the class default, so we must too (None: derived from the other fields).
_DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128}  # others: hidden_size // num_attention_heads
_DEFAULT_NUM_KV_HEADS = {"Qwen2ForCausalLM": 32, "Qwen3ForCausalLM": 32, "MistralForCausalLM": 8}
_DEFAULT_SLIDING_WINDOW_TOKENS = 4096  # Qwen2/Qwen3/Mistral configs' default sliding_window
_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2/Qwen3: layers from this index on slide, if enabled

# Fields none of our architectures implement: any value but null (or absence) is refused.
_MUST_BE_ABSENT = ("quantization_config", "attn_logit_softcapping", "final_logit_softcapping")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding, as transformers 5.24 computes it (``modeling_rope_utils``).

    Only the parameters of ``rope_type`` are set; the others stay None. Defaults that transformers
    fills in (yarn's betas and attention factor, a missing pre-training context) are resolved
    when parsing, so two files that mean the same rope give equal configs and the same KV store
    fingerprint (the rope is part of it: the same weights with another rope give other KV).
    """

    theta: float  # rope_theta: dimension pair i turns at theta ** (-2i / head_dim) per token
    rope_type: str = "default"
    # linear, llama3, yarn: how many times the pre-training context is stretched
    factor: float | None = None
    # llama3, yarn: the context the model was pre-trained on, in tokens
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3: wavelengths > orig / low are divided by factor
    high_freq_factor: float | None = None  # llama3: wavelengths < orig / high are kept
    beta_fast: float | None = None  # yarn: rotations bounding the dims kept as they are
    beta_slow: float | None = None  # yarn: rotations bounding the dims fully interpolated
    truncate: bool | None = None  # yarn: round that correction range out to whole dims
    attention_factor: float = 1.0  # scale on cos and sin: yarn's mscale, 1 for the others

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPE_PARAMS:
            raise CheckpointError(
                f"config.json: rope_type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(_ROPE_TYPE_PARAMS)}"
            )
        if not self.theta > 0:
            raise CheckpointError(f"config.json: rope_theta must be > 0, got {self.theta}")
        wanted = _ROPE_TYPE_PARAMS[self.rope_type]
        for name in _ROPE_PARAM_NAMES:
            is_set = getattr(self, name) is not None
            if is_set != (name in wanted):
                state = "needs" if name in wanted else "takes no"
                raise CheckpointError(f"config.json: rope_type {self.rope_type!r} {state} {name}")
        if self.factor is not None and not self.factor > 0:
            raise CheckpointError(f"config.json: rope factor must be > 0, got {self.factor}")
        if self.rope_type != "yarn" and self.attention_factor != 1.0:
            raise CheckpointError(
                f"config.json: rope_type {self.rope_type!r} has no attention_factor"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int  # explicit in Qwen3 (where heads * head_dim need not be hidden_size)
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2 always; Llama/Qwen3 by flag)
    o_proj_bias: bool  # bias on o_proj: Llama and Qwen3 put attention_bias on all four
    has_qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before rope
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str  # the checkpoint's stored dtype

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config.json: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: rope needs an even head_dim, got {self.head_dim}")

    def kv_bytes_per_token_per_layer(self, itemsize: int) -> int:
        """Bytes of one token's K and V in one layer: ``2 * num_kv_heads * head_dim * itemsize``."""
        return 2 * self.num_kv_heads * self.head_dim * itemsize

    def cache_entry_parts(self) -> tuple[tuple[str, int], ...]:
        """What one token's entry in one layer holds: (name, values) in order."""
        width = self.num_kv_heads * self.head_dim
        return (("k", width), ("v", width))

    def architecture_dict(self) -> dict[str, Any]:
        """Every field that changes what the KV of a token is (for the store's fingerprint)."""
        return architecture_fields(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a config.json object; ``CheckpointError`` names the first field we cannot honour."""

        def need(key: str) -> Any:
            if key not in raw:
                raise CheckpointError(f"config.json: missing required field {key!r}")
            return raw[key]

        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else None
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"config.json: architecture {architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            num_heads = int(need("num_attention_heads"))
            hidden_size = int(need("hidden_size"))
            num_layers = int(need("num_hidden_layers"))
            max_position_embeddings = int(need("max_position_embeddings"))
            _check_implemented(raw, architecture, num_layers, max_position_embeddings)
            rope = rope_config(raw, max_position_embeddings)
            head_dim = raw.get("head_dim", _DEFAULT_HEAD_DIM.get(architecture))
            num_kv_heads = raw.get("num_key_value_heads", _DEFAULT_NUM_KV_HEADS.get(architecture))
            attention_bias, o_proj_bias = _attention_biases(raw, architecture)
            return cls(
                architecture=architecture,
                vocab_size=int(need("vocab_size")),
                hidden_size=hidden_size,
                intermediate_size=int(need("intermediate_size")),
                num_layers=num_layers,
                num_attention_heads=num_heads,
                num_kv_heads=int(num_kv_heads or num_heads),
                head_dim=int(head_dim or hidden_size // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=rope,
                max_position_embeddings=max_position_embeddings,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=attention_bias,
                o_proj_bias=o_proj_bias,
                has_qk_norm=architecture == "Qwen3ForCausalLM",
                eos_token_ids=eos_ids(raw.get("eos_token_id"), "config.json"),
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"config.json: malformed field: {exc}") from exc

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        """Parse ``path`` (a config.json) and add the eos ids of a generation_config.json beside it
        (``with_generation_config_eos``)."""
        return with_generation_config_eos(cls.from_dict(read_json_object(path)), path)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``CheckpointError`` if it is missing or not an object."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: not found (is this a checkpoint directory?)") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be parsed as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return raw


def with_generation_config_eos(config: ConfigT, config_path: Path) -> ConfigT:
    """``config`` (of any architecture) with the eos ids of a generation_config.json beside
    ``config_path`` after its own, if there is one.

    The chat end token of Llama 3 instruct and SmolLM2-style checkpoints is only in
    generation_config.json; vLLM stops on the union too.
    """
    generation_path = config_path.with_name("generation_config.json")
    if not generation_path.is_file():
        return config
    raw = read_json_object(generation_path)
    extra_ids = eos_ids(raw.get("eos_token_id"), str(generation_path))
    own = config.eos_token_ids
    eos_token_ids = own + tuple(i for i in dict.fromkeys(extra_ids) if i not in own)
    return dataclasses.replace(config, eos_token_ids=eos_token_ids)


def eos_ids(value: Any, where: str) -> tuple[int, ...]:
    """An ``eos_token_id`` field (absent, an integer or a list of integers) as a tuple."""
    values = value if isinstance(value, list) else ([] if value is None else [value])
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(
            f"{where}: eos_token_id must be a token id or a list of them, got {value!r}"
        )
    return tuple(values)


def unsupported(field: str, value: Any, why: str) -> CheckpointError:
    """The error refusing config.json's ``field``: its value and why it is not implemented."""
    return CheckpointError(f"config.json: {field}={json.dumps(value)} is not supported ({why})")


def _check_implemented(
    raw: dict[str, Any], architecture: str, num_layers: int, max_position_embeddings: int
) -> None:
    """Refuse, by name, each field whose value changes the computation in a way not implemented.

    ``attention_dropout`` (training only) and ``pretraining_tp`` (how pre-training split the
    same matmuls; transformers 5 no longer reads it) change nothing here and are accepted.
    """
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):
        raise unsupported("hidden_act", hidden_act, "the MLP is SwiGLU (silu) only")
    if raw.get("mlp_bias"):
        raise unsupported("mlp_bias", raw["mlp_bias"], "the MLP projections have no bias")
    for field in _MUST_BE_ABSENT:
        if raw.get(field) is not None:
            raise unsupported(field, raw[field], "not implemented")
    _check_full_attention(raw, architecture, num_layers, max_position_embeddings)


def _check_full_attention(
    raw: dict[str, Any], architecture: str, num_layers: int, max_position_embeddings: int
) -> None:
    """Refuse sliding-window attention wherever transformers would apply it to a layer.

    A window of at least ``max_position_embeddings`` tokens hides nothing from any query within
    the context (which the engine never exceeds), so it is accepted.
    """
    layer_types = raw.get("layer_types")
    for i, layer_type in enumerate(layer_types or []):
        if layer_type != "full_attention":
            raise unsupported(f"layer_types[{i}]", layer_type, "only full_attention is implemented")
    window = raw.get("sliding_window", _DEFAULT_SLIDING_WINDOW_TOKENS)
    is_narrow = window is not None and int(window) < max_position_embeddings
    if architecture in _QWEN:
        # Qwen2Config/Qwen3Config: unless layer_types lists them, the layers from
        # max_window_layers on slide when use_sliding_window is set.
        first = int(raw.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
        has_sliding_layers = layer_types is None and first < num_layers
        if raw.get("use_sliding_window") and has_sliding_layers and is_narrow:
            raise unsupported(
                "use_sliding_window",
                True,
                f"with sliding_window={window} and max_window_layers={first}, layers "
                f"{first}..{num_layers - 1} would use sliding-window attention, which is not "
                "implemented",
            )
    elif architecture == "MistralForCausalLM":
        if is_narrow:
            raise unsupported(
                "sliding_window",
                window,
                f"narrower than max_position_embeddings ({max_position_embeddings}); "
                "sliding-window attention is not implemented",
            )
    elif raw.get("use_sliding_window"):
        raise unsupported("use_sliding_window", True, "sliding-window attention is not implemented")


def _attention_biases(raw: dict[str, Any], architecture: str) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o_proj) as each transformers architecture builds its layers."""
    if architecture == "Qwen2ForCausalLM":
        return True, False  # Qwen2Attention: fixed biases, attention_bias is not read
    if architecture == "MistralForCausalLM":
        return False, False  # MistralAttention: no biases, attention_bias is not read
    is_biased = bool(raw.get("attention_bias", False))
    return is_biased, is_biased  # Llama, Qwen3: one flag for all four projections


def rope_config(raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
    """The rope of a config.json, in either spelling, as transformers 5.24 standardizes it.

    transformers takes ``rope_scaling`` (older files) over ``rope_parameters``; theta comes from
    the rope dict, else the top-level ``rope_theta``, else 10,000.
    """
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(field) or {}
    if not isinstance(params, dict):
        raise unsupported(field, params, "expected an object")
    for key, value in params.items():
        if isinstance(value, dict):
            raise unsupported(f"{field}.{key}", value, "a rope per layer type is not implemented")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_FILE_KEYS:
        raise unsupported(
            f"{field}.rope_type", rope_type, f"implemented: {', '.join(_ROPE_FILE_KEYS)}"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise unsupported(
            "partial_rotary_factor", partial, "rope on part of a head is not implemented"
        )
    unknown = sorted(set(params) - _ROPE_COMMON_KEYS - _ROPE_FILE_KEYS[rope_type])
    if unknown:
        key = unknown[0]
        raise unsupported(
            f"{field}.{key}", params[key], f"not a parameter of rope_type {rope_type!r}"
        )
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10_000.0)))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise CheckpointError(f"config.json: {field}.factor is required for {rope_type!r}")
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    # transformers fills the pre-training context from max_position_embeddings, and lets a
    # top-level original_max_position_embeddings (Phi-3 style) override the rope dict's.
    original = int(
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_position_embeddings
    )
    if rope_type == "llama3":
        return _llama3_rope(field, params, theta, original)
    return _yarn_rope(params, theta, original, max_position_embeddings)


def _llama3_rope(field: str, params: dict[str, Any], theta: float, original: int) -> RopeConfig:
    for key in ("low_freq_factor", "high_freq_factor"):
        if params.get(key) is None:
            raise CheckpointError(f"config.json: {field}.{key} is required for 'llama3'")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        original_max_position_embeddings=original,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
    )


def _yarn_rope(
    params: dict[str, Any], theta: float, original: int, max_position_embeddings: int
) -> RopeConfig:
    """YaRN, with transformers' defaults: betas 32 / 1, truncation on, attention factor from
    ``factor`` (and mscale / mscale_all_dim when both are given)."""
    factor = params["factor"]
    factor = float(max_position_embeddings / original if factor is None else factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def architecture_fields(config: Any) -> dict[str, Any]:
    """A config dataclass's fields as JSON-able values (nested configs as dicts), but those
    that leave every token's KV as it is: end and start ids, context length, stored dtype."""
    fields = asdict(config)
    for name in ("eos_token_ids", "bos_token_id", "max_position_embeddings", "torch_dtype"):
        fields.pop(name)
    return fields

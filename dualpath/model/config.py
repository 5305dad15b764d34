"""Architecture of a decoder-only checkpoint, parsed from its Hugging Face ``config.json``.

Supported: the Llama / Qwen2 family (RMSNorm, RoPE, grouped-query attention, SwiGLU, optional
QKV bias). Anything else is refused with a ``CheckpointError`` that names the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dualpath.errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (Qwen2 has it, Llama does not)
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

    def kv_bytes_per_token_per_layer(self, itemsize: int) -> int:
        """Bytes of one token's K and V in one layer: ``2 * num_kv_heads * head_dim * itemsize``."""
        return 2 * self.num_kv_heads * self.head_dim * itemsize

    def architecture_dict(self) -> dict[str, Any]:
        """Every field that changes what the KV of a token is (for the store's fingerprint)."""
        fields = asdict(self)
        for name in ("eos_token_ids", "bos_token_id", "max_position_embeddings", "torch_dtype"):
            fields.pop(name)
        return fields

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
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
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
            raise CheckpointError(f"config.json: rope_scaling {rope_scaling!r} is not supported")
        if raw.get("use_sliding_window") or (
            architecture == "MistralForCausalLM" and raw.get("sliding_window")
        ):
            raise CheckpointError("config.json: sliding-window attention is not supported")
        num_heads = int(need("num_attention_heads"))
        hidden_size = int(need("hidden_size"))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        try:
            return cls(
                architecture=architecture,
                vocab_size=int(need("vocab_size")),
                hidden_size=hidden_size,
                intermediate_size=int(need("intermediate_size")),
                num_layers=int(need("num_hidden_layers")),
                num_attention_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position_embeddings=int(need("max_position_embeddings")),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=(
                    architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False))
                ),
                eos_token_ids=tuple(int(i) for i in eos_ids),
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            )
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json: malformed field: {exc}") from exc

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise CheckpointError(f"{path}: not found (is this a checkpoint directory?)") from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot be parsed as JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        return cls.from_dict(raw)

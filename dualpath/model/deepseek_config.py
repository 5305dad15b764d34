"""Architecture of a DeepSeek-V3 / V3.2 checkpoint, parsed from its Hugging Face ``config.json``,
and the layout of the entry one token caches per layer, both computed without torch.

The scheduler process sizes the KV of a token (``kv_bytes_per_token_per_layer``) and names the
store namespace (``architecture_dict``) from a ``DeepseekConfig`` alone; the model that computes
the entries is ``dualpath.model.deepseek``. ``DeepseekConfig`` shares the dense
``ModelConfig``'s names for what they have in common (``from_file``, ``architecture``,
``num_layers``, ``vocab_size``, ``hidden_size``, ``max_position_embeddings``, ``eos_token_ids``,
``bos_token_id``, ``torch_dtype`` and the two methods above); it has no ``num_kv_heads`` /
``head_dim``, as its cache is one entry per token (``cache_entry_spec``). Rope and eos ids are
parsed by config.py's own functions. A field that would change the computation and is not
implemented is refused with a ``CheckpointError`` that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dualpath.errors import CheckpointError
from dualpath.model.config import (
    RopeConfig,
    architecture_fields,
    eos_ids,
    read_json_object,
    rope_config,
    unsupported,
    with_generation_config_eos,
)

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
_V32 = "DeepseekV32ForCausalLM"

# transformers 5.24's DeepseekV3Config / DeepseekV32Config defaults for a key a file omits.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,  # V3.2's docstring says 1; its dataclass field, which is what counts, says 8
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_interleave": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
}
_DEFAULT_MAX_POSITIONS = {"DeepseekV3ForCausalLM": 4096, _V32: 163840}
# DeepSeek's own config.json keys that select another computation than the one implemented; a
# file may state the implemented value (the published checkpoints do) or leave the key out.
_IMPLEMENTED_VALUES: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("sigmoid",),  # V2's softmax router is not implemented
    "topk_method": ("noaux_tc",),  # the bias-corrected, group-limited top-k of V3
    "moe_layer_freq": (1,),  # every layer from first_k_dense_replace on is MoE
    "hidden_act": ("silu", "swish"),
}
_IMPLEMENTED_ROPE_TYPES = ("default", "yarn")


_FP8_SCALE_GROUP = 128  # values per float32 scale in DeepSeek's FP8 caches


@dataclass(frozen=True, slots=True)
class IndexerConfig:
    """DeepSeek-V3.2's lightning indexer, which picks the keys each query attends to (DSA)."""

    num_heads: int  # index_n_heads
    head_dim: int  # index_head_dim; its first qk_rope_head_dim values are rotated
    topk: int  # index_topk: keys kept per query; all of them while the context is shorter


@dataclass(frozen=True, slots=True)
class DeepseekConfig:
    """Architecture of a DeepSeek-V3 / V3.2 checkpoint, from its config.json (``from_file``,
    ``from_dict``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP of the first layers
    moe_intermediate_size: int  # one routed expert's; the shared expert's is this times its count
    num_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int  # width of the cached latent
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_routed_experts: int  # n_routed_experts
    num_shared_experts: int  # n_shared_experts
    num_experts_per_tok: int
    num_expert_groups: int  # n_group: routed experts are picked from topk_group of these groups
    num_topk_groups: int  # topk_group
    norm_topk_prob: bool  # renormalise the chosen experts' weights to sum to 1
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" (an MLP) or "sparse" (MoE)
    rms_norm_eps: float
    rope: RopeConfig  # over the qk_rope_head_dim rotary dims
    rope_interleave: bool  # MLA's rope turns dims (0, 1), (2, 3), ... (V3.2: always)
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared
    attention_bias: bool  # bias on q_a_proj, kv_a_proj_with_mqa and o_proj
    indexer: IndexerConfig | None  # V3.2 only
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str  # the checkpoint's stored dtype

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config.json: {name} must be > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise CheckpointError(
                f"config.json: rope needs an even qk_rope_head_dim, got {self.qk_rope_head_dim}"
            )
        layer_types = self.mlp_layer_types
        if len(layer_types) != self.num_layers or set(layer_types) - {"dense", "sparse"}:
            raise CheckpointError(
                f"config.json: mlp_layer_types must be 'dense' or 'sparse' for each of the "
                f"{self.num_layers} layers, got {list(self.mlp_layer_types)}"
            )
        if "sparse" in self.mlp_layer_types:
            self._check_routing()
        if self.indexer is not None and self.indexer.head_dim < self.qk_rope_head_dim:
            raise CheckpointError(
                f"config.json: index_head_dim ({self.indexer.head_dim}) must be >= "
                f"qk_rope_head_dim ({self.qk_rope_head_dim})"
            )

    def _check_routing(self) -> None:
        groups, experts = self.num_expert_groups, self.num_routed_experts
        if groups <= 0 or experts % groups or experts // groups < 2:
            raise CheckpointError(
                f"config.json: n_routed_experts ({experts}) must split into n_group ({groups}) "
                "groups of >= 2 (a group scores by its top two experts)"
            )
        allowed = self.num_topk_groups * (experts // groups)
        if not 0 < self.num_topk_groups <= groups or not 0 < self.num_experts_per_tok <= allowed:
            raise CheckpointError(
                f"config.json: topk_group ({self.num_topk_groups}) must be in 1..n_group and "
                f"num_experts_per_tok ({self.num_experts_per_tok}) in 1..{allowed}"
            )

    def kv_bytes_per_token_per_layer(self, itemsize: int) -> int:
        """Bytes one token caches in one layer: its entry, ``entry_dim * itemsize``."""
        return cache_entry_spec(self).dim * itemsize

    def fp8_cache_bytes_per_token_per_layer(self) -> tuple[int, int]:
        """(MLA bytes, indexer bytes) one token caches in one layer in DeepSeek's deployed FP8
        cache: FlashMLA's layout, the latent in e4m3 with one float32 scale per 128 values
        plus the rope key in bfloat16 (656 B for V3 and V3.2), and V3.2's indexer key in e4m3
        with one float32 scale per 128 values (132 B). For accounting (SPEC §7 derives the
        paper's figures from it, the simulator's profiles quote it): this runtime caches in
        float32, bfloat16 or float16 only (``kv_bytes_per_token_per_layer``)."""
        latent = self.kv_lora_rank + 4 * -(-self.kv_lora_rank // _FP8_SCALE_GROUP)
        mla = latent + 2 * self.qk_rope_head_dim
        if self.indexer is None:
            return mla, 0
        head_dim = self.indexer.head_dim
        return mla, head_dim + 4 * -(-head_dim // _FP8_SCALE_GROUP)

    def cache_entry_parts(self) -> tuple[tuple[str, int], ...]:
        """What one token's entry in one layer holds: (name, values) in order."""
        return cache_entry_spec(self).parts

    def architecture_dict(self) -> dict[str, Any]:
        """Every field that changes what the KV of a token is (for the store's fingerprint), as
        ``ModelConfig.architecture_dict``: JSON-able, nested configs as dicts."""
        return architecture_fields(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekConfig:
        """Parse a config.json object; ``CheckpointError`` names the first field we cannot honour.

        Keys a file omits take transformers 5.24's defaults. Accepted and not used: training-only
        keys (``aux_loss_alpha``, ``seq_aux``, ``attention_dropout``, ...), parallelism
        (``ep_size``), the derived ``head_dim`` / ``qk_head_dim`` (transformers recomputes them)
        and ``num_nextn_predict_layers``: the multi-token-prediction module is extra weights
        after the last layer that the main forward never runs.
        """
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else None
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"config.json: architecture {architecture!r} is not supported here; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def get(key: str) -> Any:
            return raw.get(key, _DEFAULTS[key])

        try:
            _check_implemented(raw, architecture)
            num_layers = int(get("num_hidden_layers"))
            max_positions = int(
                raw.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[architecture])
            )
            nope_dim, rope_dim = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim"))
            rope, softmax_scale = _rope_and_softmax_scale(raw, max_positions, nope_dim + rope_dim)
            q_lora_rank = get("q_lora_rank")
            return cls(
                architecture=architecture,
                vocab_size=int(get("vocab_size")),
                hidden_size=int(get("hidden_size")),
                intermediate_size=int(get("intermediate_size")),
                moe_intermediate_size=int(get("moe_intermediate_size")),
                num_layers=num_layers,
                num_attention_heads=int(get("num_attention_heads")),
                q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
                kv_lora_rank=int(get("kv_lora_rank")),
                qk_nope_head_dim=nope_dim,
                qk_rope_head_dim=rope_dim,
                v_head_dim=int(get("v_head_dim")),
                num_routed_experts=int(get("n_routed_experts")),
                num_shared_experts=int(get("n_shared_experts")),
                num_experts_per_tok=int(get("num_experts_per_tok")),
                num_expert_groups=int(get("n_group")),
                num_topk_groups=int(get("topk_group")),
                norm_topk_prob=bool(get("norm_topk_prob")),
                routed_scaling_factor=float(get("routed_scaling_factor")),
                mlp_layer_types=_mlp_layer_types(raw, architecture, num_layers),
                rms_norm_eps=float(get("rms_norm_eps")),
                rope=rope,
                rope_interleave=bool(get("rope_interleave")),
                softmax_scale=softmax_scale,
                attention_bias=bool(get("attention_bias")),
                indexer=IndexerConfig(
                    num_heads=int(get("index_n_heads")),
                    head_dim=int(get("index_head_dim")),
                    topk=int(get("index_topk")),
                )
                if architecture == _V32
                else None,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(get("tie_word_embeddings")),
                eos_token_ids=eos_ids(get("eos_token_id"), "config.json"),
                bos_token_id=get("bos_token_id"),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"config.json: malformed field: {exc}") from exc

    @classmethod
    def from_file(cls, path: Path) -> DeepseekConfig:
        """Parse ``path`` (a config.json) and add the eos ids of a generation_config.json beside it,
        as ``ModelConfig.from_file`` does."""
        return with_generation_config_eos(cls.from_dict(read_json_object(path)), path)


def _check_implemented(raw: dict[str, Any], architecture: str) -> None:
    """Refuse, by name, each field whose value asks for a computation not implemented here."""
    if raw.get("quantization_config") is not None:
        raise unsupported(
            "quantization_config",
            raw["quantization_config"],
            "quantized weights (e.g. the published FP8 checkpoints) must be dequantized first",
        )
    for key, implemented in _IMPLEMENTED_VALUES.items():
        value = raw.get(key, implemented[0])
        if value not in implemented:
            raise unsupported(key, value, f"implemented: {', '.join(map(str, implemented))}")
    if raw.get("mlp_bias"):
        raise unsupported("mlp_bias", raw["mlp_bias"], "the MLP projections have no bias")
    num_heads = raw.get("num_attention_heads", _DEFAULTS["num_attention_heads"])
    num_kv_heads = raw.get("num_key_value_heads", _DEFAULTS["num_key_value_heads"])
    if num_kv_heads is not None and num_kv_heads != num_heads:  # None: as many as heads
        raise unsupported(
            "num_key_value_heads",
            num_kv_heads,
            f"MLA expands the latent into all {num_heads} heads; fewer KV heads are not "
            "implemented (transformers would repeat the expanded heads)",
        )
    if architecture == _V32:
        _check_v32(raw)


def _check_v32(raw: dict[str, Any]) -> None:
    if "q_lora_rank" in raw and raw["q_lora_rank"] is None:
        raise unsupported("q_lora_rank", None, "V3.2's indexer reads the low-rank query")
    if raw.get("rope_interleave", True) is not True:
        raise unsupported(
            "rope_interleave", raw["rope_interleave"], "V3.2's MLA rope is always interleaved"
        )
    for i, layer_type in enumerate(raw.get("layer_types") or []):
        if layer_type != "indexed_attention":
            raise unsupported(
                f"layer_types[{i}]", layer_type, "every V3.2 layer is indexed_attention"
            )


def _mlp_layer_types(raw: dict[str, Any], architecture: str, num_layers: int) -> tuple[str, ...]:
    """V3: MoE from ``first_k_dense_replace`` on; V3.2 takes ``mlp_layer_types`` over that."""
    if architecture == _V32 and raw.get("mlp_layer_types") is not None:
        return tuple(raw["mlp_layer_types"])
    num_dense = min(
        int(raw.get("first_k_dense_replace", _DEFAULTS["first_k_dense_replace"])), num_layers
    )
    return ("dense",) * num_dense + ("sparse",) * (num_layers - num_dense)


def _rope_and_softmax_scale(
    raw: dict[str, Any], max_positions: int, qk_head_dim: int
) -> tuple[RopeConfig, float]:
    """The rope (config.py's ``rope_config``) and the softmax scale: ``qk_head_dim ** -0.5``,
    which YaRN with ``mscale_all_dim`` multiplies by mscale twice (transformers'
    ``yarn_apply_mscale``, in its order, for the same rounding)."""
    rope = rope_config(raw, max_positions)
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    if rope.rope_type not in _IMPLEMENTED_ROPE_TYPES:
        raise unsupported(
            f"{field}.rope_type",
            rope.rope_type,
            f"implemented for DeepSeek: {', '.join(_IMPLEMENTED_ROPE_TYPES)}",
        )
    scale = qk_head_dim ** (-0.5)
    mscale_all_dim = (raw.get(field) or {}).get("mscale_all_dim")
    if rope.rope_type == "yarn" and mscale_all_dim:
        factor = rope.factor
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return rope, scale


@dataclass(frozen=True, slots=True)
class CacheEntrySpec:
    """What one token caches in one layer: one flat vector, ``parts`` (name, width) in order."""

    parts: tuple[tuple[str, int], ...]

    @property
    def dim(self) -> int:
        return sum(width for _, width in self.parts)


def cache_entry_spec(config: DeepseekConfig) -> CacheEntrySpec:
    """The entry layout of ``config``, from the config alone (576 values for DeepSeek-V3, 704
    for V3.2; what each part holds: ``dualpath.model.deepseek``)::

        | latent: kv_lora_rank | rope_key: qk_rope_head_dim | index_key: index_head_dim (V3.2) |
    """
    parts = (("latent", config.kv_lora_rank), ("rope_key", config.qk_rope_head_dim))
    if config.indexer is not None:
        parts += (("index_key", config.indexer.head_dim),)
    return CacheEntrySpec(parts)

"""Convert a llama.cpp GGUF file into a Hugging Face checkpoint directory.

    dualpath convert-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR [--dtype float32]

The GGUF is read and its tensors dequantized by the ``gguf`` library (no quant decoding of our
own); the tokenizer is rebuilt with ``tokenizers`` from the GGUF's vocabulary and merges. The
result is the directory a downloaded checkpoint is (``config.json`` with ``architectures``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with the chat template,
``generation_config.json``), loaded by the same loader, so it is served like any other.

Supported: ``general.architecture == "llama"`` with a GPT-2-style BPE vocabulary (SmolLM2 and
its kin). Anything the conversion cannot represent exactly is refused by name: another
architecture, rope scaling, experts, another tokenizer model or pre-tokenizer. The output is
written atomically (a temp directory renamed into place), so a failed conversion leaves
nothing behind.

Dequantized weights are exact in float32 (a Q4_1 weight is ``d * q + m`` with float16 ``d``
and ``m``); bfloat16 rounds them (see ``DEFAULT_DTYPE`` for why float32 is the default).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dualpath.errors import CheckpointError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# float32: the dequantized values exactly, and on this project's reference CPU (2 cores,
# AVX-512 with BF16) measured faster than bfloat16 for both prefill and decode of SmolLM2-135M
# (see `dualpath bench engine`); bfloat16 halves the file and the memory traffic where a CPU
# or GPU has fast bf16 matmuls.
DEFAULT_DTYPE = "float32"
# Names, not torch dtypes: the CLI lists them, and building its parser must not import torch.
DTYPES = ("float32", "bfloat16")

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF metadata keys of a llama model that we map (anything else under "llama." is refused).
_LLAMA_KEYS = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "vocab_size",
    "attention.key_length",
    "attention.value_length",
}

# llama.cpp's pre-tokenizer names -> the split it applies before byte-level BPE.
# "smollm" (like "starcoder") splits every digit on its own, then applies GPT-2's regex.
_PRE_TOKENIZERS = ("gpt-2", "default", "smollm", "starcoder")

# GGUF tensor names -> Hugging Face names ("{}" is the layer index).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: a special token


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, dtype: str = DEFAULT_DTYPE, overwrite: bool = False
) -> Path:
    """Write the checkpoint of ``gguf_path`` to ``out_dir`` atomically; return ``out_dir``.

    ``CheckpointError`` names the problem for a file that is not a GGUF, is truncated, or holds
    something we do not support; ``FileExistsError`` when ``out_dir`` exists and ``overwrite``
    is false. Concurrent converters are safe: exactly one rename wins.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists")
    reader = _open(gguf_path)
    metadata = _metadata(reader)
    config = _config(metadata, gguf_path, dtype)

    def write(tmp: Path) -> None:
        _write_weights(reader, config, tmp / "model.safetensors", dtype, gguf_path)
        _write_tokenizer(metadata, tmp, gguf_path)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(metadata))

    from dualpath.model.make import write_dir_atomically  # lazy (torch): after the checks

    write_dir_atomically(out_dir, write)
    logger.info("converted %s to %s (%s)", gguf_path, out_dir, dtype)
    return out_dir


def _open(path: Path):  # -> gguf.GGUFReader
    import gguf

    if not path.is_file():
        what = "is a directory, not a GGUF file" if path.is_dir() else "no such file"
        raise CheckpointError(f"{path}: {what}")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, IndexError, OSError) as exc:
        # The library reports a bad magic, an unknown version or a file cut short (its fields
        # or tensors run past the end) as ValueError / IndexError with a low-level message.
        with open(path, "rb") as file:
            is_gguf = file.read(4) == b"GGUF"
        what = "truncated or corrupt GGUF file" if is_gguf else "not a GGUF file (no GGUF magic)"
        raise CheckpointError(
            f"{path}: {what}, {path.stat().st_size} bytes (the reader said: {exc})"
        ) from exc


def _metadata(reader) -> dict[str, Any]:
    """Every metadata field's value (arrays as lists), except the GGUF header's own."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def _config(meta: dict[str, Any], path: Path, dtype: str) -> dict[str, Any]:
    """``config.json`` as transformers writes a Llama checkpoint's, from the GGUF's metadata."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    unknown = sorted(
        k for k in meta if k.startswith(f"{arch}.") and k[len(arch) + 1 :] not in _LLAMA_KEYS
    )
    if unknown:
        raise CheckpointError(f"{path}: GGUF fields not supported by the conversion: {unknown}")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise CheckpointError(f"{path}: GGUF field {arch}.{key} is missing")
        return meta[f"{arch}.{key}"]

    hidden_size, num_heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = hidden_size // num_heads
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(
            f"{path}: {arch}.rope.dimension_count {rope_dim} != head dim {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    for key in ("attention.key_length", "attention.value_length"):
        if int(meta.get(f"{arch}.{key}", head_dim)) != head_dim:
            raise CheckpointError(f"{path}: {arch}.{key} differs from the head dim {head_dim}")
    vocab_size = len(_need_tokenizer_field(meta, "tokens", path))
    if int(meta.get(f"{arch}.vocab_size", vocab_size)) != vocab_size:
        raise CheckpointError(f"{path}: {arch}.vocab_size disagrees with the tokenizer's tokens")
    rope_theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        # Both spellings: transformers >= 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": None,  # set once the tensors are known (no output.weight)
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "dtype": dtype,
    }


def _tensors(reader, path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in Hugging Face's [out, in] order) for every tensor."""
    from gguf import quants

    for tensor in reader.tensors:
        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise CheckpointError(
                f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}) cannot be read: {exc}"
            ) from exc
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        if values.size != int(np.prod(shape)):
            raise CheckpointError(
                f"{path}: tensor {tensor.name} holds {values.size} values, expected "
                f"{int(np.prod(shape))} (is the file truncated?)"
            )
        yield tensor.name, values.reshape(shape).astype(np.float32, copy=False)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (interleaved rope pairs -> rotate-half halves).

    llama.cpp's converter stores, per head, the rows as pairs (0, d/2), (1, d/2 + 1), ...;
    Hugging Face's rotate-half convention wants the first half then the second.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _write_weights(reader, config: dict[str, Any], out: Path, dtype: str, path: Path):
    import torch
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {}
    for name, values in _tensors(reader, path):
        hf_name = _hf_name(name)
        if hf_name is None:
            raise CheckpointError(f"{path}: tensor {name} is not part of a llama model")
        if name.endswith("attn_q.weight"):
            values = _unpermute_rope(values, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            values = _unpermute_rope(values, config["num_key_value_heads"])
        weight = torch.from_numpy(np.require(values, requirements=["C", "W"]))
        state[hf_name] = weight.to(getattr(torch, dtype))
    config["tie_word_embeddings"] = "lm_head.weight" not in state
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{name}"
        for i in range(config["num_hidden_layers"])
        for name in _LAYER_TENSORS.values()
    }
    missing = sorted(expected - state.keys())
    if missing:
        raise CheckpointError(f"{path}: tensors missing: {missing[:5]}")
    save_file(state, str(out), metadata={"format": "pt"})


def _need_tokenizer_field(meta: dict[str, Any], name: str, path: Path) -> Any:
    key = f"tokenizer.ggml.{name}"
    if key not in meta:
        raise CheckpointError(f"{path}: GGUF field {key} is missing")
    return meta[key]


def _write_tokenizer(meta: dict[str, Any], out: Path, path: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    model = _need_tokenizer_field(meta, "model", path)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported; supported: 'gpt2'"
        )
    if pre not in _PRE_TOKENIZERS:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported; "
            f"supported: {', '.join(_PRE_TOKENIZERS)}"
        )
    if meta.get("tokenizer.ggml.add_bos_token") or meta.get("tokenizer.ggml.add_space_prefix"):
        raise CheckpointError(f"{path}: add_bos_token / add_space_prefix are not supported")
    tokens = list(_need_tokenizer_field(meta, "tokens", path))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _need_tokenizer_field(meta, "merges", path)]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder"):
        digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_TYPE_CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else tokens[int(token_id)]

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 0)),
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = template
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")

"""Load a Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer.json.

The same code loads the generated embedded default and a real downloaded checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dualpath.errors import CheckpointError
from dualpath.kv.hashing import digest_files
from dualpath.model.config import ModelConfig
from dualpath.model.deepseek import DeepseekDecoderModel
from dualpath.model.deepseek_config import DeepseekConfig
from dualpath.model.deepseek_moe import stack_expert_weights
from dualpath.model.identity import weight_files
from dualpath.model.layerwise import LayerwiseModel
from dualpath.model.llama import DecoderModel
from dualpath.model.registry import AnyModelConfig, read_config
from dualpath.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Each architecture's model class, by its config class (``registry.CONFIG_CLASSES``).
MODEL_CLASSES: dict[type, type[LayerwiseModel]] = {
    ModelConfig: DecoderModel,
    DeepseekConfig: DeepseekDecoderModel,
}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve, with what identifies its KV (``weights_digest``)."""

    path: Path
    config: AnyModelConfig
    model: LayerwiseModel
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    # Hash of the safetensors files' contents: part of the KV store's namespace.
    weights_digest: str


def available_device(device: str) -> torch.device:
    """``device`` as torch's; ``ValueError`` for a CUDA device this machine does not have
    (torch would fail on the first tensor moved there, with an assertion)."""
    torch_device = torch.device(device)
    if torch_device.type != "cuda":
        return torch_device
    num_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (torch_device.index or 0) >= num_devices:
        seen = f"cuda:0 to cuda:{num_devices - 1}" if num_devices else "no CUDA device"
        build = "" if torch.version.cuda else " (this torch is built without CUDA)"
        raise ValueError(f"device {device!r} is not available: torch sees {seen}{build}")
    return torch_device


def load_model(path: Path, *, device: str = "cpu", dtype: str | None = None) -> LoadedModel:
    """Load the checkpoint at ``path`` onto ``device`` in ``dtype`` (default: its stored dtype)."""
    torch_device = available_device(device)
    path = Path(path)
    files = weight_files(path)
    config = read_config(path / "config.json")
    tokenizer_path = path / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json")
    tokenizer = Tokenizer(tokenizer_path)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{config.vocab_size}"
        )
    dtype_name = dtype or config.torch_dtype
    if dtype_name not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype_name!r}")
    torch_dtype = TORCH_DTYPES[dtype_name]

    model = MODEL_CLASSES[type(config)](config, device="meta")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: cannot load weights: {exc}") from exc
    if isinstance(config, DeepseekConfig):
        state = stack_expert_weights(state)  # per-expert tensors on disk, stacked in the model
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match {config.architecture}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    state = {name: t.to(device=torch_device, dtype=torch_dtype) for name, t in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = model.rope_inv_freq().to(torch_device)  # built on meta: recompute
    model.eval()
    digest = digest_files(files)
    logger.info(
        "loaded %s (%s, %d layers) from %s on %s as %s",
        config.architecture,
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params",
        config.num_layers,
        path,
        torch_device,
        dtype_name,
    )
    return LoadedModel(path, config, model, tokenizer, torch_dtype, torch_device, digest)

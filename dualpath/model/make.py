"""Generate a small random-weight checkpoint in Hugging Face format: the embedded default.

    dualpath make-model --preset tiny --out DIR

No hub access is needed: a byte-level BPE tokenizer is trained in-process on a bundled text
and the weights come from a seeded generator, so the same preset and seed always give the same
bytes (and so the same KV-store namespace). The files are the ones a downloaded checkpoint has
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) and they are loaded by the same loader.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dualpath.errors import CheckpointError
from dualpath.model.layerwise import LayerwiseModel
from dualpath.model.loader import MODEL_CLASSES
from dualpath.model.presets import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PRESETS,
    SPECIAL_TOKENS,
    Preset,
    preset_config,
)
from dualpath.model.registry import config_from_dict

logger = logging.getLogger(__name__)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE on the bundled corpus: every byte sequence encodes, specials included."""
    text = resources.files("dualpath.model").joinpath("data/corpus.txt").read_text("utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"bundled corpus too small: BPE reached {tokenizer.get_vocab_size()} of {vocab_size}"
        )
    return tokenizer


def init_weights(model: LayerwiseModel, preset: Preset, seed: int) -> None:
    """Seeded init: unit-variance activations through every layer, wide logits at the end."""
    gen = torch.Generator().manual_seed(seed)
    residual_scale = 1.0 / math.sqrt(2 * preset.num_layers)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):  # a projection's, a norm's, a router's correction
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif name == "model.embed_tokens.weight":
                param.copy_(torch.randn(param.shape, generator=gen))
            elif name == "lm_head.weight":
                std = preset.logit_std / math.sqrt(preset.hidden_size)
                param.copy_(std * torch.randn(param.shape, generator=gen))
            else:  # a projection (MoE experts' stacked: [experts, out, in])
                std = 1.0 / math.sqrt(param.shape[-1])
                if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                    std *= residual_scale
                param.copy_(std * torch.randn(param.shape, generator=gen))


def make_model(
    preset_name: str,
    out_dir: Path,
    *,
    seed: int = 0,
    overwrite: bool = False,
    tokenizer_from: Path | None = None,
    max_position_embeddings: int | None = None,
) -> Path:
    """Write the preset's checkpoint to ``out_dir`` atomically (temp dir + rename).

    ``tokenizer_from``: a checkpoint directory whose ``tokenizer.json`` (a real model's, e.g.
    the embedded SmolLM2's) replaces the trained one; the vocabulary is then its size, and it
    must have the ChatML tokens the chat template writes. ``max_position_embeddings``: the
    context, instead of the preset's (a long-context checkpoint for protocol tests: random
    weights attend over any length).

    Raises ``ValueError`` for an unknown preset or a tokenizer without ChatML's tokens and
    ``FileExistsError`` when ``out_dir`` exists and ``overwrite`` is false. Concurrent writers
    are safe: exactly one rename wins.
    """
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite to replace it)")
    preset = PRESETS[preset_name]
    if max_position_embeddings is not None:
        if max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be >= 1, got {max_position_embeddings}")
        preset = dataclasses.replace(preset, max_position_embeddings=max_position_embeddings)
    if tokenizer_from is None:
        tokenizer = train_tokenizer(preset.vocab_size)
    else:
        tokenizer = _checkpoint_tokenizer(Path(tokenizer_from))
        preset = dataclasses.replace(preset, vocab_size=tokenizer.get_vocab_size())
    write_dir_atomically(out_dir, lambda tmp: _write_checkpoint(preset, tmp, seed, tokenizer))
    logger.info("wrote preset %r (seed %d) to %s", preset_name, seed, out_dir)
    return out_dir


def write_dir_atomically(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a fresh directory beside ``out_dir``, then rename it into place
    (replacing ``out_dir`` if it exists). A failure leaves nothing behind; of concurrent
    writers exactly one rename wins. ``CheckpointError`` when nothing can be written beside
    ``out_dir``."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as exc:  # a parent that is a file, a read-only file system, ...
        raise CheckpointError(
            f"{out_dir}: cannot be written: {_write_problem(out_dir, exc)}"
        ) from exc
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would follow the rename
        write(tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.replace(out_dir, old / "ckpt")
            shutil.rmtree(old)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_problem(out_dir: Path, exc: OSError) -> str:
    """Why nothing can be written beside ``out_dir``: mkdir says "File exists" for a parent
    that is a file, so name that parent instead."""
    for parent in out_dir.parents:
        if parent.exists():
            return exc.strerror if parent.is_dir() else f"{parent} is not a directory"
    return exc.strerror or str(exc)


def ensure_model(preset_name: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Return ``out_dir``, generating the preset there first if it is absent."""
    if (Path(out_dir) / "config.json").is_file():
        return Path(out_dir)
    try:
        return make_model(preset_name, out_dir, seed=seed)
    except (FileExistsError, OSError):
        if (Path(out_dir) / "config.json").is_file():  # another process won the rename
            return Path(out_dir)
        raise


def _checkpoint_tokenizer(model_dir: Path) -> Tokenizer:
    """``model_dir``'s tokenizer; ``ValueError`` unless it has ChatML's tokens."""
    path = model_dir / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception type for unreadable files
        raise ValueError(f"--tokenizer-from {model_dir}: cannot read {path}: {exc}") from exc
    missing = [t for t in ("<|im_start|>", EOS_TOKEN) if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(
            f"--tokenizer-from {model_dir}: its tokenizer lacks {', '.join(missing)}, which "
            "the checkpoint's ChatML chat template writes"
        )
    return tokenizer


def _write_checkpoint(preset: Preset, out: Path, seed: int, tokenizer: Tokenizer) -> None:
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    raw_config = preset_config(preset, tokenizer.get_vocab_size(), eos_id)
    config = config_from_dict(raw_config)
    model = MODEL_CLASSES[type(config)](config)
    init_weights(model, preset, seed)
    state = {k: v.contiguous() for k, v in _published_names(model.state_dict()).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "bos_token_id": None}, indent=2) + "\n"
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": preset.max_position_embeddings,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _published_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MoE experts as checkpoints publish them, one tensor per expert and projection (what
    transformers writes and ``deepseek.stack_expert_weights`` reads back); the rest as is."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}.{e}.up_proj.weight"] = up[e]
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out

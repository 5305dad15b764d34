"""``dualpath make-model`` and ``dualpath convert-gguf``: write a checkpoint directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from dualpath.home import DEFAULT_PRESET


def add_make_model(sub: argparse._SubParsersAction) -> None:
    from dualpath.model.presets import PRESETS

    p = sub.add_parser(
        "make-model",
        help="write a generated random-weight checkpoint in Hugging Face format",
        description="Write a small random-weight checkpoint (config.json, model.safetensors, "
        "tokenizer.json) with a byte-level BPE tokenizer trained on a bundled text. "
        + " ".join(f"'{name}': {preset.description}." for name, preset in PRESETS.items()),
    )
    p.add_argument("--preset", default=DEFAULT_PRESET, help="which preset (default: tiny)")
    _add_out_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        metavar="DIR",
        help="use this checkpoint's tokenizer.json (a real model's, with ChatML's tokens) "
        "instead of training one; the vocabulary takes its size",
    )
    p.add_argument(
        "--max-position-embeddings",
        type=int,
        metavar="N",
        help="the checkpoint's context in tokens (default: the preset's)",
    )
    p.set_defaults(func=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from dualpath.model.make import make_model

    try:
        path = make_model(
            args.preset,
            args.out,
            seed=args.seed,
            overwrite=args.force,
            tokenizer_from=args.tokenizer_from,
            max_position_embeddings=args.max_position_embeddings,
        )
    except FileExistsError as exc:
        raise ValueError(f"--out {args.out} already exists; pass --force to replace it") from exc
    print(f"wrote preset {args.preset!r} to {path}")
    return 0


def _add_out_arguments(p: argparse.ArgumentParser) -> None:
    """Where a command writes the checkpoint it makes: ``--out`` and ``--force``."""
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to create")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


# --- convert-gguf ----------------------------------------------------------------------------


def add_convert_gguf(sub: argparse._SubParsersAction) -> None:
    from dualpath.model.gguf import DEFAULT_DTYPE, DTYPES

    p = sub.add_parser(
        "convert-gguf",
        help="convert a llama.cpp GGUF file into a Hugging Face checkpoint directory",
        description="Dequantize a GGUF file's tensors (the gguf library) and rebuild its "
        "tokenizer, writing config.json, model.safetensors, tokenizer.json, "
        "tokenizer_config.json (with the chat template) and generation_config.json to --out, "
        "atomically: a failed conversion leaves nothing behind. Supported: llama-architecture "
        "GGUFs with a GPT-2-style BPE vocabulary (e.g. SmolLM2); anything else is refused by "
        "name. This is how the embedded default is made on first use.",
    )
    p.add_argument("gguf", type=Path, help="the .gguf file")
    _add_out_arguments(p)
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=DEFAULT_DTYPE,
        help=f"stored weight dtype (default {DEFAULT_DTYPE}: the dequantized values exactly, "
        "and the faster of the two on CPUs measured so far)",
    )
    p.set_defaults(func=_run_convert_gguf)


def _run_convert_gguf(args: argparse.Namespace) -> int:
    from dualpath.model.gguf import convert_gguf

    try:
        path = convert_gguf(args.gguf, args.out, dtype=args.dtype, overwrite=args.force)
    except FileExistsError as exc:
        raise ValueError(f"--out {args.out} already exists; pass --force to replace it") from exc
    print(f"converted {args.gguf} to {path}")
    return 0

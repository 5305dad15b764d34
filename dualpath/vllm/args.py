"""What a cluster of vLLM engines accepts, checked without vLLM: the engine arguments a user may
pass through (``--vllm-arg``), and the modes it serves; and the ``--engine`` / ``--vllm-arg``
flags every command that starts engines shares (``add_engine_kind_arguments``).

``dualpath.vllm.engine`` sets some arguments itself: given through, they would unhook the
connector or break what it relies on. They are refused by name here, where the flags are
read, and again where the engine is built.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from dualpath.config import VLLM_PREFILL_BATCHING, ClusterConfig, EngineConfig
from dualpath.model.registry import AnyModelConfig

ENGINE_KIND_CHOICES = ("native", "vllm")

# Engine arguments dualpath sets itself (its own flags give them).
RESERVED_VLLM_ARGS = (
    "model",
    "kv_transfer_config",
    "block_size",
    "dtype",
    "max_model_len",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enable_prefix_caching",
    "seed",
    "num_gpu_blocks_override",
)


def check_vllm_args(args: Mapping[str, Any]) -> None:
    """``ValueError`` naming every reserved argument in ``args``."""
    reserved = sorted(set(args) & set(RESERVED_VLLM_ARGS))
    if reserved:
        raise ValueError(
            f"vLLM argument(s) {', '.join(reserved)} are set by dualpath and cannot be passed "
            "through (use dualpath's own flags: --model, --block-size, --dtype, "
            "--max-model-len, --kv-cache-gb)"
        )


# vLLM's CPU MLA backend (``CPU_MLA``, what ``dualpath.vllm.engine.mla_args`` asks for) keeps
# 16-token pages whatever block size it is given: the store's blocks must be the same.
CPU_MLA_BLOCK_SIZE = 16


def engines_block_size(engine: str, model_config: AnyModelConfig) -> int:
    """The block size an engine of kind ``engine`` takes for ``model_config`` when none is
    given: ``CPU_MLA_BLOCK_SIZE`` for an MLA model on vLLM's CPU build (the only size its pages
    hold), else ``EngineConfig``'s (64, the paper's Full Block)."""
    if engine == "vllm" and _is_mla(model_config):
        from dualpath.model.identity import vllm_device  # lazy: torch

        if vllm_device() == "cpu":
            return CPU_MLA_BLOCK_SIZE
    return EngineConfig().block_size_tokens


def _is_mla(model_config: AnyModelConfig) -> bool:
    return "latent" in dict(model_config.cache_entry_parts())


def check_engine_kind(
    cluster: ClusterConfig, engine: EngineConfig, model_config: AnyModelConfig | None = None
) -> None:
    """``ValueError`` for engine settings the engine kind cannot serve: on vLLM engines, a
    reserved argument passed through, a device of ours, or (given the model's config) an MLA
    model on a CPU in blocks other than vLLM's MLA pages'. Every mode and read path is served
    on either kind."""
    if engine.engine != "vllm":
        return
    check_vllm_args(engine.vllm_args)
    check_vllm_device(engine.device)
    if model_config is None or not _is_mla(model_config):
        return
    from dualpath.model.identity import vllm_device

    if vllm_device() == "cpu" and engine.block_size_tokens != CPU_MLA_BLOCK_SIZE:
        raise ValueError(
            f"an MLA model on vLLM's CPU build runs on its CPU_MLA backend, whose pages hold "
            f"{CPU_MLA_BLOCK_SIZE} tokens: --block-size {engine.block_size_tokens} is refused "
            f"(pass --block-size {CPU_MLA_BLOCK_SIZE}, or leave it out)"
        )


def check_vllm_installed() -> None:
    """``ValueError`` saying where vLLM is, when this Python cannot import it (checked
    without importing it: that takes seconds)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "--engine vllm needs vLLM, which this Python does not have: run dualpath from "
            ".venv-vllm (`make test-vllm` builds it; README, 'On vLLM's engine')"
        )


def check_vllm_device(device: str) -> None:
    """``ValueError`` for ``--device`` given with ``--engine vllm``: the device is vLLM's
    platform's (the build installed), not ours to choose."""
    if device != "cpu":
        raise ValueError(
            f"--device {device} is the native engine's: vLLM runs on the platform its build is "
            "for (leave --device out with --engine vllm)"
        )


def add_engine_kind_arguments(parser: argparse.ArgumentParser, *, where: str) -> None:
    """``--engine`` and ``--vllm-arg``; ``where`` says what ``--engine vllm`` runs there."""
    parser.add_argument(
        "--engine",
        choices=ENGINE_KIND_CHOICES,
        default="native",
        help="what runs the model in each engine: 'native' (ours, the reference) or 'vllm' "
        "(vLLM's engine with dualpath's KV connector inside; needs vLLM installed, e.g. the "
        f"venv `make test-vllm` builds; {where}) (default native)",
    )
    add_vllm_arg_argument(parser, where="with --engine vllm")
    parser.add_argument(
        "--vllm-prefill-batching",
        choices=VLLM_PREFILL_BATCHING,
        default="vllm",
        help="with --engine vllm, what a prefill engine hands vLLM: 'vllm', every request "
        "whose KV reads are done, vLLM's scheduler packing its steps (max_num_batched_tokens, "
        "chunked prefill); 'quota', one batch at a time, packed FIFO under the compute quota "
        "(--attention-quota-s, SPEC §6) with a layer-time predictor profiled on vLLM at start, "
        "whole requests only (default vllm)",
    )


def add_vllm_arg_argument(parser: argparse.ArgumentParser, *, where: str) -> None:
    """``--vllm-arg KEY=VALUE`` (repeatable); ``where`` says which engines get it."""
    parser.add_argument(
        "--vllm-arg",
        type=vllm_arg,
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a vLLM engine argument (an EngineArgs field, e.g. max_num_seqs=32; the value "
        f"is read as JSON, else as a string), repeatable, {where}; the ones "
        "dualpath sets itself (the connector, block size, dtype, context, parallelism, "
        "prefix caching, seed) are refused",
    )


def vllm_arg(text: str) -> tuple[str, Any]:
    """``--vllm-arg KEY=VALUE``: (key with dashes as underscores, the value read as JSON, else
    the string)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.strip().replace("-", "_"), parsed


def engine_kind_args(args: argparse.Namespace) -> dict[str, Any]:
    """``{"engine": ..., "vllm_args": {...}, "vllm_prefill_batching": ...}`` from
    ``--engine``, ``--vllm-arg`` (later keys win) and ``--vllm-prefill-batching``, refusing
    vLLM settings given without ``--engine vllm`` and reserved arguments."""
    vllm_args = dict(args.vllm_arg or ())
    if vllm_args and args.engine != "vllm":
        raise ValueError("--vllm-arg passes arguments to vLLM: give it with --engine vllm")
    batching = getattr(args, "vllm_prefill_batching", "vllm")
    if batching != "vllm" and args.engine != "vllm":
        raise ValueError(
            "--vllm-prefill-batching is what a vLLM prefill engine hands vLLM: give it with "
            "--engine vllm"
        )
    check_vllm_args(vllm_args)
    return {"engine": args.engine, "vllm_args": vllm_args, "vllm_prefill_batching": batching}


def vllm_cpu_kv_memory(kv_cache_bytes: int, full_block_bytes: int) -> tuple[int, int]:
    """(``VLLM_CPU_KVCACHE_SPACE``, ``num_gpu_blocks_override``) of a vLLM engine or server
    with ``kv_cache_bytes`` of KV memory (``--kv-cache-gb``, GB): exactly the blocks those bytes
    hold, in as many whole GiB as they take (vLLM 0.32 reads that variable as an integer, envs.py).
    """
    from dualpath.units import GIB

    return max(1, -(-kv_cache_bytes // GIB)), kv_cache_bytes // full_block_bytes


# --- a vLLM server the user starts (``dualpath vllm-config``, ``dualpath.vllm.served``) ---

SERVED_CONFIG_KEY = "dualpath"  # kv_connector_extra_config[key]: the EngineProcessConfig
SERVED_CONNECTOR = ("DualpathServedConnector", "dualpath.vllm.served")
# The engine fields the connector takes from the configuration; vLLM decides the others.
SERVED_ENGINE_FIELDS = ("block_size_tokens", "dtype", "engine")
# The block size's fields: left out of a configuration, the server takes its model's
# (``engines_block_size``) when it starts.
_SERVED_BLOCK_SIZE_FIELDS = {
    "engine": ("block_size_tokens",),
    "scheduler": ("block_size_tokens", "min_prefill_chunk_tokens"),
}


def served_kv_transfer_config(config: Any, *, has_block_size: bool = True) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for a server that is the engine ``config`` (an
    ``EngineProcessConfig``) describes: our connector by module path, the configuration in
    ``kv_connector_extra_config``, without what vLLM decides (the model, the engine's context,
    KV memory and threads), and without the block size unless ``has_block_size`` (then the
    server takes its model's, ``served_engine_config``)."""
    import dataclasses

    from dualpath.config import config_to_dict

    data = config_to_dict(config)
    del data["model_dir"]
    data["engine"] = {
        name: getattr(config.engine, name)
        for name in SERVED_ENGINE_FIELDS
        if name in {f.name for f in dataclasses.fields(config.engine)}
    }
    if not has_block_size:
        for section, names in _SERVED_BLOCK_SIZE_FIELDS.items():
            for name in names:
                del data[section][name]
    name, module = SERVED_CONNECTOR
    return {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {SERVED_CONFIG_KEY: data},
    }


def _with_block_size(data: dict, model_dir: Any) -> dict:
    """``data`` (an ``EngineProcessConfig``'s dict) with the block size the checkpoint in
    ``model_dir`` takes on vLLM (``engines_block_size``) in every field that has none."""
    from dualpath.model.registry import read_config

    block_size = engines_block_size("vllm", read_config(model_dir / "config.json"))
    data = {**data}
    for section, names in _SERVED_BLOCK_SIZE_FIELDS.items():
        data[section] = {**{name: block_size for name in names}, **data.get(section, {})}
    return data


def served_engine_config(extra: dict, *, model: str, dtype: str, max_model_len: int) -> Any:
    """The ``EngineProcessConfig`` of a vLLM server that runs ``model`` in ``dtype`` with a
    context of ``max_model_len``, from its ``kv_connector_extra_config``: what vLLM decides
    taken from vLLM; ``ValueError`` naming a field that is vLLM's to decide, or the vLLM flag
    to pass where vLLM's dtype differs from the store's."""
    import dataclasses
    from pathlib import Path

    from dualpath.config import EngineProcessConfig, config_from_dict

    data = extra.get(SERVED_CONFIG_KEY)
    if not isinstance(data, dict):
        raise ValueError(
            f"kv_connector_extra_config has no {SERVED_CONFIG_KEY!r} object: give vLLM the "
            "configuration 'dualpath vllm-config' prints"
        )
    if "model_dir" in data:
        raise ValueError("model_dir is refused: the model is vLLM's --model")
    engine_data = data.get("engine", {})
    others = sorted(set(engine_data) - set(SERVED_ENGINE_FIELDS))
    if others:
        raise ValueError(f"engine field(s) {', '.join(others)} refused: vLLM's own flags decide")
    if not (Path(model) / "config.json").is_file():
        raise ValueError(
            f"vLLM serves {model!r}, not a checkpoint directory: dualpath keys the store by the "
            "checkpoint's files (serve a local directory)"
        )
    if "block_size_tokens" not in engine_data:  # vllm-config without --block-size
        data = _with_block_size(data, Path(model))
    config = config_from_dict(EngineProcessConfig, {**data, "model_dir": model})
    if not config.url:
        raise ValueError("the configuration names no url: the front door forwards requests there")
    engine = config.engine
    if engine.dtype != dtype:
        raise ValueError(
            f"vLLM runs {dtype}, the store is named for {engine.dtype}: pass --dtype "
            f"{engine.dtype} to vLLM (or 'dualpath vllm-config --dtype {dtype}')"
        )
    engine = dataclasses.replace(engine, engine="vllm", max_model_len=max_model_len)
    return dataclasses.replace(config, engine=engine)

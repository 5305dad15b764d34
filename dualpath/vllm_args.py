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
    if model_config is None or "latent" not in dict(model_config.cache_entry_parts()):
        return
    from dualpath.model.identity import vllm_device

    if vllm_device() == "cpu" and engine.block_size_tokens != CPU_MLA_BLOCK_SIZE:
        raise ValueError(
            f"an MLA model on vLLM's CPU build runs on its CPU_MLA backend, whose pages hold "
            f"{CPU_MLA_BLOCK_SIZE} tokens: pass --block-size {CPU_MLA_BLOCK_SIZE}"
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


# --- a vLLM server the user starts (``dualpath vllm-config``, ``dualpath.cluster.served``) ---

SERVED_CONFIG_KEY = "dualpath"  # kv_connector_extra_config[key]: the EngineProcessConfig
SERVED_CONNECTOR = ("DualpathServedConnector", "dualpath.cluster.served")
# The engine fields the connector takes from the configuration; vLLM decides the others.
SERVED_ENGINE_FIELDS = ("block_size_tokens", "dtype", "engine")


def served_kv_transfer_config(config: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for a server that is the engine ``config`` (an
    ``EngineProcessConfig``) describes: our connector by module path, the configuration in
    ``kv_connector_extra_config``, without what vLLM decides (the model, the engine's context,
    KV memory and threads)."""
    import dataclasses

    from dualpath.config import config_to_dict

    data = config_to_dict(config)
    del data["model_dir"]
    data["engine"] = {
        name: getattr(config.engine, name)
        for name in SERVED_ENGINE_FIELDS
        if name in {f.name for f in dataclasses.fields(config.engine)}
    }
    name, module = SERVED_CONNECTOR
    return {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {SERVED_CONFIG_KEY: data},
    }


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
    config = config_from_dict(EngineProcessConfig, {**data, "model_dir": model})
    if not config.url:
        raise ValueError("the configuration names no url: the front door forwards requests there")
    if not (Path(model) / "config.json").is_file():
        raise ValueError(
            f"vLLM serves {model!r}, not a checkpoint directory: dualpath keys the store by the "
            "checkpoint's files (serve a local directory)"
        )
    engine = config.engine
    if engine.dtype != dtype:
        raise ValueError(
            f"vLLM runs {dtype}, the store is named for {engine.dtype}: pass --dtype "
            f"{engine.dtype} to vLLM (or 'dualpath vllm-config --dtype {dtype}')"
        )
    engine = dataclasses.replace(engine, engine="vllm", max_model_len=max_model_len)
    return dataclasses.replace(config, engine=engine)

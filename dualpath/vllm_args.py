"""What a cluster of vLLM engines accepts, checked without vLLM: the engine arguments a user may
pass through (``--vllm-arg``), and the modes it serves.

``dualpath.vllm.engine`` sets some arguments itself: given through, they would unhook the
connector or break what it relies on. They are refused by name here, where the flags are
read, and again where the engine is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dualpath.config import ClusterConfig, EngineConfig

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
)


def check_vllm_args(args: Mapping[str, Any]) -> None:
    """``ValueError`` naming every reserved argument in ``args``."""
    reserved = sorted(set(args) & set(RESERVED_VLLM_ARGS))
    if reserved:
        raise ValueError(
            f"vLLM argument(s) {', '.join(reserved)} are set by dualpath and cannot be passed "
            "through (use dualpath's own flags: --model, --block-size, --dtype, "
            "--max-model-len)"
        )


def check_engine_kind(cluster: ClusterConfig, engine: EngineConfig) -> None:
    """``ValueError`` for a cluster the engine kind cannot serve: on vLLM engines only the PE
    read path is built (the DE read path is not yet)."""
    if engine.engine != "vllm":
        return
    check_vllm_args(engine.vllm_args)
    read_path = cluster.settings.read_path
    if read_path != "pe":
        raise ValueError(
            f"mode {cluster.mode!r} with read path {read_path!r} reads on the DE side, which "
            "is not built on vLLM engines yet: give --read-path pe, or --mode basic"
        )

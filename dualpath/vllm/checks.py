"""What a vLLM engine must be for the connector to serve it exactly, checked when vLLM builds
the connector: one worker, the store's block size, full attention; and which attention backend
its KV layers use (the page layout follows from it, ``layouts``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dualpath.kv.layout import KVLayout


def attention_backend(vllm_config: Any, layer_names: Iterable[str]) -> str:
    """The attention backend vLLM chose for these layers (``get_name()``, e.g. ``CPU_ATTN``,
    ``CPU_MLA``, ``FLASH_ATTN``); ``ValueError`` if they differ (a hybrid model)."""
    context = vllm_config.compilation_config.static_forward_context
    names = {context[name].get_attn_backend().get_name() for name in layer_names}
    if len(names) != 1:
        raise ValueError(f"vLLM's KV layers use several attention backends: {sorted(names)}")
    return names.pop()


def check_config(vllm_config: Any, layout: KVLayout) -> None:
    """``ValueError`` naming the vLLM setting the connector cannot serve exactly."""
    parallel = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = getattr(parallel, name, 1)
        if value != 1:
            raise ValueError(f"dualpath's vLLM engine runs one worker: {name}={value} is refused")
    cache_config = vllm_config.cache_config
    if cache_config.block_size != layout.block_size_tokens:
        hint = "give --block-size to both"
        if vllm_config.model_config.use_mla:  # vLLM sets the block size for its MLA backend
            hint = f"pass --block-size {cache_config.block_size}, the size vLLM's MLA pages take"
        raise ValueError(
            f"vLLM block_size={cache_config.block_size} differs from the store's "
            f"{layout.block_size_tokens}-token blocks: {hint}"
        )
    model_config = vllm_config.model_config
    if getattr(model_config.hf_text_config, "sliding_window", None):
        raise ValueError("sliding-window attention is refused: the store holds whole contexts")

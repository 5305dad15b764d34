"""What an engine must hold for the longest request its model accepts, sized or checked at start.

Two memories gate a request on its way through a PE and a DE (SPEC §2–§3):

    KV buffer (host DRAM, both roles)   a DE's holds the request's whole prompt, in Full Block
                                        slots, until it is taken into the device cache; a PE's
                                        holds the PE-side hit blocks (fewer)
    device KV cache (the DE's)          prompt + every generated token, in paged blocks

A request that can never fit would wait forever (or fail after the server accepted it), so a
cluster and an engine refuse at start a size that cannot hold one request of the model's full
context, naming the setting and the size needed. With no buffer size configured, the buffer
holds ``NUM_MAX_CONTEXT_REQUESTS`` such requests. Both rules are pure byte arithmetic: the
launcher runs them before any engine process starts, the engine process again for itself.
"""

from __future__ import annotations

from dualpath.config import ClusterConfig, EngineConfig
from dualpath.kv.layout import KVLayout
from dualpath.units import GB

# A buffer with no size configured holds this many requests of the longest context at once:
# one filling (its reads, the PE's layers) while the one before it is taken up.
NUM_MAX_CONTEXT_REQUESTS = 2

# vLLM 0.32 keeps block 0 of its pool back as the null block (vllm/v1/core/block_pool.py:187),
# and its start check plans one request of the whole context against the other blocks
# (vllm/v1/core/kv_cache_utils.py:2627-2648, get_kv_cache_configs): a vLLM engine needs one
# block more than ours.
VLLM_NUM_NULL_BLOCKS = 1


def check_capacity(
    cluster: ClusterConfig, engine: EngineConfig, layout: KVLayout, max_model_len: int
) -> None:
    """``ValueError`` naming the setting if a PE's or a DE's buffer or a DE's device KV cache
    cannot hold one request of the whole ``max_model_len``-token context."""
    buffer_capacity_bytes(
        layout, max_model_len, cluster.prefill_buffer_bytes, what=_BUFFER_SETTING % "prefill"
    )
    buffer_capacity_bytes(
        layout, max_model_len, cluster.decode_buffer_bytes, what=_BUFFER_SETTING % "decode"
    )
    num_blocks = engine.num_device_blocks or engine.kv_cache_bytes // layout.full_block_bytes
    what = (
        "the device KV cache (EngineConfig.num_device_blocks)"
        if engine.num_device_blocks
        else "the device KV cache (--kv-cache-gb, EngineConfig.kv_cache_bytes)"
    )
    check_device_cache(
        num_blocks,
        layout.block_size_tokens,
        max_model_len,
        what=what,
        block_bytes=layout.full_block_bytes,
        engine=engine.engine,
    )


def role_buffer_bytes(
    cluster: ClusterConfig, role: str, layout: KVLayout, max_model_len: int
) -> int:
    """The KV buffer size of an engine of ``role`` ("prefill" or "decode")."""
    configured = cluster.prefill_buffer_bytes if role == "prefill" else cluster.decode_buffer_bytes
    return buffer_capacity_bytes(layout, max_model_len, configured, what=_BUFFER_SETTING % role)


_BUFFER_SETTING = "the %s engines' KV buffer (--buffer-gb)"


def max_request_slots(layout: KVLayout, max_model_len: int) -> int:
    """Full Block slots the longest request needs in a buffer: a prompt has at most
    ``max_model_len - 1`` tokens (one is left to generate; a request placed again carries its
    output so far in its prompt, under the same bound), and its partial tail block takes a
    slot in the DE's buffer."""
    return -(-(max_model_len - 1) // layout.block_size_tokens)


def buffer_capacity_bytes(
    layout: KVLayout, max_model_len: int, configured_bytes: int | None, *, what: str
) -> int:
    """The size of one engine's KV buffer: ``NUM_MAX_CONTEXT_REQUESTS`` longest requests when
    ``configured_bytes`` is None, else ``configured_bytes``, which must hold one of them
    (``ValueError`` naming ``what``, the setting, and the size needed)."""
    num_slots = max_request_slots(layout, max_model_len)
    needed_bytes = num_slots * layout.full_block_bytes
    if configured_bytes is None:
        return NUM_MAX_CONTEXT_REQUESTS * needed_bytes
    if configured_bytes < needed_bytes:
        raise ValueError(
            f"{what} of {configured_bytes / GB:.3f} GB holds "
            f"{configured_bytes // layout.full_block_bytes} Full Blocks of "
            f"{layout.full_block_bytes:,} bytes, but one request of the model's "
            f"{max_model_len:,}-token context needs {num_slots} ({_gb_up(needed_bytes)} GB): "
            f"give at least {_gb_up(needed_bytes)} GB, or leave it unset to size it at start "
            f"({NUM_MAX_CONTEXT_REQUESTS} such requests)"
        )
    return configured_bytes


def num_device_blocks_needed(block_size_tokens: int, max_model_len: int, *, engine: str) -> int:
    """Device KV blocks an engine of kind ``engine`` ("native" or "vllm") must have to start:
    one request of the whole context (prompt + output = ``max_model_len`` tokens), and on
    vLLM its null block (``VLLM_NUM_NULL_BLOCKS``), as vLLM's own start check counts them."""
    num_request_blocks = -(-max_model_len // block_size_tokens)
    return num_request_blocks + (VLLM_NUM_NULL_BLOCKS if engine == "vllm" else 0)


def check_device_cache(
    num_blocks: int,
    block_size_tokens: int,
    max_model_len: int,
    *,
    what: str,
    block_bytes: int,
    engine: str = "native",
) -> None:
    """``ValueError`` naming ``what`` unless ``num_blocks`` device KV blocks are enough for an
    engine of kind ``engine`` to start (``num_device_blocks_needed``)."""
    num_needed = num_device_blocks_needed(block_size_tokens, max_model_len, engine=engine)
    if num_blocks < num_needed:
        null_block = " and vLLM's null block" if engine == "vllm" else ""
        raise ValueError(
            f"{what} holds {num_blocks} KV blocks of {block_bytes:,} bytes, but one request of "
            f"the model's {max_model_len:,}-token context{null_block} needs {num_needed} "
            f"({_gb_up(num_needed * block_bytes)} GB): give at least that, or a shorter "
            "--max-model-len"
        )


def _gb_up(size_bytes: int) -> str:
    """``size_bytes`` in GB, rounded up at the third decimal (a size the user can pass)."""
    return f"{-(-size_bytes // 1_000_000) / 1000:.3f}"

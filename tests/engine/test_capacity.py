"""What a buffer and a device KV cache must hold, sized or refused at start."""

from __future__ import annotations

import pytest

from dualpath.config import ClusterConfig, EngineConfig
from dualpath.engine.capacity import (
    NUM_MAX_CONTEXT_REQUESTS,
    buffer_capacity_bytes,
    check_capacity,
    max_request_slots,
    num_device_blocks_needed,
    role_buffer_bytes,
)
from dualpath.kv.layout import KVLayout

# SmolLM2-135M in float32: 30 layers, 3 KV heads x 64 (K and V) x 4 bytes per token per layer.
SMOLLM2 = KVLayout(num_layers=30, block_size_tokens=64, bytes_per_token_per_layer=1536)


@pytest.mark.parametrize(
    ("max_model_len", "num_slots"), [(2, 1), (64, 1), (65, 1), (66, 2), (8192, 128)]
)
def test_the_longest_prompt_is_context_minus_one_with_its_tail_block(
    max_model_len: int, num_slots: int
) -> None:
    assert max_request_slots(SMOLLM2, max_model_len) == num_slots


def test_an_unset_buffer_holds_two_whole_context_requests() -> None:
    size = buffer_capacity_bytes(SMOLLM2, 8192, None, what="b")
    assert size == NUM_MAX_CONTEXT_REQUESTS * 128 * SMOLLM2.full_block_bytes == 754_974_720


def test_a_set_buffer_is_kept_if_it_holds_one_request_and_refused_if_not() -> None:
    one_request = 128 * SMOLLM2.full_block_bytes
    assert buffer_capacity_bytes(SMOLLM2, 8192, one_request, what="b") == one_request
    # The size that made an 8,191-token prompt fail mid-stream (84 slots): refused, by name.
    with pytest.raises(ValueError) as refused:
        buffer_capacity_bytes(SMOLLM2, 8192, 250_000_000, what="the DE buffer (--buffer-gb)")
    assert str(refused.value).startswith(
        "the DE buffer (--buffer-gb) of 0.250 GB holds 84 Full Blocks of 2,949,120 bytes, but "
        "one request of the model's 8,192-token context needs 128 (0.378 GB): give at least "
        "0.378 GB"
    )


def test_check_capacity_names_the_buffer_or_the_device_cache() -> None:
    engine = EngineConfig(kv_cache_bytes=1 << 30)
    check_capacity(ClusterConfig(), engine, SMOLLM2, 8192)  # defaults hold it
    with pytest.raises(ValueError, match=r"the prefill engines' KV buffer \(--buffer-gb\)"):
        check_capacity(ClusterConfig(prefill_buffer_bytes=1 << 20), engine, SMOLLM2, 8192)
    with pytest.raises(ValueError, match=r"the decode engines' KV buffer \(--buffer-gb\)"):
        check_capacity(ClusterConfig(decode_buffer_bytes=1 << 20), engine, SMOLLM2, 8192)
    # 128 blocks hold 8,192 tokens of prompt + output; 127 do not.
    check_capacity(ClusterConfig(), EngineConfig(num_device_blocks=128), SMOLLM2, 8192)
    with pytest.raises(ValueError, match=r"device KV cache .* holds 127 KV blocks .* needs 128"):
        check_capacity(ClusterConfig(), EngineConfig(num_device_blocks=127), SMOLLM2, 8192)
    with pytest.raises(ValueError, match=r"--kv-cache-gb"):
        small = EngineConfig(kv_cache_bytes=100 * SMOLLM2.full_block_bytes)
        check_capacity(ClusterConfig(), small, SMOLLM2, 8192)


def test_each_role_gets_its_own_buffer_size() -> None:
    cluster = ClusterConfig(decode_buffer_bytes=1 << 30)
    assert role_buffer_bytes(cluster, "decode", SMOLLM2, 8192) == 1 << 30
    assert role_buffer_bytes(cluster, "prefill", SMOLLM2, 8192) == 754_974_720


def test_a_vllm_engine_needs_its_null_block_too() -> None:
    """vLLM 0.32 holds block 0 back (BlockPool's null block) and checks the whole context
    against the rest: serve --engine vllm --kv-cache-gb 0.38 (128 blocks) passed our check, then
    every engine exited with vLLM's refusal. Now it is refused here, naming the minimum; the
    minimum (129 blocks, 0.381 GB) starts."""
    assert num_device_blocks_needed(64, 8192, engine="native") == 128
    assert num_device_blocks_needed(64, 8192, engine="vllm") == 129
    check_capacity(ClusterConfig(), EngineConfig(kv_cache_bytes=380_000_000), SMOLLM2, 8192)
    refused = EngineConfig(kv_cache_bytes=380_000_000, engine="vllm")  # 128 blocks
    with pytest.raises(ValueError) as error:
        check_capacity(ClusterConfig(), refused, SMOLLM2, 8192)
    assert str(error.value) == (
        "the device KV cache (--kv-cache-gb, EngineConfig.kv_cache_bytes) holds 128 KV blocks of "
        "2,949,120 bytes, but one request of the model's 8,192-token context and vLLM's null "
        "block needs 129 (0.381 GB): give at least that, or a shorter --max-model-len"
    )
    minimum = EngineConfig(kv_cache_bytes=381_000_000, engine="vllm")  # 129 blocks
    check_capacity(ClusterConfig(), minimum, SMOLLM2, 8192)

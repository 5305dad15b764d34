"""The vLLM DE marks an agent session's hit blocks retained in its store when the request is
assigned (both sides' blocks), as ours does; driven without vLLM (a fake engine, a memory
store with a fake clock), like ``test_prefill_held.py``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dualpath.engine.buffers import KVBuffer
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import MemoryKVStore
from dualpath.vllm.decode import VllmDecodeRole
from tests.vllm.test_prefill_held import FINGERPRINT, LAYOUT, PROMPT, _assignment, _Engine, _host

OTHER_KEYS = block_keys(list(range(100, 108)), 4, FINGERPRINT)  # two blocks of another prompt


@pytest.mark.parametrize(("session_retention_s", "is_kept"), [(10.0, True), (0.0, False)])
def test_a_session_requests_hit_blocks_outlive_capacity_pressure(
    session_retention_s: float, is_kept: bool
) -> None:
    store = MemoryKVStore(
        LAYOUT, FINGERPRINT, capacity_bytes=4 * LAYOUT.full_block_bytes, clock=lambda: 5.0
    )
    prompt_keys = block_keys(PROMPT[:12], 4, FINGERPRINT)
    block = np.full(LAYOUT.full_block_shape, 3, dtype=np.uint8)
    for key in prompt_keys:
        store.write(key, block)
    role = VllmDecodeRole(
        _Engine(),
        _host(store),
        KVBuffer(LAYOUT, 8 * LAYOUT.full_block_bytes),
        wake=lambda: None,
        eos_token_ids=(),
        num_io_threads=1,
    )
    try:
        assignment = _assignment(is_prefill_held_sent=False)  # hit: block 0 PE, 1-2 DE side
        role.add(replace(assignment, session_retention_s=session_retention_s))
        assert role.requests[7].reads.result() == 2  # its side's blocks 1 and 2, read
        for key in OTHER_KEYS:  # the second write overflows: the least recently used goes
            store.write(key, block)
        # Block 0 (the PE side's, read by no one here) is the least recently used.
        assert store.contains(prompt_keys[0]) is is_kept
        assert store.contains(OTHER_KEYS[0]) is not is_kept
    finally:
        role.close(flush_timeout_s=1.0)

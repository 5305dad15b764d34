"""The scheduler's store lookups (``PromptHits``): a store that hangs (a distributed file
system whose server is cut off) holds the caller no longer than the lookup timeout, and every
lookup is a miss until the hung one returns; then hits are found again."""

from __future__ import annotations

import threading

import numpy as np

from dualpath.cluster.hits import PromptHits
from dualpath.kv.store import MemoryKVStore
from tests.cluster.scripted import IDENTITY, LAYOUT

HANG_GUARD_S = 60.0


class HangingStore(MemoryKVStore):
    """Lookups block while ``hang`` is set, until ``release`` is."""

    def __init__(self) -> None:
        super().__init__(LAYOUT, IDENTITY.fingerprint)
        self.hang = threading.Event()
        self.release = threading.Event()

    def lookup(self, keys):
        if self.hang.is_set():
            assert self.release.wait(HANG_GUARD_S), "the test never released the store"
        return super().lookup(keys)


def test_a_hung_store_is_a_miss_until_it_answers_again() -> None:
    store = HangingStore()
    hits = PromptHits(store, IDENTITY, lookup_timeout_s=0.05)
    prompt = np.arange(100, 113, dtype=np.int32).tolist()  # 3 whole blocks of 4, and a token
    keys = hits.block_keys(prompt)
    block = np.zeros(LAYOUT.full_block_bytes, np.uint8)
    for key in keys:
        store.write(key, block)
    assert hits.num_cached_tokens(keys) == 12

    store.hang.set()
    assert hits.num_cached_tokens(keys) == 0  # timed out
    assert hits.num_more_blocks(keys) == 0  # at once: the hung lookup has not returned
    hung = hits._hung
    assert hung is not None and not hung.done()
    store.hang.clear()
    store.release.set()
    hung.result(timeout=HANG_GUARD_S)
    assert hits.num_cached_tokens(keys) == 12
    assert hits.num_more_blocks(keys[1:]) == 2

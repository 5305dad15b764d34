"""KVStoreIO.flush with a deadline: a store that hangs cannot hold a stopping engine."""

from __future__ import annotations

import threading
import time

import numpy as np

from dualpath.engine.kv_io import KVStoreIO
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import MemoryKVStore

LAYOUT = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=8)
FINGERPRINT = "00" * 16


class HangingStore(MemoryKVStore):
    """Writes block until ``release`` is set, as on a network mount that lost its server."""

    def __init__(self) -> None:
        super().__init__(LAYOUT, FINGERPRINT)
        self.release = threading.Event()

    def write(self, key, full_block) -> bool:
        assert self.release.wait(60), "test bug: the store was never released"
        return super().write(key, full_block)


class HostCache:
    """The one method of PagedKVCache that persisting uses."""

    layout = LAYOUT

    def copy_full_block(self, block_id: int) -> np.ndarray:
        return np.full(LAYOUT.full_block_shape, block_id, dtype=np.uint8)


def test_flush_with_a_deadline_returns_the_unfinished_writes_then_completes_later() -> None:
    store = HangingStore()
    io = KVStoreIO(store, HostCache(), num_io_threads=1, max_pending_write_bytes=1 << 20)
    for block_id in range(3):
        io.persist(f"{block_id:032x}", block_id)
    try:
        start_s = time.monotonic()
        # No write can finish while the store hangs: flush gives up at its deadline, having
        # waited all of it. (How soon after the deadline it returns is the machine's business.)
        assert io.flush(timeout_s=0.2) == 3
        assert time.monotonic() - start_s >= 0.2
        assert store.stats().writes == 0
    finally:
        store.release.set()
    assert io.flush() == 0
    assert store.stats().writes == 3
    io.close()

"""KVStoreIO.num_unfinished_writes: the Full Blocks a DE has queued for the store and not
written yet, its share of its node's write_q (the scheduler's read-side choice counts them)."""

from __future__ import annotations

import threading
import time

import numpy as np

from dualpath.engine.kv_io import KVStoreIO
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import MemoryKVStore
from dualpath.transfer.links import LinkKind, LinkSpec, TrafficClass
from dualpath.transfer.traffic import TrafficManager

LAYOUT = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=8)
FINGERPRINT = "00" * 16


class GatedStore(MemoryKVStore):
    """Each write waits for its own permit, so a test decides when writes end."""

    def __init__(self) -> None:
        super().__init__(LAYOUT, FINGERPRINT)
        self.permits = threading.Semaphore(0)

    def write(self, key, full_block) -> bool:
        assert self.permits.acquire(timeout=60), "test bug: a write was never released"
        return super().write(key, full_block)


class HostCache:
    """The one method of PagedKVCache that persisting uses."""

    layout = LAYOUT

    def copy_full_block(self, block_id: int) -> np.ndarray:
        return np.full(LAYOUT.full_block_shape, block_id, dtype=np.uint8)


def test_unfinished_writes_count_until_each_is_written_not_until_it_is_reaped() -> None:
    store = GatedStore()
    io = KVStoreIO(store, HostCache(), num_io_threads=1, max_pending_write_bytes=1 << 20)
    try:
        for block_id in range(3):
            io.persist(f"{block_id:032x}", block_id)
        assert io.num_unfinished_writes == 3
        store.permits.release(2)
        deadline_s = time.monotonic() + 30.0  # ends when they are written: bounds a hang only
        while io.num_unfinished_writes > 1 and time.monotonic() < deadline_s:
            time.sleep(0.005)
        # Two are written (and no longer load the SNIC), though nothing has reaped them yet.
        assert io.num_unfinished_writes == 1 and store.stats().writes == 2
        store.permits.release(1)
        assert io.flush(timeout_s=30.0) == 0
        assert io.num_unfinished_writes == 0
    finally:
        store.permits.release(10)
        io.close()


def test_a_block_the_store_already_holds_moves_nothing_over_the_snic() -> None:
    """A persisted block another engine or turn stored first is skipped by the store, and our
    SNIC accounting must not count it: on kernel-shaped links the NIC counters would not."""
    traffic = TrafficManager([LinkSpec("node0.snic", LinkKind.SNIC)])

    def mover(link: str, num_bytes: int, do_move):
        return traffic.move("node0.snic", TrafficClass.KV, num_bytes, do_move, timeout_s=30.0)

    store = MemoryKVStore(LAYOUT, FINGERPRINT)
    io = KVStoreIO(
        store, HostCache(), num_io_threads=1, max_pending_write_bytes=1 << 20, mover=mover
    )
    try:
        for block_id in (1, 2, 1):  # the second write of block 1 finds it stored
            io.persist(f"{block_id:032x}", block_id)
        assert io.flush(timeout_s=30.0) == 0
    finally:
        io.close()
    assert (store.stats().writes, store.stats().duplicate_writes) == (2, 1)
    (link,) = traffic.stats().links
    assert link.class_to_moved_bytes[TrafficClass.KV] == 2 * LAYOUT.full_block_bytes

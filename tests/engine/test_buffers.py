from __future__ import annotations

import numpy as np
import pytest

from dualpath.engine.buffers import KVBuffer
from dualpath.kv.layout import KVLayout
from dualpath.transfer.transport import SlotLayout

LAYOUT = KVLayout(num_layers=3, block_size_tokens=4, bytes_per_token_per_layer=8)


def test_back_pressure_then_release() -> None:
    buffer = KVBuffer(LAYOUT, capacity_bytes=5 * LAYOUT.full_block_bytes + 7)
    assert buffer.num_slots == 5
    first = buffer.allocate(3)
    assert first == [0, 1, 2]
    assert buffer.allocate(3) is None  # full for now: the caller waits
    assert buffer.num_used_bytes == 3 * LAYOUT.full_block_bytes
    buffer.free(first)
    assert buffer.allocate(3) == [3, 4, 2]
    with pytest.raises(ValueError, match="needs 6 buffer slots but the buffer has 5"):
        buffer.allocate(6)  # could never fit: refused, not queued forever


def test_the_transports_offsets_address_the_layer_block_views() -> None:
    """A peer writes ``(slot, layer)`` at ``SlotLayout.full_blocks``' offset: the same bytes
    the engine reads through ``layer_block``."""
    buffer = KVBuffer(LAYOUT, capacity_bytes=4 * LAYOUT.full_block_bytes)
    flat = buffer.array.reshape(-1)
    slots = SlotLayout.full_blocks(LAYOUT)
    for slot in range(4):
        for layer in range(3):
            view = buffer.layer_block(slot, layer)
            offset = slots.offset_bytes(slot, layer)
            view[...] = slot * 3 + layer + 1
            assert np.all(flat[offset : offset + LAYOUT.layer_block_bytes] == slot * 3 + layer + 1)
            assert np.shares_memory(view, buffer.full_block(slot))


def test_a_buffer_must_hold_one_block() -> None:
    with pytest.raises(ValueError, match="holds no Full Block"):
        KVBuffer(LAYOUT, capacity_bytes=LAYOUT.full_block_bytes - 1)


def test_store_reader_counts_queued_blocks_until_read_or_given_up() -> None:
    from dualpath.engine.buffers import StoreReader
    from dualpath.kv.hashing import block_keys
    from dualpath.kv.store import MemoryKVStore

    fingerprint = "0" * 32
    store = MemoryKVStore(LAYOUT, fingerprint)
    keys = block_keys(list(range(20)), LAYOUT.block_size_tokens, fingerprint)  # 5 blocks
    for key in keys[:3]:  # blocks 3 and 4 are missing
        store.write(key, np.full(LAYOUT.full_block_shape, 7, dtype=np.uint8))
    buffer = KVBuffer(LAYOUT, capacity_bytes=5 * LAYOUT.full_block_bytes)
    done_calls = []
    told = __import__("threading").Event()
    reader = StoreReader(
        store,
        buffer,
        lambda link, n, move: move(),
        num_threads=1,
        name="t",
        on_done=lambda: (done_calls.append(reader.num_queued_blocks), told.set()),
    )
    gate = __import__("threading").Event()
    blocker = reader._pool.submit(gate.wait)  # hold the pool so the count is observable
    future = reader.submit(keys, [0, 1, 2, 3, 4], "test")
    assert reader.num_queued_blocks == 5
    gate.set()
    blocker.result()
    assert future.result() == 3  # stops at the first missing block
    assert told.wait(10.0)
    assert done_calls == [0]  # told once, after the count was settled
    assert reader.num_queued_blocks == 0
    assert reader.num_read_bytes == 3 * LAYOUT.full_block_bytes
    assert np.all(buffer.full_block(2) == 7)
    reader.close()


def test_requests_get_their_slots_in_arrival_order_and_none_overtakes() -> None:
    from dualpath.engine.buffers import SlotQueue

    buffer = KVBuffer(LAYOUT, capacity_bytes=5 * LAYOUT.full_block_bytes)
    queue: SlotQueue[str] = SlotQueue(buffer)
    started: dict[str, list[int]] = {}

    def add(name: str, num_slots: int) -> None:
        queue.add(name, num_slots, lambda slots: started.__setitem__(name, slots))

    add("a", 3)
    add("b", 3)  # does not fit: waits
    add("c", 1)  # would fit, but must not overtake b
    assert set(started) == {"a"} and queue.num_waiting_slots == 4
    assert queue.remove("c") and not queue.remove("c") and queue.num_waiting_slots == 3
    add("d", 2)
    buffer.free(started["a"])
    queue.start_waiting()  # b, then d, in order
    assert list(started) == ["a", "b", "d"] and len(started["b"]) == 3 and len(started["d"]) == 2
    assert queue.num_waiting_slots == 0

"""The KV courier's layer logic against fake pages and a fake DE buffer: no engine, no model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from dualpath.engine.buffers import KVBuffer
from dualpath.engine.courier import (
    KVCourier,
    KVTransfer,
    LoadSource,
    StepTransfer,
    block_ranges,
    plan_prefill,
)
from dualpath.errors import TransferTimeout
from dualpath.kv.layout import KVLayout
from dualpath.transfer.traffic import direct_move

LAYOUT = KVLayout(num_layers=4, block_size_tokens=4, bytes_per_token_per_layer=2)
BS = LAYOUT.block_size_tokens


class FakePages:
    """Pages as one array per layer ``[num_blocks, bs, bpt]``, recording every call."""

    layout = LAYOUT

    def __init__(self, num_blocks: int, *, has_views: bool = True) -> None:
        self.array = np.zeros((LAYOUT.num_layers, num_blocks, *LAYOUT.layer_block_shape), np.uint8)
        self.has_views = has_views
        self.calls: list[tuple] = []

    def write_layer(self, layer, block_ids, blocks, first=0, num=None) -> None:  # noqa: ANN001
        end = BS if num is None else first + num
        self.calls.append(("write", layer, tuple(block_ids), first, end))
        for block_id, block in zip(block_ids, blocks, strict=True):
            self.array[layer, block_id, first:end] = block[first:end]

    def read_layer(self, layer: int, block_ids: Sequence[int], out: np.ndarray) -> None:
        self.calls.append(("read", layer, tuple(block_ids)))
        out[...] = self.array[layer, list(block_ids)]

    def layer_view(self, layer: int, block_ids: Sequence[int]) -> np.ndarray | None:
        ids = list(block_ids)
        if not self.has_views or ids != list(range(ids[0], ids[0] + len(ids))):
            return None
        return self.array[layer, ids[0] : ids[-1] + 1]

    def fence(self, layer: int) -> None:
        self.calls.append(("fence", layer))


class FakeRemote:
    """A DE's buffer: ``array[slot, layer]``; fails a chosen op at a chosen layer."""

    def __init__(self, num_slots: int, *, fail: tuple[str, int] | None = None) -> None:
        self.array = np.zeros((num_slots, *LAYOUT.full_block_shape), np.uint8)
        self.fail = fail
        self.reads: list[tuple[int, tuple[int, ...]]] = []
        self.writes: list[tuple[int, tuple[int, ...]]] = []
        self.num_flushes = 0

    def _check(self, op: str, layer: int) -> None:
        if self.fail is not None and self.fail == (op, layer):
            raise TransferTimeout(f"{op} of layer {layer} timed out")

    def read_layer(self, slots, layer, out) -> None:  # noqa: ANN001
        self._check("read", layer)
        self.reads.append((layer, tuple(slots)))
        out[...] = self.array[list(slots), layer]

    def write_layer(self, slots, layer, data) -> None:  # noqa: ANN001
        self._check("write", layer)
        self.writes.append((layer, tuple(slots)))
        self.array[list(slots), layer] = data

    def flush(self) -> None:
        self.num_flushes += 1


def filled_buffer(num_slots: int, seed: int) -> KVBuffer:
    buffer = KVBuffer(LAYOUT, num_slots * LAYOUT.full_block_bytes)
    buffer.array[...] = np.random.default_rng(seed).integers(0, 256, buffer.array.shape)
    return buffer


def courier(**kwargs) -> KVCourier:  # noqa: ANN003
    return KVCourier(direct_move, num_layers=LAYOUT.num_layers, block_size=BS, **kwargs)


def run_step(courier: KVCourier, steps: list[StepTransfer], pages: FakePages) -> None:
    """A forward's calls: wait for each layer, 'compute' it, save it."""
    courier.begin_step(steps, pages)
    for layer in range(LAYOUT.num_layers):
        courier.wait_for_layer(layer)
        courier.save_layer(layer)
    courier.end_step()


@pytest.mark.parametrize(
    ("num_pe", "num_pe_read", "num_de_read", "cached", "num_hit", "held", "pulled"),
    [
        (3, 3, 0, 0, 3, range(3, 3), None),  # PE read path
        (0, 0, 3, 0, 3, range(0, 3), (0, 3)),  # DE read path
        (2, 2, 2, 0, 4, range(2, 4), (2, 4)),  # split
        (2, 1, 2, 0, 1, range(0), None),  # a PE-side block unreadable: the hit ends there
        (2, 2, 1, 0, 3, range(2, 3), (2, 3)),  # a DE-side block unreadable
        (1, 0, 3, 3, 4, range(3, 4), (3, 4)),  # the engine holds more than the PE side
    ],
)
def test_a_prefill_plan_reads_each_hit_block_from_one_side(
    num_pe: int,
    num_pe_read: int,
    num_de_read: int,
    cached: int,
    num_hit: int,
    held: range,
    pulled: tuple[int, int] | None,
) -> None:
    remote = FakeRemote(8)
    transfer, got_hit = plan_prefill(
        7,
        buffer=filled_buffer(4, 0),
        pe_slots=[3, 2, 1][:num_pe],
        num_prefill_side_blocks=num_pe,
        num_pe_read=num_pe_read,
        remote=remote,
        de_slots=[10, 11, 12, 13, 14, 15],
        num_de_read=num_de_read,
        num_prompt_tokens=5 * BS + 1,
        block_size=BS,
        num_engine_cached=cached,
    )
    assert got_hit == num_hit
    assert transfer.send is not None and transfer.send.held == held
    load = transfer.load
    assert load is not None and load.num_tokens == num_hit * BS and load.first_block == cached
    if pulled is None:
        assert load.remote is None
    else:
        assert load.remote is not None
        assert (load.remote.first_block, load.remote.first_block + len(load.remote.slots)) == pulled
        assert list(load.remote.slots) == [10, 11, 12, 13, 14, 15][pulled[0] : pulled[1]]


def test_block_ranges_cover_a_token_range() -> None:
    assert block_ranges(2, 9, 4) == [(0, 2, 2), (1, 0, 4), (2, 0, 3)]
    assert block_ranges(8, 0, 4) == []


def split_request(remote: FakeRemote, buffer: KVBuffer, request_id: int = 0):  # noqa: ANN201
    """A 5.5-block prompt: blocks 0-1 in the PE buffer (slots 1, 0), 2-3 in the DE's."""
    transfer, num_hit = plan_prefill(
        request_id,
        buffer=buffer,
        pe_slots=[1, 0],
        num_prefill_side_blocks=2,
        num_pe_read=2,
        remote=remote,
        de_slots=[5, 4, 3, 2, 1, 0],
        num_de_read=2,
        num_prompt_tokens=5 * BS + 2,
        block_size=BS,
    )
    assert num_hit == 4
    return transfer


@pytest.mark.parametrize("is_layerwise", [True, False])
@pytest.mark.parametrize("has_views", [True, False])
def test_a_split_prefill_loads_each_side_and_sends_the_de_what_it_lacks(
    is_layerwise: bool, has_views: bool
) -> None:
    buffer = filled_buffer(2, seed=1)
    remote = FakeRemote(6)
    remote.array[[3, 2]] = np.random.default_rng(2).integers(0, 256, (2, *LAYOUT.full_block_shape))
    transfer = split_request(remote, buffer)
    pages = FakePages(6, has_views=has_views)
    step = StepTransfer(transfer, range(6), load_num=4 * BS, num_reached=5 * BS + 2)
    # Computed tokens' KV, as a forward would write it (the courier never writes those).
    computed = np.random.default_rng(3).integers(0, 256, (LAYOUT.num_layers, 2, BS, 2))
    computed[:, 1, 2:] = 0
    pages.array[:, 4:6] = computed
    mover = courier(is_layerwise=is_layerwise)
    run_step(mover, [step], pages)

    for layer in range(LAYOUT.num_layers):
        assert np.array_equal(pages.array[layer, 0], buffer.array[1, layer])
        assert np.array_equal(pages.array[layer, 1], buffer.array[0, layer])
        assert np.array_equal(pages.array[layer, 2], remote.array[3, layer])
        assert np.array_equal(pages.array[layer, 3], remote.array[2, layer])
        # The DE gets the PE side's hits and the computed blocks, never its own reads back.
        assert np.array_equal(remote.array[5, layer], buffer.array[1, layer])
        assert np.array_equal(remote.array[4, layer], buffer.array[0, layer])
        assert np.array_equal(remote.array[[1, 0], layer], computed[layer])
    assert {slots for _, slots in remote.writes} == {(5, 4, 1, 0)}
    assert remote.num_flushes == 1 and transfer.num_sent_blocks == 6
    assert transfer.transfer_error is None and transfer.num_loaded_tokens == 4 * BS
    if has_views:  # the pulled run of whole blocks lands in the pages: no write of it
        assert not [c for c in pages.calls if c[0] == "write" and c[2] in ((2,), (3,))]


def test_each_layer_is_fenced_before_the_forward_reads_it_and_loads_stay_one_ahead() -> None:
    buffer = filled_buffer(2, seed=1)
    remote = FakeRemote(6)
    step = StepTransfer(split_request(remote, buffer), range(6), load_num=4 * BS, num_reached=4)
    pages = FakePages(6)
    mover = courier()
    mover.begin_step([step], pages)
    for layer in range(LAYOUT.num_layers):
        mover.wait_for_layer(layer)
        assert ("fence", layer) in pages.calls
        loaded = {c[1] for c in pages.calls if c[0] == "write"} | {r[0] for r in remote.reads}
        assert max(loaded) <= layer + 1
    mover.end_step()


def test_chunks_send_each_block_once() -> None:
    buffer = filled_buffer(2, seed=1)
    remote = FakeRemote(6)
    transfer = split_request(remote, buffer)
    pages = FakePages(6)
    mover = courier()
    # Chunk 1 computes tokens 16..19 (block 4), chunk 2 the rest (block 5, partial).
    run_step(mover, [StepTransfer(transfer, range(6), load_num=16, num_reached=20)], pages)
    assert remote.num_flushes == 0 and transfer.num_sent_blocks == 5
    first = {slots for _, slots in remote.writes}
    run_step(mover, [StepTransfer(transfer, range(6), load_num=16, num_reached=22)], pages)
    assert first == {(5, 4, 1)} and {slots for _, slots in remote.writes} == {(5, 4, 1), (0,)}
    assert remote.num_flushes == 1 and transfer.num_sent_blocks == 6


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_transfer_error_fails_the_requests_it_touches_not_the_step(op: str) -> None:
    buffer = filled_buffer(4, seed=1)
    dead = FakeRemote(6, fail=(op, 1))
    alive = FakeRemote(6)
    alive.array[[3, 2]] = 7
    failing, ok = split_request(dead, buffer, 0), split_request(alive, buffer, 1)
    pages = FakePages(12)
    steps = [
        StepTransfer(failing, range(6), load_num=16, num_reached=22),
        StepTransfer(ok, range(6, 12), load_num=16, num_reached=22),
    ]
    mover = courier()
    run_step(mover, steps, pages)
    assert mover.failed(steps) == [failing]
    assert isinstance(failing.transfer_error, TransferTimeout)
    assert (
        ok.transfer_error is None and alive.num_flushes == 1 and (pages.array[:, 8:10] == 7).all()
    )
    # Nothing more moves for the failed request after its error (but the pull of the layer
    # after it, started while that layer computed).
    assert not [layer for layer, _ in dead.writes if layer > 1]
    assert not [layer for layer, _ in dead.reads if layer > 2]
    assert dead.num_flushes == 0
    # Its DE-side blocks not pulled are reported (vLLM must not keep them).
    failed_blocks = mover.pop_failed_blocks()
    assert failed_blocks == {2, 3} and not mover.pop_failed_blocks()


def test_a_decode_engine_loads_a_prompt_with_a_partial_block_and_persists_what_fills() -> None:
    buffer = filled_buffer(3, seed=4)
    loaded: list[bool] = []
    transfer = KVTransfer(
        9, load=LoadSource(buffer, [2, 0, 1], 2 * BS + 1), on_loaded=lambda: loaded.append(True)
    )
    persisted = []

    class Store:
        def persist(self, key, block_id) -> None:  # noqa: ANN001
            persisted.append((key, block_id))

    pages = FakePages(8)
    pages.array[:, 6, 1:] = 99  # what the page held past the prompt is kept
    mover = courier(store=Store())
    step = StepTransfer(transfer, [3, 7, 6], load_num=2 * BS + 1, persist=(("k", 3), ("k2", 7)))
    mover.run_loads([step], pages)
    for layer in range(LAYOUT.num_layers):
        assert np.array_equal(pages.array[layer, 3], buffer.array[2, layer])
        assert np.array_equal(pages.array[layer, 7], buffer.array[0, layer])
        assert np.array_equal(pages.array[layer, 6, :1], buffer.array[1, layer, :1])
        assert (pages.array[layer, 6, 1:] == 99).all()
    assert loaded == [True] and persisted == [("k", 3), ("k2", 7)]
    assert transfer.num_loaded_tokens == 2 * BS + 1

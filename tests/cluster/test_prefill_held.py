"""The scheduler tells both engines of a placement, in the one Assignment they share, whether
the DE's reads wait for the PE's ``PrefillHeld``: only where the PE said in its EngineInfo that
it reports what its engine holds, and the DE has hit blocks of its side to read."""

from __future__ import annotations

import pytest

from dualpath.cluster.coordinator import Coordinator
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import MemoryKVStore
from dualpath.protocol import DECODE, PREFILL, Assignment, EngineInfo, EngineReport
from dualpath.types import SamplingParams
from tests.cluster.scripted import IDENTITY, LAYOUT, TOKEN, FakeClock, Inbox, settle

PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks of 4


class _Engine(Inbox):
    def __init__(self, coordinator: Coordinator, engine_id: int, role: str, reports: bool):
        super().__init__(coordinator, f"engine-{engine_id}")
        self.engine_id = engine_id
        blocks = 64 if role == DECODE else 0
        info = EngineInfo(
            engine_id, role, engine_id, "fake", b"", b"", 16, blocks, reports_prefill_held=reports
        )
        self.client.send(info)

    def report(self) -> None:
        self.client.send(EngineReport(self.engine_id, 0, 0, 64, 0, {}, 0))


def _assignment(*, reports: bool, num_hit_blocks: int) -> Assignment:
    """The Assignment of one request placed on a 1P1D cluster whose DE reads every hit."""
    store = MemoryKVStore(LAYOUT, IDENTITY.fingerprint)
    for key in block_keys(PROMPT[: 4 * num_hit_blocks], 4, IDENTITY.fingerprint):
        store.write(key, bytes(LAYOUT.full_block_bytes))
    coordinator = Coordinator(
        ClusterConfig(num_prefill_nodes=1, num_decode_nodes=1, heartbeat_timeout_s=5.0),
        SchedulerConfig(block_size_tokens=4, beta_tokens=10_000, read_path="de"),
        IDENTITY,
        store,
        TOKEN,
        storage_read_tokens_per_s=1000.0,
        clock=FakeClock(),
    )
    engines = [
        _Engine(coordinator, 0, PREFILL, reports),
        _Engine(coordinator, 1, DECODE, False),
    ]
    try:
        settle(coordinator, engines)
        coordinator.submit(PROMPT, SamplingParams(max_tokens=2))
        for engine in engines:
            engine.report()
        settle(coordinator, engines)
        (pe_view,) = engines[0].receive(Assignment)
        (de_view,) = engines[1].receive(Assignment)
    finally:
        coordinator.close()
        for engine in engines:
            engine.client.close()
    assert pe_view == de_view  # both decide from the same bytes
    assert pe_view.num_decode_side_blocks == num_hit_blocks
    return pe_view


@pytest.mark.parametrize("reports", [True, False])
def test_the_de_waits_only_for_a_pe_that_reports(reports: bool) -> None:
    assert _assignment(reports=reports, num_hit_blocks=2).is_prefill_held_sent is reports


def test_nothing_is_awaited_without_de_side_hits() -> None:
    assert not _assignment(reports=True, num_hit_blocks=0).is_prefill_held_sent

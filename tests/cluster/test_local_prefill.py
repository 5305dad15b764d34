"""Conditional disaggregation (``ClusterConfig.local_prefill_tokens``): a request the store
misses by at most that many tokens goes to its DE alone, every hit block on the DE side, where
the DE said in its EngineInfo that it prefills (``prefills_locally``); any other goes to both
engines as before. The DE's own PrefillDone streams the first token and is not relayed back to
it."""

from __future__ import annotations

import pytest

from dualpath.cluster.coordinator import Coordinator
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import MemoryKVStore
from dualpath.protocol import DECODE, PREFILL, Assignment, EngineInfo, EngineReport, PrefillDone
from dualpath.types import SamplingParams
from tests.cluster.scripted import IDENTITY, LAYOUT, TOKEN, FakeClock, Inbox, settle

PROMPT = list(range(1, 14))  # 13 tokens: 3 full blocks of 4, the store holding the first 2
NUM_HIT_BLOCKS = 2
NUM_MISSED = len(PROMPT) - 4 * NUM_HIT_BLOCKS  # 5


class _Engine(Inbox):
    def __init__(self, coordinator: Coordinator, engine_id: int, role: str, local: bool):
        super().__init__(coordinator, f"engine-{engine_id}")
        self.engine_id = engine_id
        blocks = 64 if role == DECODE else 0
        self.client.send(
            EngineInfo(engine_id, role, engine_id, "fake", b"", b"", 16, blocks,
                       prefills_locally=local)
        )  # fmt: skip

    def report(self) -> None:
        self.client.send(EngineReport(self.engine_id, 0, 0, 64, 0, {}, 0))


def _place(local_prefill_tokens: int, *, de_prefills: bool) -> tuple[list, list, list]:
    """One request on a 1P1D cluster, then, if its DE got it alone, the DE's PrefillDone: what
    the PE and the DE received (Assignments, then PrefillDones), and the tokens streamed."""
    store = MemoryKVStore(LAYOUT, IDENTITY.fingerprint)
    for key in block_keys(PROMPT[: 4 * NUM_HIT_BLOCKS], 4, IDENTITY.fingerprint):
        store.write(key, bytes(LAYOUT.full_block_bytes))
    coordinator = Coordinator(
        ClusterConfig(
            num_prefill_nodes=1,
            num_decode_nodes=1,
            heartbeat_timeout_s=5.0,
            local_prefill_tokens=local_prefill_tokens,
        ),
        SchedulerConfig(block_size_tokens=4, beta_tokens=10_000, read_path="pe"),
        IDENTITY,
        store,
        TOKEN,
        storage_read_tokens_per_s=1000.0,
        clock=FakeClock(),
    )
    pe, de = _Engine(coordinator, 0, PREFILL, False), _Engine(coordinator, 1, DECODE, de_prefills)
    try:
        settle(coordinator, [pe, de])
        coordinator.submit(PROMPT, SamplingParams(max_tokens=2))
        for engine in (pe, de):
            engine.report()
        settle(coordinator, [pe, de])
        received = [pe.receive(Assignment), de.receive(Assignment)]
        if received[1] and received[1][0].is_local_prefill:
            de.client.send(PrefillDone(received[1][0].request_id, 42, None, 8))
            settle(coordinator, [pe, de])
        received[0] += pe.receive(PrefillDone)
        received[1] += de.receive(PrefillDone)
        tokens = [event.token_ids for event in coordinator.drain_events() if event.token_ids]
    finally:
        coordinator.close()
        for engine in (pe, de):
            engine.client.close()
    return received[0], received[1], tokens


@pytest.mark.parametrize("local_prefill_tokens", [NUM_MISSED, 100])
def test_a_short_append_goes_to_its_de_alone(local_prefill_tokens: int) -> None:
    to_pe, to_de, tokens = _place(local_prefill_tokens, de_prefills=True)
    assert to_pe == []
    (assignment,) = to_de  # and no PrefillDone relayed back to it
    assert assignment.is_local_prefill and assignment.prefill_engine_id == 1
    assert (assignment.num_prefill_side_blocks, assignment.num_decode_side_blocks) == (0, 2)
    assert not assignment.is_prefill_held_sent
    assert tokens == [(42,)]


@pytest.mark.parametrize(
    ("local_prefill_tokens", "de_prefills"),
    [(NUM_MISSED - 1, True), (0, True), (100, False)],
)
def test_a_longer_one_or_a_de_that_cannot_goes_through_the_pe(
    local_prefill_tokens: int, de_prefills: bool
) -> None:
    to_pe, to_de, _ = _place(local_prefill_tokens, de_prefills=de_prefills)
    assert len(to_pe) == len(to_de) == 1 and to_pe == to_de
    (assignment,) = to_pe
    assert not assignment.is_local_prefill
    assert (assignment.prefill_engine_id, assignment.decode_engine_id) == (0, 1)
    assert assignment.num_prefill_side_blocks == NUM_HIT_BLOCKS  # read_path "pe"

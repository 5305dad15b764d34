"""The scheduler process against scripted engines speaking the real protocol on loopback."""

from __future__ import annotations

import pytest

from dualpath.cluster.coordinator import Coordinator
from dualpath.cluster.messages import (
    DECODE,
    PREFILL,
    Assignment,
    CancelRequest,
    DecodeReady,
    EngineInfo,
    EngineReport,
    Heartbeat,
    KVPersisted,
    PeerTable,
    PrefillDone,
    TokenUpdate,
)
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.control.channel import ControlClient
from dualpath.kv.hashing import block_keys
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import MemoryKVStore
from dualpath.model.identity import KVIdentity
from dualpath.types import SamplingParams
from tests.cluster.scripted import Inbox, pump, spin

LAYOUT = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=8)
IDENTITY = KVIdentity("0" * 32, LAYOUT, "float32")
TOKEN = "secret"


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class ScriptedEngine(Inbox):
    """A real control client that plays an engine's part by hand."""

    def __init__(self, coordinator: Coordinator, engine_id: int, role: str, node_id: int) -> None:
        super().__init__()
        self.engine_id = engine_id
        self.client = ControlClient(coordinator.endpoint, f"engine-{engine_id}", TOKEN)
        pump(coordinator, lambda: self.client.connect(timeout_s=2.0))
        self.client.send(
            EngineInfo(engine_id, role, node_id, "fake", b"", b"", 16, 64 if role == DECODE else 0)
        )

    def report(self, num_tokens: int = 0, free_blocks: int = 64, read_queue: int = 0) -> None:
        self.client.send(
            EngineReport(self.engine_id, 0, num_tokens, free_blocks, read_queue, {"snic": 1}, 0)
        )


@pytest.fixture
def cluster():
    clock = FakeClock()
    store = MemoryKVStore(LAYOUT, IDENTITY.fingerprint)
    coordinator = Coordinator(
        ClusterConfig(num_prefill_nodes=1, num_decode_nodes=2, heartbeat_timeout_s=5.0),
        SchedulerConfig(block_size_tokens=4, beta_tokens=10_000),
        IDENTITY,
        store,
        TOKEN,
        storage_read_tokens_per_s=1000.0,
        clock=clock,
    )
    engines = [
        ScriptedEngine(coordinator, 0, PREFILL, 0),
        ScriptedEngine(coordinator, 1, DECODE, 1),
        ScriptedEngine(coordinator, 2, DECODE, 2),
    ]
    spin(coordinator)
    yield coordinator, engines, clock, store
    coordinator.close()
    for engine in engines:
        engine.client.close()


def _place(coordinator, engines, prompt, params, de_loads=(0, 0)):
    request_id = coordinator.submit(prompt, params)
    spin(coordinator, 2)
    engines[0].report()
    spin(coordinator, 5)
    engines[1].report(num_tokens=de_loads[0])
    engines[2].report(num_tokens=de_loads[1])
    spin(coordinator, 5)
    return request_id


def test_request_is_placed_relayed_and_finished(cluster) -> None:
    coordinator, engines, _, store = cluster
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4
    for key in block_keys(prompt[:8], 4, IDENTITY.fingerprint):
        store.write(key, bytes(LAYOUT.full_block_bytes))
    assert coordinator.is_ready()
    assert len(engines[1].receive(PeerTable)[-1].engines) == 3
    request_id = _place(coordinator, engines, prompt, SamplingParams(max_tokens=3), (50, 0))

    (pe_view,) = engines[0].receive(Assignment)
    (de_view,) = engines[2].receive(Assignment)  # the less loaded DE
    assert engines[1].receive(Assignment) == []
    assert pe_view == de_view
    assert (pe_view.prefill_engine_id, pe_view.decode_engine_id) == (0, 2)
    assert pe_view.num_hit_blocks == 2  # cached prefix: 8 tokens
    assert pe_view.prompt_token_ids.tolist() == prompt

    engines[2].client.send(DecodeReady(request_id, (5, 6, 7, 8), 2))
    spin(coordinator, 5)
    assert engines[0].receive(DecodeReady) == [DecodeReady(request_id, (5, 6, 7, 8), 2)]
    engines[0].client.send(PrefillDone(request_id, 42, None, 8))
    spin(coordinator, 5)
    assert [m.first_token_id for m in engines[2].receive(PrefillDone)] == [42]
    engines[2].client.send(TokenUpdate(request_id, (7, 9), "length", 8))
    spin(coordinator, 5)
    events = coordinator.drain_events()
    assert [(e.token_ids, e.finish_reason, e.num_cached_tokens) for e in events] == [
        ((42,), None, 8),
        ((7, 9), "length", 8),
    ]
    assert coordinator.link_bytes()[0] == {"snic": 1}


def test_a_silent_engine_is_declared_dead_and_its_requests_fail(cluster) -> None:
    coordinator, engines, clock, _ = cluster
    request_id = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    (assignment,) = engines[0].receive(Assignment)
    de = assignment.decode_engine_id
    clock.now_s = 3.0
    for engine in engines:
        if engine.engine_id != de:
            engine.report()
    spin(coordinator, 5)
    clock.now_s = 6.0  # the DE has been silent for 6 s > 5 s
    spin(coordinator, 5)
    (event,) = coordinator.drain_events()
    assert event.request_id == request_id and event.finish_reason == "error"
    assert f"engine {de} (decode) died" in event.error
    assert engines[0].receive(CancelRequest) == [CancelRequest(request_id)]
    assert coordinator.num_live_engines == 2 and not coordinator.is_ready()
    assert len(engines[0].receive(Heartbeat)) >= 1

    # Nothing more is placed on the dead engine.
    _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    (again,) = engines[0].receive(Assignment)
    assert again.decode_engine_id != de


def test_cancel_reaches_both_engines(cluster) -> None:
    coordinator, engines, _, _ = cluster
    request_id = _place(coordinator, engines, list(range(6)), SamplingParams(max_tokens=2))
    (assignment,) = engines[0].receive(Assignment)
    coordinator.cancel(request_id)
    spin(coordinator, 2)
    de = engines[assignment.decode_engine_id]
    assert engines[0].receive(CancelRequest) == [CancelRequest(request_id)]
    assert de.receive(CancelRequest) == [CancelRequest(request_id)]


def _finish_turn(coordinator, engines, prompt, persisting_keys):
    """Place ``prompt`` and finish it on its DE, which reports ``persisting_keys`` unwritten."""
    request_id = _place(coordinator, engines, prompt, SamplingParams(max_tokens=1))
    (assignment,) = engines[0].receive(Assignment)
    de = engines[assignment.decode_engine_id]
    de.receive(Assignment)
    de.client.send(TokenUpdate(request_id, (), "length", 0, None, tuple(persisting_keys)))
    spin(coordinator, 5)
    coordinator.drain_events()
    return request_id, de


def test_a_turn_waits_for_the_blocks_its_last_turn_is_still_writing(cluster) -> None:
    coordinator, engines, clock, store = cluster
    first = list(range(1, 14))  # 3 full blocks
    keys = block_keys(first[:12], 4, IDENTITY.fingerprint)
    store.write(keys[0], bytes(LAYOUT.full_block_bytes))  # block 0 landed; 1 and 2 have not
    first_id, de = _finish_turn(coordinator, engines, first, keys[1:])

    second = first + [20, 21, 22, 23]  # the next turn: 4 whole blocks may hit
    second_id = _place(coordinator, engines, second, SamplingParams(max_tokens=1))
    assert engines[0].receive(Assignment) == []  # waiting, not placed with a 1-block hit
    assert coordinator.persisting.num_waits == 1

    for key in keys[1:]:
        store.write(key, bytes(LAYOUT.full_block_bytes))
    de.client.send(KVPersisted((first_id,)))
    spin(coordinator, 5)
    engines[0].report()
    spin(coordinator, 5)
    for engine in engines[1:]:
        engine.report()
    spin(coordinator, 5)
    (assignment,) = engines[0].receive(Assignment)
    assert assignment.request_id == second_id
    assert assignment.num_hit_blocks == 3


def test_an_unconfirmed_write_is_waited_for_at_most_persist_wait_s(cluster) -> None:
    coordinator, engines, clock, store = cluster
    first = list(range(1, 10))  # 2 full blocks, neither landed
    keys = block_keys(first[:8], 4, IDENTITY.fingerprint)
    _finish_turn(coordinator, engines, first, keys)
    second_id = _place(coordinator, engines, first + [30, 31, 32], SamplingParams(max_tokens=1))
    assert engines[0].receive(Assignment) == []
    clock.now_s += coordinator.cluster.persist_wait_s
    _place(coordinator, engines, [99], SamplingParams(max_tokens=1))  # turns the loop, reports
    placed = {a.request_id: a for a in engines[0].receive(Assignment)}
    assert placed[second_id].num_hit_blocks == 0  # placed with what the store holds
    assert coordinator.persisting.num_expired == 1

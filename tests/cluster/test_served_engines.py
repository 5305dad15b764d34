"""The scheduler with engines that are vLLM servers (``EngineInfo.url``): a placement on them is
handed to the front door (a ``Forward`` event) and its tokens reach the client over HTTP; a
lost placement goes back to the front door; engines that cannot serve beside the others are
refused by name."""

from __future__ import annotations

import pytest

from dualpath.cluster.coordinator import Coordinator
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.kv.store import MemoryKVStore
from dualpath.protocol import (
    DECODE,
    PREFILL,
    Assignment,
    CancelRequest,
    EngineInfo,
    EngineReport,
    Forward,
    PrefillDone,
    RequestFailed,
    Shutdown,
    TokenUpdate,
)
from dualpath.types import SamplingParams
from tests.cluster.scripted import IDENTITY, TOKEN, FakeClock, Inbox, settle

URLS = {0: "http://pe:8000", 1: "http://de1:8000", 2: "http://de2:8000"}


class ServedEngine(Inbox):
    """A scripted engine that says it is a vLLM server at ``url``."""

    def __init__(
        self,
        coordinator: Coordinator,
        engine_id: int,
        role: str,
        *,
        url: str,
        fingerprint: str = IDENTITY.fingerprint,
    ) -> None:
        super().__init__(coordinator, f"engine-{engine_id}")
        self.engine_id = engine_id
        blocks = 64 if role == DECODE else 0
        info = EngineInfo(
            engine_id, role, engine_id, "fake", b"", b"", 16, blocks, url, fingerprint
        )
        self.client.send(info)

    def report(self, num_tokens: int = 0) -> None:
        self.client.send(EngineReport(self.engine_id, 0, num_tokens, 64, 0, {}, 0))


def _coordinator() -> Coordinator:
    return Coordinator(
        ClusterConfig(num_prefill_nodes=1, num_decode_nodes=2, heartbeat_timeout_s=5.0),
        SchedulerConfig(block_size_tokens=4, beta_tokens=10_000),
        IDENTITY,
        MemoryKVStore(IDENTITY.layout, IDENTITY.fingerprint),
        TOKEN,
        storage_read_tokens_per_s=1000.0,
        clock=FakeClock(),
    )


@pytest.fixture
def served():
    coordinator = _coordinator()
    engines = [
        ServedEngine(coordinator, 0, PREFILL, url=URLS[0]),
        ServedEngine(coordinator, 1, DECODE, url=URLS[1]),
        ServedEngine(coordinator, 2, DECODE, url=URLS[2]),
    ]
    settle(coordinator, engines)
    yield coordinator, engines
    coordinator.close()
    for engine in engines:
        engine.client.close()


def _place(coordinator: Coordinator, engines: list[ServedEngine]) -> tuple[int, Forward]:
    client_id = coordinator.submit(list(range(1, 14)), SamplingParams(max_tokens=3))
    settle(coordinator, engines)
    for engine, load in zip(engines, (0, 50, 0), strict=True):
        engine.report(load)
    settle(coordinator, engines)
    (event,) = coordinator.drain_events()
    assert event.forward is not None and event.finish_reason is None and not event.token_ids
    return client_id, event.forward


def test_a_placement_on_vllm_servers_is_forwarded_and_only_its_end_is_an_event(served) -> None:
    coordinator, engines = served
    assert coordinator.snapshot(0.0).engine_urls == URLS
    client_id, forward = _place(coordinator, engines)
    (assignment,) = engines[0].receive(Assignment)
    assert engines[2].receive(Assignment) == [assignment]  # the less loaded DE
    assert forward == Forward(assignment.request_id, 0, 2, URLS[0], URLS[2])

    engines[0].client.send(PrefillDone(forward.request_id, 42, None, 8))
    settle(coordinator, engines)
    assert [m.first_token_id for m in engines[2].receive(PrefillDone)] == [42]
    assert coordinator.drain_events() == []  # the DE's server streams every token itself
    engines[2].client.send(TokenUpdate(forward.request_id, (42, 7, 9), "length", 8))
    settle(coordinator, engines)
    (end,) = coordinator.drain_events()
    assert (end.request_id, end.token_ids, end.finish_reason) == (client_id, (), "length")


def test_a_lost_placement_goes_back_to_the_front_door(served) -> None:
    coordinator, engines = served
    client_id, forward = _place(coordinator, engines)
    for _ in range(3):  # each of its streams finds it unreachable
        coordinator.on_engine_unreachable(forward.decode_engine_id, "connection refused")
    settle(coordinator, engines)
    (lost,) = coordinator.drain_events()
    assert (lost.request_id, lost.finish_reason, lost.is_engine_lost) == (client_id, "error", True)
    assert "connection refused" in lost.error
    assert coordinator.num_replaced == 0  # the front door places it again, from its stream
    assert coordinator.dead_engines() == {2: "connection refused"}
    cancels = engines[0].receive(CancelRequest)  # the PE drops it
    assert [m.request_id for m in cancels] == [forward.request_id]


def test_a_retryable_transfer_failure_goes_back_to_the_front_door(served) -> None:
    coordinator, engines = served
    client_id, forward = _place(coordinator, engines)
    failure = RequestFailed(forward.request_id, "the DE vanished", True, forward.decode_engine_id)
    engines[0].client.send(failure)
    settle(coordinator, engines)
    (lost,) = coordinator.drain_events()
    assert (lost.request_id, lost.is_engine_lost) == (client_id, True)
    assert coordinator.num_replaced == 0


def test_a_prompt_its_decode_server_refuses_goes_back_to_the_front_door_as_such(served) -> None:
    coordinator, engines = served
    client_id, forward = _place(coordinator, engines)
    refusal = RequestFailed(forward.request_id, "not the prompt placed", is_prompt_refused=True)
    engines[forward.decode_engine_id].client.send(refusal)
    settle(coordinator, engines)
    (refused,) = coordinator.drain_events()
    assert (refused.request_id, refused.is_prompt_refused) == (client_id, True)
    assert not refused.is_engine_lost and refused.error == "not the prompt placed"
    assert coordinator.dead_engines() == {}  # nothing is wrong with the server
    cancels = engines[0].receive(CancelRequest)  # the PE drops it
    assert [m.request_id for m in cancels] == [forward.request_id]


def _join_refusal(coordinator: Coordinator, engine: ServedEngine) -> str | None:
    settle(coordinator, [engine])
    refusals = engine.receive(Shutdown)
    return refusals[0].reason if refusals else None


def test_an_engine_whose_kv_is_keyed_otherwise_is_refused_by_name() -> None:
    coordinator = _coordinator()
    try:
        engine = ServedEngine(coordinator, 1, DECODE, url=URLS[1], fingerprint="f" * 32)
        reason = _join_refusal(coordinator, engine)
        assert reason is not None and "keyed" in reason and "block size" in reason
        engine.client.close()
    finally:
        coordinator.close()


def test_decode_engines_are_all_vllm_servers_or_none() -> None:
    coordinator = _coordinator()
    try:
        first = ServedEngine(coordinator, 1, DECODE, url=URLS[1])
        assert _join_refusal(coordinator, first) is None
        ours = ServedEngine(coordinator, 2, DECODE, url="")
        assert "all vLLM servers or all dualpath engines" in (
            _join_refusal(coordinator, ours) or ""
        )
        for engine in (first, ours):
            engine.client.close()
    finally:
        coordinator.close()


def test_a_vllm_server_prefill_engine_needs_vllm_server_decode_engines() -> None:
    coordinator = _coordinator()
    try:
        ours = ServedEngine(coordinator, 1, DECODE, url="")
        assert _join_refusal(coordinator, ours) is None
        pe = ServedEngine(coordinator, 0, PREFILL, url=URLS[0])
        assert "needs decode engines that are vLLM servers" in (
            _join_refusal(coordinator, pe) or ""
        )
        for engine in (ours, pe):
            engine.client.close()
    finally:
        coordinator.close()

"""The scheduler process against scripted engines speaking the real protocol on loopback."""

from __future__ import annotations

import pytest

from dualpath.cluster.coordinator import Coordinator
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.control.channel import Rejected
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import MemoryKVStore
from dualpath.protocol import (
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
    PrefillHeld,
    RequestFailed,
    TokenUpdate,
)
from dualpath.types import SamplingParams
from tests.cluster.scripted import IDENTITY, LAYOUT, TOKEN, FakeClock, Inbox, settle


class ScriptedEngine(Inbox):
    """A real control client that plays an engine's part by hand."""

    def __init__(self, coordinator: Coordinator, engine_id: int, role: str, node_id: int) -> None:
        super().__init__(coordinator, f"engine-{engine_id}")
        self.engine_id = engine_id
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
    settle(coordinator, engines)
    yield coordinator, engines, clock, store
    coordinator.close()
    for engine in engines:
        engine.client.close()


def _place(coordinator, engines, prompt, params, de_loads=(0, 0)):
    request_id = coordinator.submit(prompt, params)
    settle(coordinator, engines)
    engines[0].report()
    settle(coordinator, engines)
    engines[1].report(num_tokens=de_loads[0])
    engines[2].report(num_tokens=de_loads[1])
    settle(coordinator, engines)
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

    engines[0].client.send(PrefillHeld(request_id, 1))  # a vLLM PE: to its DE
    settle(coordinator, engines)
    assert engines[2].receive(PrefillHeld) == [PrefillHeld(request_id, 1)]
    engines[2].client.send(DecodeReady(request_id, (5, 6, 7, 8), 2))
    settle(coordinator, engines)
    assert engines[0].receive(DecodeReady) == [DecodeReady(request_id, (5, 6, 7, 8), 2)]
    engines[0].client.send(PrefillDone(request_id, 42, None, 8))
    settle(coordinator, engines)
    assert [m.first_token_id for m in engines[2].receive(PrefillDone)] == [42]
    engines[2].client.send(TokenUpdate(request_id, (7, 9), "length", 8))
    settle(coordinator, engines)
    events = coordinator.drain_events()
    assert [(e.token_ids, e.finish_reason, e.num_cached_tokens) for e in events] == [
        ((42,), None, 8),
        ((7, 9), "length", 8),
    ]
    assert coordinator.link_bytes()[0] == {"snic": 1}


def test_each_stage_of_the_first_tokens_path_is_timed_once_on_the_schedulers_clock(
    cluster,
) -> None:
    coordinator, engines, clock, _ = cluster
    clock.now_s = 1.0
    request_id = coordinator.submit(list(range(10)), SamplingParams(max_tokens=3))
    settle(coordinator, engines)
    clock.now_s = 1.5  # the engines' reports let the scheduler place it now
    for engine in engines:
        engine.report()
        settle(coordinator, engines)
    (assignment,) = engines[0].receive(Assignment)
    clock.now_s = 1.75
    engines[assignment.decode_engine_id].client.send(DecodeReady(request_id, (5, 6), 0))
    settle(coordinator, engines)
    clock.now_s = 2.5
    for _ in range(2):  # a PrefillDone sent twice is timed once
        engines[0].client.send(PrefillDone(request_id, 42, None, 0))
        settle(coordinator, engines)
    stages = coordinator.snapshot(clock.now_s).first_token_stages
    assert stages == {
        "placement": (1, pytest.approx(0.5)),
        "decode_ready": (1, pytest.approx(0.25)),
        "prefill": (1, pytest.approx(0.75)),
    }
    # The event with the first token carries them too (the server's per-request log line).
    first, *_ = coordinator.drain_events()
    assert first.token_ids == (42,)
    assert first.first_token_stages_s == pytest.approx((0.5, 0.25, 0.75))


def test_the_scheduler_fetches_for_idle_groups_until_they_are_given_work(cluster) -> None:
    coordinator, engines, _, _ = cluster
    for engine in engines:  # each says once that it is idle, then stays silent
        engine.report()
    settle(coordinator, engines)
    first = coordinator.submit(list(range(1, 10)), SamplingParams(max_tokens=2))
    settle(coordinator, engines)
    (assignment,) = engines[0].receive(Assignment)  # placed with no further report
    assert assignment.request_id == first
    first_de = assignment.decode_engine_id
    assert [a.request_id for a in engines[first_de].receive(Assignment)] == [first]
    # The PE was given work since its report: its entry is out of date, so the next request
    # waits for the PE's next report rather than being placed from the old one.
    second = coordinator.submit(list(range(20, 29)), SamplingParams(max_tokens=2))
    settle(coordinator, engines)
    assert engines[0].receive(Assignment) == []
    engines[0].report(num_tokens=9)  # the PE's report is its group's fetch
    settle(coordinator, engines)
    (assignment,) = engines[0].receive(Assignment)
    # The DE given the first request is out of date too; the other one is idle and current.
    assert (assignment.request_id, assignment.decode_engine_id) == (second, 3 - first_de)


def _silence(coordinator, engines, clock, dead_engine_id: int) -> None:
    """Every engine but ``dead_engine_id`` reports at 3 s; at 6 s it has been silent > 5 s."""
    clock.now_s = 3.0
    for engine in engines:
        if engine.engine_id != dead_engine_id:
            engine.report()
    settle(coordinator, engines)
    clock.now_s = 6.0
    settle(coordinator, engines)


def test_a_silent_engine_is_declared_dead_and_its_streaming_requests_go_on(cluster) -> None:
    coordinator, engines, clock, _ = cluster
    request_id = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=6))
    (assignment,) = engines[0].receive(Assignment)
    de = assignment.decode_engine_id
    other_de = 3 - de
    engines[0].client.send(PrefillDone(request_id, 42, None, 0))  # the first token is out
    settle(coordinator, engines)
    engines[de].client.send(TokenUpdate(request_id, (43, 44), None, 0))
    settle(coordinator, engines)
    _silence(coordinator, engines, clock, de)
    events = coordinator.drain_events()
    assert [(e.token_ids, e.finish_reason) for e in events] == [((42,), None), ((43, 44), None)]
    assert engines[0].receive(CancelRequest) == []  # the PE was done with it already
    assert coordinator.num_live_engines == 2 and not coordinator.is_ready()
    assert len(engines[0].receive(Heartbeat)) >= 1
    assert coordinator.num_replaced == 1

    # Placed again from the tokens sent: the prompt and them are prefilled, the next token
    # is the request's fourth output.
    engines[0].report()
    settle(coordinator, engines)
    engines[other_de].report()
    settle(coordinator, engines)
    (again,) = engines[0].receive(Assignment)
    assert engines[other_de].receive(Assignment) == [again]
    assert again.request_id != request_id and again.decode_engine_id == other_de
    assert again.prompt_token_ids.tolist() == [*range(10), 42, 43, 44]
    assert again.num_output_tokens == 3
    clock.now_s = 6.5
    engines[0].client.send(PrefillDone(again.request_id, 45, None, 4))
    settle(coordinator, engines)
    engines[other_de].client.send(TokenUpdate(again.request_id, (46, 47), "length", 4))
    settle(coordinator, engines)
    events = coordinator.drain_events()
    # Each token once, under the caller's id; the cached count the caller was first told.
    assert [(e.request_id, e.token_ids, e.finish_reason, e.num_cached_tokens) for e in events] == [
        (request_id, (45,), None, 0),
        (request_id, (46, 47), "length", 0),
    ]
    snapshot = coordinator.snapshot(clock.now_s)
    assert snapshot.num_replacement_delays == 1
    assert snapshot.replacement_delay_s_max == pytest.approx(0.5)  # declared dead at 6.0 s

    # Nothing more is placed on the dead engine.
    _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    (later,) = engines[0].receive(Assignment)
    assert later.decode_engine_id != de


def test_a_request_whose_first_token_ends_it_finishes_when_its_decode_engine_dies(
    cluster,
) -> None:
    coordinator, engines, _, _ = cluster
    request_id = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=1))
    (assignment,) = engines[0].receive(Assignment)
    engines[0].client.send(PrefillDone(request_id, 42, None, 0, "length"))
    settle(coordinator, engines)
    coordinator.on_engine_exited(assignment.decode_engine_id, -9)  # before its finish
    settle(coordinator, engines)
    events = coordinator.drain_events()
    # Only the finish was lost: it is sent, and no token more (max_tokens is 1).
    assert [(e.token_ids, e.finish_reason) for e in events] == [((42,), None), ((), "length")]
    assert coordinator.num_replaced == 0


def test_a_prefilled_request_does_not_need_its_prefill_engine(cluster) -> None:
    coordinator, engines, _, _ = cluster
    request_id = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=3))
    (assignment,) = engines[0].receive(Assignment)
    de = assignment.decode_engine_id
    engines[0].client.send(PrefillDone(request_id, 42, None, 0))
    settle(coordinator, engines)
    coordinator.on_engine_exited(0, -9)  # the PE dies once the DE holds the prompt's KV
    settle(coordinator, engines)
    engines[de].client.send(TokenUpdate(request_id, (43, 44), "length", 0))
    settle(coordinator, engines)
    events = coordinator.drain_events()
    assert [(e.token_ids, e.finish_reason) for e in events] == [((42,), None), ((43, 44), "length")]
    assert coordinator.num_replaced == 0


def test_the_snapshot_counts_the_requests_each_engine_loss_would_place_again(cluster) -> None:
    coordinator, engines, clock, _ = cluster
    held = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=3))
    (assignment,) = engines[0].receive(Assignment)
    de = assignment.decode_engine_id
    assert coordinator.snapshot(clock.now_s).engine_id_to_num_requests == {0: 1, de: 1}
    engines[0].client.send(PrefillDone(held, 42, None, 0))  # the PE is done with it
    settle(coordinator, engines)
    assert coordinator.snapshot(clock.now_s).engine_id_to_num_requests == {de: 1}
    # One whose first token ended it waits only for its finish: a loss sends that, no more.
    ended = _place(coordinator, engines, list(range(20, 30)), SamplingParams(max_tokens=1))
    engines[0].client.send(PrefillDone(ended, 43, None, 0, "length"))
    settle(coordinator, engines)
    assert coordinator.snapshot(clock.now_s).engine_id_to_num_requests == {de: 1}
    engines[de].client.send(TokenUpdate(held, (44, 45), "length", 0))
    settle(coordinator, engines)
    assert coordinator.snapshot(clock.now_s).engine_id_to_num_requests == {}


def test_a_request_without_output_is_placed_again_when_its_engine_dies(cluster) -> None:
    coordinator, engines, clock, store = cluster
    prompt = list(range(1, 14))
    request_id = _place(coordinator, engines, prompt, SamplingParams(max_tokens=2))
    (first,) = engines[0].receive(Assignment)
    de = first.decode_engine_id
    other_de = 3 - de
    # The lost DE had persisted the prompt's first block meanwhile: the new placement hits it.
    store.write(block_keys(prompt[:4], 4, IDENTITY.fingerprint)[0], bytes(LAYOUT.full_block_bytes))
    _silence(coordinator, engines, clock, de)
    assert coordinator.drain_events() == []  # no error: the caller sees nothing of it
    assert coordinator.num_replaced == 1
    assert engines[0].receive(CancelRequest) == [CancelRequest(request_id)]  # PE frees it
    engines[0].report()
    settle(coordinator, engines)
    engines[other_de].report()
    settle(coordinator, engines)
    (again,) = engines[0].receive(Assignment)
    assert engines[other_de].receive(Assignment) == [again]
    assert again.request_id != request_id  # a fresh id: late messages about the first match nothing
    assert (again.decode_engine_id, again.num_hit_blocks) == (other_de, 1)
    assert again.prompt_token_ids.tolist() == prompt
    # A late PrefillDone of the abandoned placement is ignored; the new one streams under the
    # caller's id.
    engines[0].client.send(PrefillDone(request_id, 99, None, 0))
    engines[0].client.send(PrefillDone(again.request_id, 42, None, 4))
    settle(coordinator, engines)
    assert [m.first_token_id for m in engines[other_de].receive(PrefillDone)] == [42]
    engines[other_de].client.send(TokenUpdate(again.request_id, (7,), "length", 4))
    settle(coordinator, engines)
    events = coordinator.drain_events()
    assert [(e.request_id, e.token_ids, e.finish_reason) for e in events] == [
        (request_id, (42,), None),
        (request_id, (7,), "length"),
    ]
    coordinator.cancel(request_id)  # finished: a no-op, nothing is sent
    assert engines[0].receive(CancelRequest) == []


def test_a_retryable_prefill_failure_is_placed_again_and_others_fail(cluster) -> None:
    coordinator, engines, clock, _ = cluster
    retried = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    failed = _place(coordinator, engines, list(range(20)), SamplingParams(max_tokens=2))
    first = {a.request_id: a for a in engines[0].receive(Assignment)}
    assert set(first) == {retried, failed}
    engines[0].client.send(RequestFailed(retried, "prefill failed: DE timed out", True))
    engines[0].client.send(RequestFailed(failed, "bad request"))
    settle(coordinator, engines)
    (event,) = coordinator.drain_events()
    assert (event.request_id, event.finish_reason, event.error) == (failed, "error", "bad request")
    assert coordinator.num_replaced == 1
    # Placed again one heartbeat timeout later (a dead peer is declared dead by then).
    clock.now_s = 4.0
    for engine in engines:
        engine.report()
    settle(coordinator, engines)
    assert engines[0].receive(Assignment) == []
    clock.now_s = 5.0
    for _ in range(2):
        for engine in engines:
            engine.report()
        settle(coordinator, engines)
    (again,) = engines[0].receive(Assignment)
    assert again.request_id not in (retried, failed)
    assert again.prompt_token_ids.tolist() == list(range(10))


def test_a_retryable_failure_is_placed_again_at_once_when_its_decode_engine_is_dead(
    cluster,
) -> None:
    coordinator, engines, _, _ = cluster
    request_id = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    (first,) = engines[0].receive(Assignment)
    de = first.decode_engine_id
    engines[0].client.send(RequestFailed(request_id, "prefill failed: DE disconnected", True))
    settle(coordinator, engines)
    coordinator.on_engine_exited(de, -9)  # the PE's notice came first; the clock stands still
    settle(coordinator, engines)
    engines[0].report()
    settle(coordinator, engines)
    engines[3 - de].report()
    settle(coordinator, engines)
    (again,) = engines[0].receive(Assignment)  # no heartbeat timeout waited for
    assert again.decode_engine_id == 3 - de and again.request_id != request_id
    assert coordinator.drain_events() == []


def test_a_request_that_only_shared_a_failed_batch_is_placed_again_at_once(cluster) -> None:
    coordinator, engines, clock, _ = cluster
    request_id = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    (first,) = engines[0].receive(Assignment)
    de = first.decode_engine_id
    # The PE's batch failed on the other DE's transfer: this request's own DE is fine.
    failure = RequestFailed(request_id, "prefill failed: peer gone", True, peer_engine_id=3 - de)
    engines[0].client.send(failure)
    settle(coordinator, engines)
    for engine in engines:
        engine.report()
        settle(coordinator, engines)
    (again,) = engines[0].receive(Assignment)  # the clock has not moved: no timeout waited
    assert again.request_id != request_id
    assert coordinator.num_replaced == 1 and coordinator.drain_events() == []


def test_a_decode_engine_a_transfer_failed_with_gets_nothing_until_it_reports(cluster) -> None:
    coordinator, engines, _, _ = cluster
    request_id = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    (first,) = engines[0].receive(Assignment)
    de = first.decode_engine_id
    suspect = 3 - de  # the PE's batch failed writing to the other DE
    failure = RequestFailed(request_id, "prefill failed: timed out", True, peer_engine_id=suspect)
    engines[0].client.send(failure)
    settle(coordinator, engines)
    engines[0].report()
    settle(coordinator, engines)
    engines[de].report(num_tokens=5000)  # busier than the suspect last said it was
    settle(coordinator, engines)
    (again,) = engines[0].receive(Assignment)
    assert again.decode_engine_id == de  # not the suspect, though it reported less load
    engines[suspect].report()  # it answers: chosen again
    settle(coordinator, engines)
    loads = (0, 9000) if suspect == 1 else (9000, 0)  # the suspect is the less loaded now
    _place(coordinator, engines, list(range(20)), SamplingParams(max_tokens=2), loads)
    assert [a.decode_engine_id for a in engines[0].receive(Assignment)] == [suspect]


def test_a_re_placed_request_is_cancelled_under_the_callers_id(cluster) -> None:
    coordinator, engines, clock, _ = cluster
    request_id = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    (first,) = engines[0].receive(Assignment)
    _silence(coordinator, engines, clock, first.decode_engine_id)
    engines[0].receive(CancelRequest)
    engines[0].report()
    settle(coordinator, engines)
    engines[3 - first.decode_engine_id].report()
    settle(coordinator, engines)
    (again,) = engines[0].receive(Assignment)
    coordinator.cancel(request_id)
    settle(coordinator, engines)
    assert engines[0].receive(CancelRequest) == [CancelRequest(again.request_id)]


def test_cancel_reaches_both_engines(cluster) -> None:
    coordinator, engines, _, _ = cluster
    request_id = _place(coordinator, engines, list(range(6)), SamplingParams(max_tokens=2))
    (assignment,) = engines[0].receive(Assignment)
    coordinator.cancel(request_id)
    settle(coordinator, engines)
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
    settle(coordinator, engines)
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
    settle(coordinator, engines)
    engines[0].report()
    settle(coordinator, engines)
    for engine in engines[1:]:
        engine.report()
    settle(coordinator, engines)
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


def test_a_request_the_wire_cannot_carry_is_refused_at_submit(cluster) -> None:
    coordinator, engines, _, _ = cluster
    # msgpack writes strings as UTF-8: a lone surrogate cannot be sent to the engines. It
    # must fail its submit, not the loop thread that would send its Assignment.
    with pytest.raises(ValueError, match="cannot be sent to the engines"):
        coordinator.submit(list(range(10)), SamplingParams(max_tokens=2, stop=("\ud800",)))
    _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    assert len(engines[0].receive(Assignment)) == 1  # the loop goes on placing requests


def test_an_engine_process_that_exits_is_dead_at_once(cluster) -> None:
    coordinator, engines, _, _ = cluster
    streaming = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=2))
    (assignment,) = engines[0].receive(Assignment)
    de = assignment.decode_engine_id
    engines[0].client.send(PrefillDone(streaming, 42, None, 0))
    settle(coordinator, engines)
    coordinator.on_engine_exited(de, -9)  # no heartbeat timeout: the clock has not moved
    settle(coordinator, engines)
    (first,) = coordinator.drain_events()  # the request goes on: no error
    assert first.token_ids == (42,)
    assert coordinator.num_replaced == 1
    assert coordinator.dead_engines() == {de: "its process exited with code -9"}
    assert coordinator.unavailable_reason is None


def test_an_engine_that_joins_again_before_its_death_is_noticed_loses_nothing(cluster) -> None:
    coordinator, engines, _, _ = cluster
    streaming = _place(coordinator, engines, list(range(10)), SamplingParams(max_tokens=3))
    (assignment,) = engines[0].receive(Assignment)
    de = assignment.decode_engine_id
    engines[0].client.send(PrefillDone(streaming, 42, None, 0))
    settle(coordinator, engines)
    # Restarted at once under its id: no heartbeat timeout passed, no exit was seen here.
    engines[de].client.close()
    engines[de] = ScriptedEngine(coordinator, de, DECODE, de)
    settle(coordinator, engines)
    assert coordinator.num_replaced == 1  # what its earlier process held goes on elsewhere
    assert coordinator.dead_engines() == {}
    assert coordinator.num_live_engines == 3  # counted once
    assert coordinator.snapshot(0.0).engine_deaths == {de: 1}
    (first,) = coordinator.drain_events()
    assert first.token_ids == (42,)
    # The new process is welcome: its reports are heard and it is given work.
    engines[de].report()
    settle(coordinator, engines)
    assert engines[de].receive(Rejected) == []


def test_with_no_engine_of_a_role_left_requests_fail_at_once(cluster) -> None:
    coordinator, engines, _, _ = cluster
    queued = coordinator.submit(list(range(10)), SamplingParams(max_tokens=2))
    settle(coordinator, engines)  # queued for a PE: no report yet
    coordinator.on_engine_exited(0, 1)
    settle(coordinator, engines)
    (event,) = coordinator.drain_events()
    assert event.request_id == queued and event.is_unavailable
    assert coordinator.unavailable_reason == "no prefill engine is alive"
    # A new request fails on its first loop turn instead of waiting for a PE that is gone.
    later = coordinator.submit(list(range(10)), SamplingParams(max_tokens=2))
    settle(coordinator, engines)
    (event,) = coordinator.drain_events()
    assert (event.request_id, event.error) == (later, "no prefill engine is alive")
    coordinator.on_engine_exited(1, 1)
    coordinator.on_engine_exited(2, 1)
    settle(coordinator, engines)
    assert coordinator.unavailable_reason == "no prefill and no decode engine is alive"

"""Group leaders speaking for their whole group (GroupInfo, GroupReport) on loopback, as the
scheduler benchmark runs them (``dualpath.bench.leader_protocol``).

The cluster: one prefill node and two decode nodes of two engines each, one node per group::

    group 0 (prefill): engines 0, 1 on node 0   leader engine-0
    group 1 (decode):  engines 2, 3 on node 1   leader engine-2
    group 2 (decode):  engines 4, 5 on node 2   leader engine-4
"""

from __future__ import annotations

import pytest

from dualpath.bench.leader_protocol import GroupInfo, GroupReport, LeaderCoordinator
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.control.codec import decode, encode
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import MemoryKVStore
from dualpath.protocol import (
    DECODE,
    PREFILL,
    Assignment,
    DecodeReady,
    EngineInfo,
    EngineReport,
    Heartbeat,
    PeerTable,
    Shutdown,
)
from dualpath.types import SamplingParams
from tests.cluster.scripted import IDENTITY, LAYOUT, TOKEN, FakeClock, Inbox, settle

GROUPS = {0: (PREFILL, 0, (0, 1)), 1: (DECODE, 1, (2, 3)), 2: (DECODE, 2, (4, 5))}


def _info(engine_id: int, role: str, node_id: int) -> EngineInfo:
    return EngineInfo(engine_id, role, node_id, "fake", b"", b"", 16, 64 if role == DECODE else 0)


class ScriptedLeader(Inbox):
    """A real control client that plays a group leader by hand."""

    def __init__(
        self, coordinator: LeaderCoordinator, group_id: int, client_engine_id=None
    ) -> None:
        role, node_id, engine_ids = GROUPS[group_id]
        client_engine_id = engine_ids[0] if client_engine_id is None else client_engine_id
        super().__init__(coordinator, f"engine-{client_engine_id}")
        self.group_id = group_id
        self.engine_ids = engine_ids
        self.client.send(GroupInfo(tuple(_info(e, role, node_id) for e in engine_ids)))

    def report(self, num_seqs=(0, 0), num_tokens=(0, 0), read_queue=(0, 0)) -> None:
        self.client.send(
            GroupReport(
                self.group_id,
                self.engine_ids,
                num_seqs,
                num_tokens,
                (64, 64),
                read_queue,
                ({"snic": 1}, {"snic": 2}),
                (0, 0),
            )
        )


def _coordinator(clock: FakeClock, store: MemoryKVStore | None = None) -> LeaderCoordinator:
    return LeaderCoordinator(
        ClusterConfig(
            num_prefill_nodes=1, num_decode_nodes=2, engines_per_node=2, heartbeat_timeout_s=5.0
        ),
        SchedulerConfig(block_size_tokens=4, beta_tokens=10_000),
        IDENTITY,
        store,
        TOKEN,
        storage_read_tokens_per_s=1000.0,
        clock=clock,
    )


@pytest.fixture
def cluster():
    clock = FakeClock()
    store = MemoryKVStore(LAYOUT, IDENTITY.fingerprint)
    coordinator = _coordinator(clock, store)
    leaders = [ScriptedLeader(coordinator, group_id) for group_id in GROUPS]
    settle(coordinator, leaders)
    yield coordinator, leaders, clock, store
    coordinator.close()
    for leader in leaders:
        leader.client.close()


def test_group_report_columns_round_trip() -> None:
    reports = (
        EngineReport(2, 1, 100, 60, 7, {"snic": 5}, 3),
        EngineReport(3, 0, 0, 64, 0, {}, 0),
    )
    group_report = GroupReport.of(1, reports)
    assert group_report.engine_ids == (2, 3)
    assert group_report.num_tokens == (100, 0)
    assert group_report.engines == reports
    assert decode(encode(group_report)) == group_report
    with pytest.raises(ValueError, match="every column needs 2 entries"):
        GroupReport(1, (2, 3), (1, 0), (100,), (60, 64), (7, 0), ({}, {}), (0, 0))


def test_leaders_join_their_groups_and_place_from_group_reports(cluster) -> None:
    coordinator, leaders, _, store = cluster
    prefill, decode_1, decode_2 = leaders
    assert coordinator.is_ready() and coordinator.num_live_engines == 6
    assert [info.engine_id for info in prefill.receive(PeerTable)[-1].engines] == [0, 1, 2, 3, 4, 5]
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4, the first 2 stored
    for key in block_keys(prompt[:8], 4, IDENTITY.fingerprint):
        store.write(key, bytes(LAYOUT.full_block_bytes))
    request_id = coordinator.submit(prompt, SamplingParams(max_tokens=3))
    settle(coordinator, leaders)

    # Engine 0 is busier: Algorithm 1 picks engine 1. Node 0's read_q sums both engines'.
    prefill.report(num_tokens=(5000, 0), read_queue=(300, 200))
    settle(coordinator, leaders)
    # Phase 1 sends the request to the less loaded DE group (1); phase 2 to its DE with the
    # fewest sequences (3), whose node's read_q (0) is shorter than node 0's (500).
    decode_2.report(num_seqs=(1, 1), num_tokens=(900, 900))
    decode_1.report(num_seqs=(1, 0), num_tokens=(100, 0))
    settle(coordinator, leaders)

    (pe_view,) = prefill.receive(Assignment)
    (de_view,) = decode_1.receive(Assignment)
    assert decode_2.receive(Assignment) == []
    assert pe_view == de_view
    assert (pe_view.request_id, pe_view.prefill_engine_id, pe_view.decode_engine_id) == (
        request_id,
        1,
        3,
    )
    assert (pe_view.num_prefill_side_blocks, pe_view.num_decode_side_blocks) == (0, 2)
    assert coordinator.num_assigned == 1
    assert coordinator.link_bytes() == {
        0: {"snic": 1},
        1: {"snic": 2},
        2: {"snic": 1},
        3: {"snic": 2},
        4: {"snic": 1},
        5: {"snic": 2},
    }

    # Messages for a group's engine go to its leader's client.
    decode_1.client.send(DecodeReady(request_id, (5, 6, 7, 8), 2))
    settle(coordinator, leaders)
    assert prefill.receive(DecodeReady) == [DecodeReady(request_id, (5, 6, 7, 8), 2)]


def test_every_report_reaches_the_policy_even_when_most_loads_repeat(cluster) -> None:
    # The coordinator reuses an engine's snapshot while its load is unchanged; a change in
    # one engine's seq_e must still be seen. Phase 2 picks the DE with the fewest sequences.
    coordinator, leaders, _, _ = cluster
    prefill, decode_1, decode_2 = leaders
    for num_seqs, expected_decode_engine_id in [((1, 0), 3), ((1, 0), 3), ((1, 2), 2)]:
        coordinator.submit([1, 2, 3, 4, 5], SamplingParams(max_tokens=3))
        settle(coordinator, leaders)
        prefill.report()
        settle(coordinator, leaders)
        decode_2.report(num_seqs=(5, 5), num_tokens=(9000, 9000))
        decode_1.report(num_seqs=num_seqs, num_tokens=(1000, 1000))
        settle(coordinator, leaders)
        (assignment,) = decode_1.receive(Assignment)
        assert assignment.decode_engine_id == expected_decode_engine_id


def test_an_assignment_carries_its_prompt_packed() -> None:
    # Ids above 2**16 and the extremes survive the packed (uint32) form, both ways.
    prompt = [0, 1, 65_535, 65_536, 151_935, 2**31, 2**32 - 1]
    assignment = Assignment(7, prompt, {"max_tokens": 3}, 1, 2, 0, 4)
    assert assignment.prompt_token_ids.typecode == "I"
    assert assignment.prompt_token_ids.tolist() == prompt
    data = encode(assignment)
    assert decode(data) == assignment
    assert decode(data).prompt_token_ids.tolist() == prompt
    # 4 bytes an id on the wire (msgpack would take 5 for each of these), and a longer
    # length field in the header.
    long_prompt = list(range(100_000, 104_096))
    long_data = encode(Assignment(7, long_prompt, {"max_tokens": 3}, 1, 2, 0, 4))
    assert len(long_data) - len(data) == 4 * (len(long_prompt) - len(prompt)) + 1
    for bad in ([-1], [2**32], b"\x01\x00\x00\x00"):
        with pytest.raises(ValueError, match="token ids must be"):
            Assignment(7, bad, {}, 0, 0, 0, 4)


def test_a_group_report_keeps_all_its_engines_alive(cluster) -> None:
    coordinator, leaders, clock, _ = cluster
    prefill, decode_1, decode_2 = leaders
    prefill.receive(PeerTable)
    decode_2.receive(PeerTable)
    clock.now_s = 3.0
    prefill.report()
    decode_1.report()
    settle(coordinator, leaders)
    assert len(prefill.receive(Heartbeat)) == 1  # once per leader, not once per engine
    assert len(decode_2.receive(Heartbeat)) == 1
    clock.now_s = 6.0  # group 2 has been silent for 6 s > 5 s; the others for 3 s
    settle(coordinator, leaders)
    assert coordinator.num_live_engines == 4
    (table,) = prefill.receive(PeerTable)  # one announcement for both deaths
    assert [info.engine_id for info in table.engines] == [0, 1, 2, 3]
    assert decode_2.receive(Heartbeat) == [] and decode_2.receive(PeerTable) == []
    assert coordinator.server.client_ids == ["engine-0", "engine-2"]  # engine-4 forgotten


def test_a_group_joins_only_through_its_leader_and_whole() -> None:
    coordinator = _coordinator(FakeClock())
    try:
        impostor = ScriptedLeader(coordinator, 0, client_engine_id=1)
        settle(coordinator, [impostor])
        assert impostor.receive(Shutdown) == [Shutdown("group 0 joins through its leader engine-0")]
        partial = Inbox(coordinator, "engine-2")
        partial.client.send(GroupInfo((_info(2, DECODE, 1),)))
        settle(coordinator, [impostor, partial])
        assert partial.receive(Shutdown) == [
            Shutdown("engines (2,) are not one group of the topology")
        ]
        assert coordinator.num_live_engines == 0
        impostor.client.close()
        partial.client.close()
    finally:
        coordinator.close()

"""Engines report the store writes they have queued (write_q) and the scheduler's read-side
choice counts them: a DE node busy persisting KV (SPEC §2) draws no reads from an idle PE
node. The cluster is ``tests/bench/test_leader_protocol``'s: one PE node, two DE nodes, two engines each."""

from __future__ import annotations

import pytest

from dualpath.bench.leader_protocol import GroupReport, record_group
from dualpath.cluster.group_load import GroupLoad
from dualpath.control.codec import decode, encode
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import MemoryKVStore
from dualpath.protocol import Assignment, EngineReport
from dualpath.scheduler import NodeSnapshot, make_cluster_topology
from dualpath.types import SamplingParams
from tests.bench.test_leader_protocol import (
    IDENTITY,
    LAYOUT,
    FakeClock,
    ScriptedLeader,
    _coordinator,
)
from tests.cluster.scripted import settle


def test_reports_carry_write_q_and_a_report_without_it_has_none_queued() -> None:
    reports = (
        EngineReport(2, 1, 100, 60, 7, {"snic": 5}, 3, 128),
        EngineReport(3, 0, 0, 64, 0, {}, 0),
    )
    assert reports[1].write_queue_tokens == 0
    group_report = GroupReport.of(1, reports)
    assert group_report.write_queue_tokens == (128, 0)
    assert group_report.engines == reports
    assert decode(encode(group_report)) == group_report
    without = GroupReport(1, (2, 3), (1, 0), (100, 0), (60, 64), (7, 0), ({}, {}), (3, 0))
    assert [r.write_queue_tokens for r in without.engines] == [0, 0]
    with pytest.raises(ValueError, match="every column needs 2 entries"):
        GroupReport(1, (2, 3), (1, 0), (100, 0), (60, 64), (7, 0), ({}, {}), (3, 0), (5,))


def test_a_nodes_write_q_sums_its_engines_and_queued_writes_are_work() -> None:
    topology = make_cluster_topology(
        num_prefill_nodes=1, num_decode_nodes=1, storage_read_tokens_per_s=1000.0,
        engines_per_node=2, nodes_per_group=1,
    )  # fmt: skip
    engine_id_to_node = {e: n.node_id for n in topology.nodes for e in n.engine_ids}
    load = GroupLoad.of(topology.groups[1], engine_id_to_node)  # the DE group: engines 2, 3
    load.record_engine(0, EngineReport(2, 0, 0, 64, 0, {}, 0, 192))
    load.record_engine(1, EngineReport(3, 0, 0, 64, 32, {}, 0, 64))
    assert load.snapshot().nodes == (NodeSnapshot(1, 32, 256),)
    # No requests, tokens or reads, but writes still moving: the group's entries will
    # change without any new work, so the scheduler may not fetch on its behalf.
    load.record_engine(1, EngineReport(3, 0, 0, 64, 0, {}, 0, 64))
    assert not load.is_idle()
    record_group(load, GroupReport(1, (2, 3), (0, 0), (0, 0), (64, 64), (0, 0), (), (0, 0)))
    assert load.is_idle()
    assert load.snapshot().nodes == (NodeSnapshot(1, 0, 0),)


def test_a_request_is_read_on_the_prefill_side_while_its_decode_node_writes() -> None:
    clock = FakeClock()
    store = MemoryKVStore(LAYOUT, IDENTITY.fingerprint)
    coordinator = _coordinator(clock, store)
    prefill, decode_1, decode_2 = leaders = [ScriptedLeader(coordinator, g) for g in (0, 1, 2)]
    try:
        settle(coordinator, leaders)
        prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4, the first 2 stored
        for key in block_keys(prompt[:8], 4, IDENTITY.fingerprint):
            store.write(key, bytes(LAYOUT.full_block_bytes))
        request_id = coordinator.submit(prompt, SamplingParams(max_tokens=3))
        settle(coordinator, leaders)
        prefill.report()  # node 0: nothing queued
        settle(coordinator, leaders)
        # DE group 1 is the less loaded: it takes the request. Its node reads nothing but
        # has 512 tokens of KV to write: SPEC §6's read_q alone (0 against 0) would read on
        # the DE side, behind those writes.
        decode_2.report(num_seqs=(1, 1), num_tokens=(900, 900))
        decode_1.client.send(
            GroupReport(1, (2, 3), (0, 0), (0, 0), (64, 64), (0, 0), (), (0, 0), (512, 0))
        )
        settle(coordinator, leaders)
        (assignment,) = decode_1.receive(Assignment)
        assert assignment.request_id == request_id
        assert (assignment.num_prefill_side_blocks, assignment.num_decode_side_blocks) == (2, 0)
    finally:
        coordinator.close()
        for leader in leaders:
            leader.client.close()

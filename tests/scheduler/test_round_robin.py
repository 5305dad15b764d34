"""The round-robin baseline and the factory that picks a scheduler by name.

The cluster: PE node 0 (engines 0, 1; group 0); DE node 1 (engines 2, 3; group 1) and DE
node 2 (engines 4, 5; group 2). Requests of 100 tokens need 7 blocks of 16 tokens.
"""

from __future__ import annotations

import pytest

from dualpath.scheduler import (
    DualPathScheduler,
    EngineRole,
    LoadPlan,
    RoundRobinScheduler,
    SchedulerConfig,
    make_scheduler,
)
from tests.scheduler.factories import (
    make_config,
    make_engine,
    make_group_snapshot,
    make_request,
    make_topology,
)


@pytest.fixture
def topology():
    return make_topology(num_prefill_nodes=1, num_decode_nodes=2)


def _decode_snapshot(topology, group_id, free_blocks):
    first_engine = 2 * group_id
    engines = [
        make_engine(first_engine + i, num_free_kv_blocks=free) for i, free in enumerate(free_blocks)
    ]
    return make_group_snapshot(topology, group_id, engines=engines)


def test_round_robin_cycles_engines_and_ignores_load(topology):
    scheduler = RoundRobinScheduler(make_config(scheduler="round_robin", read_path="pe"), topology)
    for request_id in range(5):
        scheduler.submit(make_request(request_id, num_prompt_tokens=100, num_cached_tokens=32))
    overloaded = [make_engine(0, num_tokens=10**9), make_engine(1, num_tokens=10**9)]
    prefill = scheduler.fetch_prefill(make_group_snapshot(topology, 0, engines=overloaded))
    assert prefill.request_ids == (0, 1, 2, 3, 4)
    assert prefill.prefill_engine_ids == (0, 1, 0, 1, 0)
    # DEs in turn: r0 e2, r1 e3, r2 e4, r3 e5, r4 e2. e2 has room for one request, so r4
    # blocks the head of group 1's queue.
    first = scheduler.fetch_decode(_decode_snapshot(topology, 1, [7, 100]))
    assert (first.request_ids, first.decode_engine_ids) == ((0, 1), (2, 3))
    assert first.load_plans == (LoadPlan(2, 0), LoadPlan(2, 0))  # Basic: PE-side reads
    blocked = scheduler.fetch_decode(_decode_snapshot(topology, 1, [0, 100]))
    assert len(blocked) == 0
    second = scheduler.fetch_decode(_decode_snapshot(topology, 2, [100, 100]))
    assert (second.request_ids, second.decode_engine_ids) == ((2, 3), (4, 5))
    assert (scheduler.num_waiting_prefill, scheduler.num_waiting_decode) == (0, 1)


def test_round_robin_fetch_returns_only_its_groups_requests():
    topology = make_topology(num_prefill_nodes=2, num_decode_nodes=1)  # PE groups 0 and 1
    scheduler = RoundRobinScheduler(make_config(scheduler="round_robin"), topology)
    for request_id in range(4):
        scheduler.submit(make_request(request_id))
    result = scheduler.fetch_prefill(make_group_snapshot(topology, 1))
    assert (result.request_ids, result.prefill_engine_ids) == ((2, 3), (2, 3))
    assert scheduler.num_waiting_prefill == 2


@pytest.mark.parametrize(
    ("name", "scheduler_type"),
    [("dualpath", DualPathScheduler), ("round_robin", RoundRobinScheduler)],
)
def test_make_scheduler_by_name(topology, name, scheduler_type):
    assert isinstance(make_scheduler(make_config(scheduler=name), topology), scheduler_type)


def test_config_rejects_unknown_names():
    with pytest.raises(ValueError, match="scheduler must be one of"):
        SchedulerConfig(scheduler="random")
    with pytest.raises(ValueError, match="read_path must be one of"):
        SchedulerConfig(read_path="both")


def _place_all(scheduler, topology, num_requests, decode_read_queue_tokens, no_hit=()):
    """Submit requests of 2 hit blocks (none for ids in ``no_hit``), place them on PEs, then
    fetch every DE group once with room to spare; the plans by request id."""
    for request_id in range(num_requests):
        cached = 0 if request_id in no_hit else 32
        scheduler.submit(make_request(request_id, num_prompt_tokens=40, num_cached_tokens=cached))
    for group in topology.groups_of(EngineRole.PREFILL):
        scheduler.fetch_prefill(make_group_snapshot(topology, group.group_id))
    plans = {}
    for group in topology.groups_of(EngineRole.DECODE):
        engines = [make_engine(e, num_free_kv_blocks=1000) for e in group.engine_ids]
        snapshot = make_group_snapshot(
            topology,
            group.group_id,
            engines=engines,
            read_queue_tokens=[decode_read_queue_tokens] * len(group.node_ids),
        )
        result = scheduler.fetch_decode(snapshot)
        plans.update(zip(result.request_ids, result.load_plans, strict=True))
    return plans


def test_round_robin_read_side_takes_turns_per_node_pair_ignoring_queues(topology):
    # DEs in turn: r0 e2, r1 e3, r2 e4, r3 e5, r4 e2, ... so pair (PE node 0, DE node 1) plans
    # r0, r1, r4, r5 and pair (0, 2) plans r2, r3, r6, r7. Each pair alternates PE, DE, PE, ...
    # although the DE nodes' queues are empty and the PE node's are never looked at; r6 has
    # no hit, reads nothing and takes no turn.
    scheduler = RoundRobinScheduler(
        make_config(scheduler="round_robin", read_path="round_robin"), topology
    )
    plans = _place_all(scheduler, topology, 8, decode_read_queue_tokens=0, no_hit=(6,))
    pe, de = LoadPlan(2, 0), LoadPlan(0, 2)
    assert [plans[r] for r in (0, 1, 4, 5)] == [pe, de, pe, de]
    assert [plans[r] for r in (2, 3, 6, 7)] == [pe, de, LoadPlan(0, 0), pe]


def test_round_robin_read_turns_do_not_alias_with_placement_turns():
    # 2P2D, one engine per node, two-node groups: PEs and DEs both alternate, so the requests
    # go to node pairs (0, 2), (1, 3), (0, 2), ... A single global turn would read every
    # request of pair (0, 2) on the PE side and every one of (1, 3) on the DE side; per-pair
    # turns give each DE node half of its requests.
    topology = make_topology(
        num_prefill_nodes=2, num_decode_nodes=2, engines_per_node=1, nodes_per_group=2
    )
    config = make_config(scheduler="round_robin", read_path="round_robin")
    plans = _place_all(RoundRobinScheduler(config, topology), topology, 8, 0)
    pe, de = LoadPlan(2, 0), LoadPlan(0, 2)
    assert [plans[r] for r in range(8)] == [pe, pe, de, de, pe, pe, de, de]
    again = _place_all(RoundRobinScheduler(config, topology), topology, 8, 0)
    assert again == plans  # deterministic: a fresh scheduler repeats the turns


def test_dualpath_placement_with_round_robin_reads_ignores_the_queues():
    # The turns live in the ClusterView both schedulers share, so DualPath's placement can
    # read in turn too: one node pair, a DE queue of 10^6 tokens ("dual" would read every
    # request on the PE side) and still PE, DE, PE, DE.
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=1)
    scheduler = DualPathScheduler(make_config(read_path="round_robin"), topology)
    plans = _place_all(scheduler, topology, 4, decode_read_queue_tokens=10**6)
    pe, de = LoadPlan(2, 0), LoadPlan(0, 2)
    assert [plans[r] for r in range(4)] == [pe, de, pe, de]

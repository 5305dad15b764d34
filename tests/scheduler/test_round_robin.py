"""The round-robin baseline and the factory that picks a scheduler by name.

The cluster: PE node 0 (engines 0, 1; group 0); DE node 1 (engines 2, 3; group 1) and DE
node 2 (engines 4, 5; group 2). Requests of 100 tokens need 7 blocks of 16 tokens.
"""

from __future__ import annotations

import pytest

from dualpath.scheduler import (
    DualPathScheduler,
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

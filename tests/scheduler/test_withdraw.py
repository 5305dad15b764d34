"""Losing an engine: its waiting requests come back for re-placement; nothing goes to it again.

The cluster: PE node 0 (engines 0, 1; group 0); DE node 1 (engines 2, 3; group 1) and DE
node 2 (engines 4, 5; group 2). Requests of 100 tokens need 7 blocks of 16 tokens.
"""

from __future__ import annotations

from dualpath.scheduler import DualPathScheduler, RoundRobinScheduler
from tests.scheduler.factories import (
    make_config,
    make_engine,
    make_group_snapshot,
    make_request,
    make_topology,
)


def _decode_snapshot(topology, group_id, free_blocks):
    first_engine = 2 * group_id
    engines = [
        make_engine(first_engine + i, num_free_kv_blocks=free) for i, free in enumerate(free_blocks)
    ]
    return make_group_snapshot(topology, group_id, engines=engines)


def test_round_robin_returns_a_lost_decode_engines_requests_and_skips_it() -> None:
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = RoundRobinScheduler(make_config(scheduler="round_robin", read_path="pe"), topology)
    for request_id in range(4):
        scheduler.submit(make_request(request_id))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))  # DEs 2, 3, 4, 5 in turn
    withdrawn = scheduler.withdraw_engine(3)
    assert [r.request_id for r in withdrawn] == [1]
    assert scheduler.num_waiting_decode == 3
    for request in withdrawn:
        scheduler.submit(request)
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    placed = scheduler.fetch_decode(_decode_snapshot(topology, 1, (100, 100)))
    # The turn had wrapped to DE 2; request 1, re-placed, takes it (DE 3 is skipped for good).
    assert (placed.request_ids, placed.decode_engine_ids) == ((0, 1), (2, 2))
    later = scheduler.fetch_decode(_decode_snapshot(topology, 2, (100, 100)))
    assert (later.request_ids, later.decode_engine_ids) == ((2, 3), (4, 5))
    scheduler.submit(make_request(9))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    assert scheduler.fetch_decode(_decode_snapshot(topology, 2, (100, 100))).decode_engine_ids == (
        4,
    )


def test_round_robin_returns_a_lost_prefill_engines_requests() -> None:
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = RoundRobinScheduler(make_config(scheduler="round_robin", read_path="pe"), topology)
    for request_id in range(4):
        scheduler.submit(make_request(request_id))  # PEs 0, 1, 0, 1
    withdrawn = scheduler.withdraw_engine(1)
    assert [r.request_id for r in withdrawn] == [1, 3]
    for request in withdrawn:
        scheduler.submit(request)
    placed = scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    assert placed.prefill_engine_ids == (0, 0, 0, 0)


def test_dualpath_moves_a_dead_groups_queue_to_live_groups() -> None:
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = DualPathScheduler(make_config(), topology)
    for request_id in range(4):
        scheduler.submit(make_request(request_id))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    # Group 2 reports no free memory: phase 1 spreads requests, group 2's stay queued there.
    first = scheduler.fetch_decode(_decode_snapshot(topology, 2, (0, 0)))
    assert first.request_ids == ()
    assert scheduler.withdraw_engine(4) == [] and scheduler.withdraw_engine(5) == []
    placed = scheduler.fetch_decode(_decode_snapshot(topology, 1, (100, 100)))
    assert sorted(placed.request_ids) == [0, 1, 2, 3]
    assert set(placed.decode_engine_ids) <= {2, 3}


def test_dualpath_returns_requests_waiting_on_a_lost_prefill_engine() -> None:
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = DualPathScheduler(make_config(), topology)
    for request_id in range(4):
        scheduler.submit(make_request(request_id))
    placed = scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    on_engine_1 = [
        r for r, e in zip(placed.request_ids, placed.prefill_engine_ids, strict=True) if e == 1
    ]
    withdrawn = scheduler.withdraw_engine(1)
    assert [r.request_id for r in withdrawn] == on_engine_1 != []
    assert scheduler.num_waiting_decode == 4 - len(on_engine_1)


def test_a_restored_decode_group_takes_requests_again() -> None:
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = DualPathScheduler(make_config(), topology)
    scheduler.withdraw_engine(4)
    scheduler.withdraw_engine(5)  # group 2 all lost: phase 1 sends it nothing
    scheduler.restore_engine(4)  # restarted under its id
    scheduler.restore_engine(5)
    scheduler.restore_engine(5)  # a no-op the second time
    for request_id in range(2):
        scheduler.submit(make_request(request_id))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    # Group 1 reports far more load than group 2: phase 1 sends both requests to group 2.
    busy = [make_engine(e, num_tokens=50_000, num_free_kv_blocks=100) for e in (2, 3)]
    assert scheduler.fetch_decode(make_group_snapshot(topology, 1, engines=busy)).request_ids == ()
    placed = scheduler.fetch_decode(_decode_snapshot(topology, 2, (100, 100)))
    assert sorted(placed.request_ids) == [0, 1] and set(placed.decode_engine_ids) <= {4, 5}


def test_round_robin_turns_to_a_restored_engine_again() -> None:
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = RoundRobinScheduler(make_config(scheduler="round_robin", read_path="pe"), topology)
    scheduler.withdraw_engine(3)
    scheduler.restore_engine(3)
    for request_id in range(4):
        scheduler.submit(make_request(request_id))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    placed = scheduler.fetch_decode(_decode_snapshot(topology, 1, (100, 100)))
    assert placed.decode_engine_ids == (2, 3)  # DE 3 has its turn again

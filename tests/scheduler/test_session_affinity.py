"""A preferred DE (an agent session's last one): taken while it is in service and has room.

The cluster: PE node 0 (engines 0, 1; group 0); DE node 1 (engines 2, 3; group 1) and DE
node 2 (engines 4, 5; group 2). Requests of 100 tokens need 7 blocks of 16 tokens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.scheduler import (
    SCHEDULER_NAMES,
    DualPathScheduler,
    EngineRole,
    RoundRobinScheduler,
    make_scheduler,
)
from tests.scheduler.factories import (
    BLOCK_SIZE_TOKENS,
    make_config,
    make_engine,
    make_group_snapshot,
    make_request,
    make_topology,
)
from tests.scheduler.test_properties import (
    _idle_snapshot,
    _random_snapshot,
    _request,
    requests_strategy,
)

NUM_BLOCKS = 7  # a 100-token request's DE memory in 16-token blocks


def _decode_snapshot(topology, group_id, engines):
    """``engines``: per engine of the group, (num_seqs, num_tokens, num_free_kv_blocks)."""
    first_engine = 2 * group_id
    return make_group_snapshot(
        topology,
        group_id,
        engines=[
            make_engine(first_engine + i, num_seqs=s, num_tokens=t, num_free_kv_blocks=f)
            for i, (s, t, f) in enumerate(engines)
        ],
    )


def _dualpath_with_one_request(preferred):
    """Request 0 (preferring ``preferred``) placed on a PE; group 1 is loaded, group 2 has
    not reported (idle): phase 1 alone would send the request to group 2."""
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = DualPathScheduler(make_config(), topology)
    scheduler.submit(make_request(0, preferred_decode_engine_id=preferred))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    return topology, scheduler


def test_the_preferred_decode_engine_is_taken_while_it_has_room() -> None:
    topology, scheduler = _dualpath_with_one_request(preferred=3)
    # DE 3 holds more sequences and tokens than DE 2 (phase 2 alone would pick DE 2), and its
    # group is the loaded one (phase 1 alone would pick group 2): it gets the request anyway.
    placed = scheduler.fetch_decode(
        _decode_snapshot(topology, 1, ((0, 0, 100), (5, 500, NUM_BLOCKS)))
    )
    assert (placed.request_ids, placed.decode_engine_ids) == ((0,), (3,))


def test_without_a_preference_the_same_request_goes_where_the_policy_says() -> None:
    topology, scheduler = _dualpath_with_one_request(preferred=None)
    loaded = scheduler.fetch_decode(
        _decode_snapshot(topology, 1, ((0, 0, 100), (5, 500, NUM_BLOCKS)))
    )
    assert loaded.request_ids == ()  # phase 1 sent it to the idle group 2
    placed = scheduler.fetch_decode(_decode_snapshot(topology, 2, ((0, 0, 100), (0, 0, 100))))
    assert (placed.request_ids, placed.decode_engine_ids) == ((0,), (4,))


def test_a_request_moves_when_its_decode_engine_has_no_room() -> None:
    topology, scheduler = _dualpath_with_one_request(preferred=3)
    placed = scheduler.fetch_decode(
        _decode_snapshot(topology, 1, ((0, 0, 100), (0, 0, NUM_BLOCKS - 1)))
    )
    assert (placed.request_ids, placed.decode_engine_ids) == ((0,), (2,))


def test_room_counts_what_the_same_fetch_placed_before() -> None:
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = DualPathScheduler(make_config(), topology)
    for request_id in range(2):
        scheduler.submit(make_request(request_id, preferred_decode_engine_id=3))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    # Room for one request on DE 3: the second one moves to DE 2.
    placed = scheduler.fetch_decode(
        _decode_snapshot(topology, 1, ((0, 0, 100), (0, 0, 2 * NUM_BLOCKS - 1)))
    )
    assert (placed.request_ids, placed.decode_engine_ids) == ((0, 1), (3, 2))


def test_a_request_moves_when_its_decode_engine_is_lost() -> None:
    topology, scheduler = _dualpath_with_one_request(preferred=3)
    scheduler.withdraw_engine(3)
    loaded = scheduler.fetch_decode(_decode_snapshot(topology, 1, ((1, 500, 100), (0, 0, 0))))
    assert loaded.request_ids == ()  # phase 1 chose as without a preference: group 2
    placed = scheduler.fetch_decode(_decode_snapshot(topology, 2, ((0, 0, 100), (0, 0, 100))))
    assert (placed.request_ids, placed.decode_engine_ids) == ((0,), (4,))
    scheduler.restore_engine(3)  # back in service: preferred again
    scheduler.submit(make_request(1, preferred_decode_engine_id=3))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    placed = scheduler.fetch_decode(_decode_snapshot(topology, 1, ((0, 0, 100), (0, 0, 100))))
    assert (placed.request_ids, placed.decode_engine_ids) == ((1,), (3,))


def test_round_robin_takes_the_preferred_engine_out_of_turn() -> None:
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = RoundRobinScheduler(make_config(scheduler="round_robin", read_path="pe"), topology)
    scheduler.submit(make_request(0))
    scheduler.submit(make_request(1, preferred_decode_engine_id=5))
    scheduler.submit(make_request(2))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    first = scheduler.fetch_decode(_decode_snapshot(topology, 1, ((0, 0, 100), (0, 0, 100))))
    later = scheduler.fetch_decode(_decode_snapshot(topology, 2, ((0, 0, 100), (0, 0, 100))))
    # Requests 0 and 2 take DEs 2 and 3 in turn; request 1 its own DE 5.
    assert (first.request_ids, first.decode_engine_ids) == ((0, 2), (2, 3))
    assert (later.request_ids, later.decode_engine_ids) == ((1,), (5,))


def test_round_robin_skips_a_lost_preferred_engine() -> None:
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2)
    scheduler = RoundRobinScheduler(make_config(scheduler="round_robin", read_path="pe"), topology)
    scheduler.withdraw_engine(5)
    scheduler.submit(make_request(0, preferred_decode_engine_id=5))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    placed = scheduler.fetch_decode(_decode_snapshot(topology, 1, ((0, 0, 100), (0, 0, 100))))
    assert (placed.request_ids, placed.decode_engine_ids) == ((0,), (2,))


@pytest.mark.parametrize("scheduler_cls", [DualPathScheduler, RoundRobinScheduler])
@pytest.mark.parametrize("engine_id", [0, 6])  # a prefill engine; no engine at all
def test_a_preferred_engine_that_is_no_decode_engine_is_refused(scheduler_cls, engine_id) -> None:
    scheduler = scheduler_cls(make_config(), make_topology(num_decode_nodes=2))
    with pytest.raises(ValueError, match=f"preferred_decode_engine_id {engine_id} is not"):
        scheduler.submit(make_request(0, preferred_decode_engine_id=engine_id))
    assert scheduler.num_waiting_prefill == 0


def test_a_request_whose_one_engine_group_is_full_goes_where_the_policy_says() -> None:
    # One DE per group: PE 0 (group 0), DE 1 (group 1), DE 2 (group 2).
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2, engines_per_node=1)
    scheduler = DualPathScheduler(make_config(), topology)
    scheduler.submit(make_request(0, preferred_decode_engine_id=1))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    full = make_engine(1, num_seqs=1, num_tokens=500, num_free_kv_blocks=NUM_BLOCKS - 1)
    assert (
        scheduler.fetch_decode(make_group_snapshot(topology, 1, engines=[full])).request_ids == ()
    )
    assert scheduler.decode_fetch_may_place(2)  # back in the global queue, for any group
    placed = scheduler.fetch_decode(
        make_group_snapshot(topology, 2, engines=[make_engine(2, num_free_kv_blocks=100)])
    )
    assert (placed.request_ids, placed.decode_engine_ids) == ((0,), (2,))
    assert scheduler.num_waiting_decode == 0


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    scheduler_name=st.sampled_from(SCHEDULER_NAMES),
    nodes_per_group=st.integers(1, 2),
    engines_per_node=st.integers(1, 2),
    request_specs=requests_strategy,
)
def test_with_preferences_no_request_is_lost_or_placed_twice_and_memory_is_respected(
    data, scheduler_name, nodes_per_group, engines_per_node, request_specs
):
    topology = make_topology(
        num_prefill_nodes=nodes_per_group,
        num_decode_nodes=nodes_per_group * data.draw(st.integers(1, 3)),
        engines_per_node=engines_per_node,
        nodes_per_group=nodes_per_group,
    )
    scheduler = make_scheduler(make_config(scheduler=scheduler_name), topology)
    decode_engine_ids = [e for g in topology.groups_of(EngineRole.DECODE) for e in g.engine_ids]
    preference = st.one_of(st.none(), st.sampled_from(decode_engine_ids))
    requests = [
        replace(_request(i, spec), preferred_decode_engine_id=data.draw(preference))
        for i, spec in enumerate(request_specs)
    ]
    decode_engine_of: dict[int, int] = {}

    def fetch(group, snapshot) -> None:
        if group.role == EngineRole.PREFILL:
            scheduler.fetch_prefill(snapshot)
            return
        result = scheduler.fetch_decode(snapshot)
        free = {engine.engine_id: engine.num_free_kv_blocks for engine in snapshot.engines}
        for request_id, engine_id in zip(result.request_ids, result.decode_engine_ids, strict=True):
            assert request_id not in decode_engine_of, f"request {request_id} placed twice"
            decode_engine_of[request_id] = engine_id
            free[engine_id] -= -(-requests[request_id].num_decode_tokens // BLOCK_SIZE_TOKENS)
            assert free[engine_id] >= 0, "a DE fetch overcommitted memory"

    for request in requests:
        scheduler.submit(request)
        group = data.draw(st.sampled_from(topology.groups))
        fetch(group, _random_snapshot(data, topology, group))
    for _ in range(2 * len(requests) + 2):  # idle engines with ample memory drain every queue
        if scheduler.num_waiting_prefill + scheduler.num_waiting_decode == 0:
            break
        for group in topology.groups:
            fetch(group, _idle_snapshot(topology, group))
    assert sorted(decode_engine_of) == list(range(len(requests)))

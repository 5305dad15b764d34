"""Algorithm 1 (SPEC §6): PE placement on a PE group's fetch, with exact assignments.

The cluster: one PE group of two nodes (node 0: engines 0, 1; node 1: engines 2, 3) and one
DE group (nodes 2, 3). α = 100 tokens, β = 1,000 tokens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dualpath.scheduler import DualPathScheduler, PrefillAssignment
from tests.scheduler.factories import (
    make_config,
    make_engine,
    make_group_snapshot,
    make_request,
    make_topology,
)

PREFILL_GROUP = 0


@pytest.fixture
def topology():
    return make_topology(num_prefill_nodes=2, num_decode_nodes=2, nodes_per_group=2)


def _fetch(scheduler, topology, engine_tokens, read_queue_tokens):
    engines = [make_engine(e, num_tokens=t) for e, t in enumerate(engine_tokens)]
    snapshot = make_group_snapshot(
        topology, PREFILL_GROUP, engines=engines, read_queue_tokens=read_queue_tokens
    )
    return scheduler.fetch_prefill(snapshot)


def _submit(scheduler, prompt_tokens):
    for request_id, tokens in enumerate(prompt_tokens):
        scheduler.submit(make_request(request_id, num_prompt_tokens=tokens))


def test_category_a_is_preferred_over_b_in_a_two_node_group(topology):
    scheduler = DualPathScheduler(make_config(), topology)
    _submit(scheduler, [300] * 6)
    # Node 0 has a long read queue (B) but idle engines; node 1 a short one (A).
    result = _fetch(scheduler, topology, [0, 100, 600, 700], read_queue_tokens=[500, 50])
    # A first, min tok_e: e2 600->900, e3 700->1000 (= β, still in), e2 900->1200 (out),
    # e3 1000->1300 (out); then B: e0 0->300, e1 100->400.
    assert result.prefill_engine_ids == (2, 3, 2, 3, 0, 1)
    assert result.request_ids == (0, 1, 2, 3, 4, 5)
    assert result.assignments()[0] == PrefillAssignment(request_id=0, prefill_engine_id=2)


def test_read_queue_equal_to_alpha_is_category_a(topology):
    scheduler = DualPathScheduler(make_config(), topology)
    _submit(scheduler, [100])
    result = _fetch(scheduler, topology, [50, 50, 0, 0], read_queue_tokens=[100, 101])
    assert result.prefill_engine_ids == (0,)


def test_overloaded_engines_get_nothing_and_beta_is_inclusive(topology):
    scheduler = DualPathScheduler(make_config(), topology)
    _submit(scheduler, [500] * 6)
    # e0 is over β; e1 sits exactly at β and qualifies; e2 is over β.
    result = _fetch(scheduler, topology, [1001, 1000, 1500, 0], read_queue_tokens=[0, 0])
    # e3 0->500->1000; then e1 and e3 tie at 1000: the engine listed first (e1) -> 1500, out;
    # e3 1000->1500, out; nobody qualifies: the fetch ends with two requests left.
    assert result.prefill_engine_ids == (3, 3, 1, 3)
    assert scheduler.num_waiting_prefill == 2


def test_fetch_ends_and_fifo_order_is_kept_for_the_next_fetch(topology):
    scheduler = DualPathScheduler(make_config(), topology)
    _submit(scheduler, [400, 900, 100, 100])
    first = _fetch(scheduler, topology, [700, 2000, 2000, 2000], read_queue_tokens=[0, 0])
    assert (first.request_ids, first.prefill_engine_ids) == ((0,), (0,))
    second = _fetch(scheduler, topology, [0, 0, 0, 0], read_queue_tokens=[0, 0])
    # The head (request 1) goes first even though it is the largest.
    assert second.request_ids == (1, 2, 3)
    assert second.prefill_engine_ids == (0, 1, 2)


def test_all_engines_overloaded_places_nothing(topology):
    scheduler = DualPathScheduler(make_config(), topology)
    _submit(scheduler, [10])
    result = _fetch(scheduler, topology, [1001] * 4, read_queue_tokens=[0, 0])
    assert len(result) == 0
    assert scheduler.num_waiting_prefill == 1


def test_placed_requests_join_the_decode_queue(topology):
    scheduler = DualPathScheduler(make_config(), topology)
    _submit(scheduler, [10, 10])
    _fetch(scheduler, topology, [0] * 4, read_queue_tokens=[0, 0])
    assert (scheduler.num_waiting_prefill, scheduler.num_waiting_decode) == (0, 2)


def test_beta_comes_from_the_profiled_prefill_rate(topology):
    config = make_config(beta_tokens=None, prefill_tokens_per_s=100.0)  # β = 5 s x 100
    scheduler = DualPathScheduler(config, topology)
    _submit(scheduler, [300, 300, 300])
    result = _fetch(scheduler, topology, [400, 501, 501, 501], read_queue_tokens=[0, 0])
    assert result.prefill_engine_ids == (0,)  # e0 400 -> 700 > 500; the rest are over β


def test_dualpath_needs_beta_or_a_prefill_rate(topology):
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        DualPathScheduler(make_config(beta_tokens=None), topology)


def test_snapshot_must_match_the_group(topology):
    scheduler = DualPathScheduler(make_config(), topology)
    engines = [make_engine(e) for e in (1, 0, 2, 3)]
    with pytest.raises(ValueError, match="snapshot engines"):
        scheduler.fetch_prefill(make_group_snapshot(topology, PREFILL_GROUP, engines=engines))
    for engine_ids in ((0, 1, 2), (0, 1, 2, 3, 4)):  # one short, one too many
        engines = [make_engine(e) for e in engine_ids]
        with pytest.raises(ValueError, match="snapshot engines"):
            scheduler.fetch_prefill(make_group_snapshot(topology, PREFILL_GROUP, engines=engines))
    snapshot = make_group_snapshot(topology, PREFILL_GROUP, read_queue_tokens=[5, 7])
    for nodes in (snapshot.nodes[::-1], snapshot.nodes[:1], snapshot.nodes + snapshot.nodes[:1]):
        with pytest.raises(ValueError, match="snapshot nodes"):
            scheduler.fetch_prefill(replace(snapshot, nodes=nodes))
    with pytest.raises(ValueError, match="is a decode group"):
        scheduler.fetch_prefill(make_group_snapshot(topology, 1))
    with pytest.raises(ValueError, match="unknown group"):
        scheduler.fetch_prefill(replace(make_group_snapshot(topology, PREFILL_GROUP), group_id=7))


def test_submit_rejects_a_waiting_id_and_partial_hit_blocks(topology):
    scheduler = DualPathScheduler(make_config(), topology)
    scheduler.submit(make_request(1))
    with pytest.raises(ValueError, match="already waiting"):
        scheduler.submit(make_request(1))
    with pytest.raises(ValueError, match="not a multiple of block_size_tokens"):
        scheduler.submit(make_request(2, num_prompt_tokens=100, num_cached_tokens=20))

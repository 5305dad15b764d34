"""Read-path choice (SPEC §6) and split reads (our extension): planners and the scheduler's
read-queue bookkeeping. Blocks are 16 tokens."""

from __future__ import annotations

import pytest

from dualpath.scheduler import (
    DualPathScheduler,
    FixedSideLoadPlanner,
    LoadPlan,
    ShorterQueueLoadPlanner,
    SplitLoadPlanner,
    make_load_planner,
)
from dualpath.scheduler.load_planner import RoundRobinLoadPlanner
from tests.scheduler.factories import (
    BLOCK_SIZE_TOKENS,
    make_config,
    make_engine,
    make_group_snapshot,
    make_request,
    make_topology,
)

PREFILL_GROUP, DECODE_GROUP = 0, 1


def test_dual_reads_on_the_shorter_queue_and_ties_go_to_the_decode_side():
    planner = ShorterQueueLoadPlanner()
    assert planner.plan(5, 99, 100, 1.0, 1.0) == LoadPlan(5, 0)
    assert planner.plan(5, 100, 100, 1.0, 1.0) == LoadPlan(0, 5)
    assert planner.plan(5, 101, 100, 1.0, 1.0) == LoadPlan(0, 5)


def test_fixed_planners_ignore_the_queues():
    assert FixedSideLoadPlanner(on_prefill_side=True).plan(3, 1e9, 0, 1.0, 1.0) == LoadPlan(3, 0)
    assert FixedSideLoadPlanner(on_prefill_side=False).plan(3, 0, 1e9, 1.0, 1.0) == LoadPlan(0, 3)


def test_round_robin_takes_turns_and_ignores_the_queues():
    planner = RoundRobinLoadPlanner()
    turns = [planner.plan(3, 1e9, 0, 1.0, 1.0, num_earlier_plans=n) for n in range(4)]
    assert turns == [LoadPlan(3, 0), LoadPlan(0, 3), LoadPlan(3, 0), LoadPlan(0, 3)]
    # Pure: the same turn gives the same plan, however often it is asked.
    assert planner.plan(3, 0, 1e9, 1.0, 1.0, num_earlier_plans=1) == LoadPlan(0, 3)


def test_split_equalises_finish_times():
    planner = SplitLoadPlanner(BLOCK_SIZE_TOKENS)
    # Equal rates: k = (36 + 160 - 100) / 32 = 3 -> both queues end at 148 tokens.
    assert planner.plan(10, 100, 36, 1000.0, 1000.0) == LoadPlan(3, 7)
    # The DE node reads 3x faster: one block on the PE side, three on the DE side, 16 ms each.
    assert planner.plan(4, 0, 0, 1000.0, 3000.0) == LoadPlan(1, 3)


def test_split_ties_go_to_the_decode_side_and_long_queues_get_nothing():
    planner = SplitLoadPlanner(BLOCK_SIZE_TOKENS)
    assert planner.plan(3, 0, 0, 1.0, 1.0) == LoadPlan(1, 2)  # k* = 1.5: 1 and 2 tie
    assert planner.plan(4, 1000, 0, 1.0, 1.0) == LoadPlan(0, 4)
    assert planner.plan(4, 0, 1000, 1.0, 1.0) == LoadPlan(4, 0)
    assert planner.plan(0, 5, 7, 1.0, 1.0) == LoadPlan(0, 0)


def test_load_plan_counts():
    plan = LoadPlan(num_prefill_side_blocks=2, num_decode_side_blocks=3)
    assert (plan.num_hit_blocks, plan.is_split) == (5, True)
    assert not LoadPlan(0, 5).is_split


@pytest.mark.parametrize(
    ("read_path", "planner_type"),
    [
        ("dual", ShorterQueueLoadPlanner),
        ("split", SplitLoadPlanner),
        ("pe", FixedSideLoadPlanner),
        ("de", FixedSideLoadPlanner),
        ("round_robin", RoundRobinLoadPlanner),
    ],
)
def test_planners_by_name(read_path, planner_type):
    planner = make_load_planner(read_path, block_size_tokens=16)
    assert isinstance(planner, planner_type)
    if read_path in ("pe", "de"):
        assert planner.on_prefill_side == (read_path == "pe")


def test_unknown_read_path_is_rejected():
    with pytest.raises(ValueError, match="read_path must be one of"):
        make_load_planner("both", block_size_tokens=16)


def _schedule_reads(read_path, prefill_read_queue_tokens, decode_read_queue_tokens, num_requests):
    """Place ``num_requests`` requests of 2 hit blocks each; return their plans."""
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=1, engines_per_node=1)
    scheduler = DualPathScheduler(make_config(read_path=read_path), topology)
    for request_id in range(num_requests):
        scheduler.submit(make_request(request_id, num_prompt_tokens=40, num_cached_tokens=32))
    prefill_snapshot = make_group_snapshot(
        topology, PREFILL_GROUP, read_queue_tokens=[prefill_read_queue_tokens]
    )
    assert len(scheduler.fetch_prefill(prefill_snapshot)) == num_requests
    decode_snapshot = make_group_snapshot(
        topology,
        DECODE_GROUP,
        engines=[make_engine(1, num_free_kv_blocks=1000)],
        read_queue_tokens=[decode_read_queue_tokens],
    )
    return scheduler.fetch_decode(decode_snapshot).load_plans


def test_each_read_choice_sees_the_reads_planned_before_it():
    # PE node 100, DE node 60 tokens queued; each request reads 32 tokens.
    # r0: 100 vs 60 -> DE (92); r1: 100 vs 92 -> DE (124); r2: 100 vs 124 -> PE (132);
    # r3: 132 vs 124 -> DE (156).
    plans = _schedule_reads("dual", 100, 60, 4)
    assert plans == (LoadPlan(0, 2), LoadPlan(0, 2), LoadPlan(2, 0), LoadPlan(0, 2))


def test_split_reads_through_the_scheduler():
    # k* = (q_de + 32 - q_pe) / 32 at equal rates; a tie between floor and ceil goes to the
    # DE side. r0: k* = (0 + 32 - 16) / 32 = 0.5 -> 0 (queues 16, 32); r1: k* = 1.5 -> 1
    # (queues 32, 48); r2: k* = 1.5 -> 1 (queues 48, 64).
    plans = _schedule_reads("split", 16, 0, 3)
    assert plans == (LoadPlan(0, 2), LoadPlan(1, 1), LoadPlan(1, 1))


def test_fixed_paths_through_the_scheduler():
    assert _schedule_reads("pe", 1000, 0, 1) == (LoadPlan(2, 0),)
    assert _schedule_reads("de", 0, 1000, 1) == (LoadPlan(0, 2),)


def test_round_robin_path_through_the_scheduler():
    # The PE queue is the longer one, and r0 still reads there: turns, not queues.
    assert _schedule_reads("round_robin", 1000, 0, 3) == (
        LoadPlan(2, 0),
        LoadPlan(0, 2),
        LoadPlan(2, 0),
    )

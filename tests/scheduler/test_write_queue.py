"""The read-side choice counts each node's queued store writes (``write_q``) beside its
``read_q``: our extension of SPEC §6 (``dualpath/scheduler/cluster_view.py``). A DE node whose
SNIC is busy persisting the first turns' KV (SPEC §2) is not an idle node. Blocks are 16
tokens; every request reads 2 hit blocks (32 tokens)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.scheduler import (
    READ_PATHS,
    SCHEDULER_NAMES,
    DualPathScheduler,
    GroupSnapshot,
    LoadPlan,
    NodeSnapshot,
    make_scheduler,
)
from tests.scheduler.factories import (
    make_config,
    make_engine,
    make_group_snapshot,
    make_request,
    make_topology,
)

PREFILL_GROUP, DECODE_GROUP = 0, 1


def _with_writes(snapshot: GroupSnapshot, write_queue_tokens: list[int]) -> GroupSnapshot:
    nodes = tuple(
        NodeSnapshot(node.node_id, node.read_queue_tokens, tokens)
        for node, tokens in zip(snapshot.nodes, write_queue_tokens, strict=True)
    )
    return GroupSnapshot(snapshot.group_id, snapshot.engines, nodes)


def _plans(
    *,
    prefill_read_q: int,
    decode_read_q: int,
    decode_write_q: int,
    num_requests: int = 1,
    read_path: str = "dual",
    scheduler_name: str = "dualpath",
    prefill_write_q: int = 0,
) -> tuple[LoadPlan, ...]:
    """The read plans of ``num_requests`` requests on 1P1D, placed in one DE fetch."""
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=1, engines_per_node=1)
    config = make_config(read_path=read_path, scheduler=scheduler_name)
    scheduler = make_scheduler(config, topology)
    for request_id in range(num_requests):
        scheduler.submit(make_request(request_id, num_prompt_tokens=40, num_cached_tokens=32))
    prefill = make_group_snapshot(topology, PREFILL_GROUP, read_queue_tokens=[prefill_read_q])
    assert len(scheduler.fetch_prefill(_with_writes(prefill, [prefill_write_q]))) == num_requests
    decode = make_group_snapshot(
        topology,
        DECODE_GROUP,
        engines=[make_engine(1, num_free_kv_blocks=1000)],
        read_queue_tokens=[decode_read_q],
    )
    return scheduler.fetch_decode(_with_writes(decode, [decode_write_q])).load_plans


def test_a_decode_node_busy_writing_is_not_chosen_over_an_idle_prefill_node():
    # Both read queues are empty: SPEC §6's tie would read on the DE side, behind the DE's
    # 640 tokens of writes, while the PE node's SNIC idles.
    assert _plans(prefill_read_q=0, decode_read_q=0, decode_write_q=640) == (LoadPlan(2, 0),)
    assert _plans(prefill_read_q=0, decode_read_q=0, decode_write_q=0) == (LoadPlan(0, 2),)


def test_the_choice_compares_read_q_plus_write_q_and_a_tie_still_goes_to_the_decode_side():
    # PE 100 vs DE 60 + 40 = 100: a tie, the DE side; DE 60 + 41 > 100: the PE side.
    assert _plans(prefill_read_q=100, decode_read_q=60, decode_write_q=40) == (LoadPlan(0, 2),)
    assert _plans(prefill_read_q=100, decode_read_q=60, decode_write_q=41) == (LoadPlan(2, 0),)


def test_each_choice_sees_the_reads_planned_before_it_on_top_of_the_reported_writes():
    # PE node 0; DE node 0 read + 70 write. r0: 0 < 70 -> PE (32); r1: 32 < 70 -> PE (64);
    # r2: 64 < 70 -> PE (96); r3: 96 vs 70 -> DE (read_q 32, queue 102); r4: 96 < 102 -> PE.
    plans = _plans(prefill_read_q=0, decode_read_q=0, decode_write_q=70, num_requests=5)
    assert plans == (
        LoadPlan(2, 0),
        LoadPlan(2, 0),
        LoadPlan(2, 0),
        LoadPlan(0, 2),
        LoadPlan(2, 0),
    )


def test_split_reads_fill_both_queues_to_the_same_finish_with_the_writes_counted():
    # Equal rates; PE 0, DE 0 + 32 written: k* = (32 + 32 - 0) / 32 = 2 -> both blocks on
    # the PE side, whose queue then ends level with the DE's writes.
    assert _plans(prefill_read_q=0, decode_read_q=0, decode_write_q=32, read_path="split") == (
        LoadPlan(2, 0),
    )


def test_algorithm_1_categories_stay_on_read_q():
    # One PE group of two nodes, one engine each, α = 100. Node 0 reads 50 (category A) and
    # reports writes (PE nodes write nothing; if one did, Algorithm 1 would still see read_q
    # only); node 1 reads 150 (B). Engine 0 is busier but in A: it gets the request.
    topology = make_topology(
        num_prefill_nodes=2, num_decode_nodes=2, engines_per_node=1, nodes_per_group=2
    )
    scheduler = DualPathScheduler(make_config(), topology)
    scheduler.submit(make_request(0))
    snapshot = make_group_snapshot(
        topology,
        PREFILL_GROUP,
        engines=[make_engine(0, num_tokens=100), make_engine(1)],
        read_queue_tokens=[50, 150],
    )
    assert scheduler.fetch_prefill(_with_writes(snapshot, [10**6, 0])).prefill_engine_ids == (0,)


@settings(max_examples=200, deadline=None)
@given(
    scheduler_name=st.sampled_from(SCHEDULER_NAMES),
    read_path=st.sampled_from(READ_PATHS),
    read_qs=st.tuples(st.integers(0, 400), st.integers(0, 400)),
    write_qs=st.tuples(st.integers(0, 400), st.integers(0, 400)),
    num_requests=st.integers(1, 6),
)
def test_a_queued_write_weighs_exactly_like_a_queued_read(
    scheduler_name, read_path, read_qs, write_qs, num_requests
):
    # On one PE node (Algorithm 1's categories cannot change its choice) every placement
    # and plan is the one of nodes that report read_q + write_q as read_q and no writes.
    (prefill_read_q, decode_read_q), (prefill_write_q, decode_write_q) = read_qs, write_qs
    common = {
        "num_requests": num_requests,
        "read_path": read_path,
        "scheduler_name": scheduler_name,
    }
    with_writes = _plans(
        prefill_read_q=prefill_read_q,
        decode_read_q=decode_read_q,
        decode_write_q=decode_write_q,
        prefill_write_q=prefill_write_q,
        **common,
    )
    as_reads = _plans(
        prefill_read_q=prefill_read_q + prefill_write_q,
        decode_read_q=decode_read_q + decode_write_q,
        decode_write_q=0,
        **common,
    )
    assert with_writes == as_reads
    assert len(with_writes) == num_requests

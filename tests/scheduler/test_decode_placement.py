"""DE placement (SPEC §6): phase 1 (group choice) and phase 2 (Z threshold, memory gate).

The cluster: PE node 0 (engines 0-3, group 0) and DE node 1 (engines 4-7, group 1); the
phase 1 test adds DE node 2 (engines 8-11, group 2). Blocks are 16 tokens; every request has
max_num_output_tokens = 0, so len_r is its prompt.
"""

from __future__ import annotations

import pytest

from dualpath.scheduler import DecodeAssignment, DualPathScheduler, LoadPlan
from tests.scheduler.factories import (
    make_config,
    make_engine,
    make_group_snapshot,
    make_request,
    make_topology,
)

PREFILL_GROUP, DECODE_GROUP_1, DECODE_GROUP_2 = 0, 1, 2
ROOMY_BLOCKS = 1000


@pytest.fixture
def topology():
    return make_topology(num_prefill_nodes=1, num_decode_nodes=1, engines_per_node=4)


@pytest.fixture
def scheduler(topology):
    return DualPathScheduler(make_config(beta_tokens=1_000_000), topology)


def _place_on_prefill(scheduler, topology, prompt_tokens):
    for request_id, tokens in enumerate(prompt_tokens):
        scheduler.submit(make_request(request_id, num_prompt_tokens=tokens))
    result = scheduler.fetch_prefill(make_group_snapshot(topology, PREFILL_GROUP))
    assert len(result) == len(prompt_tokens)


def _fetch_decode(scheduler, topology, group_id, *, seqs, tokens, free_blocks):
    first_engine = 4 * group_id
    engines = [
        make_engine(first_engine + i, num_seqs=s, num_tokens=t, num_free_kv_blocks=f)
        for i, (s, t, f) in enumerate(zip(seqs, tokens, free_blocks, strict=True))
    ]
    snapshot = make_group_snapshot(topology, group_id, engines=engines)
    return scheduler.fetch_decode(snapshot)


def test_z_threshold_prefers_min_seq_among_engines_under_z(scheduler, topology):
    _place_on_prefill(scheduler, topology, [100, 100, 100])
    # Z = 1.05 x (300 + 900 + 100 + 150 + 0) / 4 = 380.625, so tok_e + 100 <= Z needs
    # tok_e <= 280.625: e4 (seq 0) is over Z. Among the rest, min seq_e, then min tok_e:
    # e5 (seq 1); then e6 (seq 2, tok 150) before e5 (seq 2, tok 200); then e5 (seq 2).
    # e7 (tok 0, seq 3) never wins: under Z, seq_e decides.
    result = _fetch_decode(
        scheduler,
        topology,
        DECODE_GROUP_1,
        seqs=[0, 1, 2, 3],
        tokens=[900, 100, 150, 0],
        free_blocks=[ROOMY_BLOCKS] * 4,
    )
    assert result.decode_engine_ids == (5, 6, 5)
    assert result.request_ids == (0, 1, 2)


def test_no_engine_under_z_falls_back_to_min_tokens_with_room(scheduler, topology):
    _place_on_prefill(scheduler, topology, [1000])
    # Z = 1.05 x (1000 + 2200) / 4 = 840 < every tok_e + 1000. The least-loaded engine, e5,
    # has 62 free blocks but needs 63 (1000 / 16 rounded up): e4 is next.
    result = _fetch_decode(
        scheduler,
        topology,
        DECODE_GROUP_1,
        seqs=[9, 0, 0, 0],
        tokens=[500, 400, 600, 700],
        free_blocks=[63, 62, 63, 63],
    )
    assert result.decode_engine_ids == (4,)


def test_r_counts_only_the_requests_that_fit_the_group_memory(scheduler, topology):
    _place_on_prefill(scheduler, topology, [160, 1600])
    # Σ free = 20 blocks: R = {request 0} (10 blocks); request 1 needs 100. So
    # Z = 1.05 x (160 + 30) / 4 = 49.875 and neither engine is under Z: the fallback takes
    # e4 (tok 0). Had R included request 1, Z would be 469.9 and min seq_e would pick e5.
    result = _fetch_decode(
        scheduler,
        topology,
        DECODE_GROUP_1,
        seqs=[5, 0, 0, 0],
        tokens=[0, 30, 0, 0],
        free_blocks=[10, 10, 0, 0],
    )
    assert result.decode_engine_ids == (4,)
    assert scheduler.num_waiting_decode == 1  # request 1 fits nowhere: the fetch ended


def test_memory_gate_ends_the_fetch_at_a_head_that_fits_nowhere(scheduler, topology):
    _place_on_prefill(scheduler, topology, [320, 16])
    # The head needs 20 blocks, every engine has 19: nothing is placed, although request 1
    # (one block) would fit. Both wait, in order.
    result = _fetch_decode(
        scheduler,
        topology,
        DECODE_GROUP_1,
        seqs=[0] * 4,
        tokens=[0] * 4,
        free_blocks=[19] * 4,
    )
    assert len(result) == 0
    later = _fetch_decode(
        scheduler,
        topology,
        DECODE_GROUP_1,
        seqs=[0] * 4,
        tokens=[0] * 4,
        free_blocks=[0, 0, 20, 1],
    )
    # Request 0 takes e6's 20 blocks; request 1 then fits only on e7.
    assert later.request_ids == (0, 1)
    assert later.decode_engine_ids == (6, 7)


def test_placements_use_up_free_memory_within_one_fetch(scheduler, topology):
    _place_on_prefill(scheduler, topology, [160, 160, 160])
    result = _fetch_decode(
        scheduler,
        topology,
        DECODE_GROUP_1,
        seqs=[0, 1, 2, 3],
        tokens=[0, 0, 0, 0],
        free_blocks=[10, 10, 0, 0],
    )
    # e4 (min seq) takes request 0 and is full; e5 takes request 1; request 2 fits nowhere.
    assert result.decode_engine_ids == (4, 5)
    assert scheduler.num_waiting_decode == 1


def test_phase_one_sends_each_request_to_the_group_with_the_fewest_tokens():
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=2, engines_per_node=4)
    scheduler = DualPathScheduler(make_config(beta_tokens=1_000_000), topology)
    # Group 2 reports first (Σ tok_e = 150) while nothing waits.
    idle = {"seqs": [0] * 4, "free_blocks": [ROOMY_BLOCKS] * 4}
    assert (
        len(_fetch_decode(scheduler, topology, DECODE_GROUP_2, tokens=[150, 0, 0, 0], **idle)) == 0
    )
    _place_on_prefill(scheduler, topology, [100, 100, 100, 100])
    # Group 1's fetch (Σ tok_e = 0) runs phase 1 for everyone: loads 0 vs 150, each request
    # adding its len_r: r0 -> g1 (100), r1 -> g1 (200), r2 -> g2 (250), r3 -> g1 (300).
    first = _fetch_decode(scheduler, topology, DECODE_GROUP_1, tokens=[0] * 4, **idle)
    assert first.request_ids == (0, 1, 3)
    second = _fetch_decode(scheduler, topology, DECODE_GROUP_2, tokens=[150, 0, 0, 0], **idle)
    assert second.request_ids == (2,)
    assert scheduler.num_waiting_decode == 0


def test_assignment_carries_both_engines_and_the_read_plan(scheduler, topology):
    scheduler.submit(make_request(7, num_prompt_tokens=100, num_cached_tokens=64))
    prefill = scheduler.fetch_prefill(make_group_snapshot(topology, PREFILL_GROUP))
    decode = _fetch_decode(
        scheduler,
        topology,
        DECODE_GROUP_1,
        seqs=[0] * 4,
        tokens=[0] * 4,
        free_blocks=[ROOMY_BLOCKS] * 4,
    )
    # Both read queues are empty: a tie goes to the DE side.
    assert decode.assignments() == (
        DecodeAssignment(
            request_id=7,
            prefill_engine_id=prefill.prefill_engine_ids[0],
            decode_engine_id=4,
            load_plan=LoadPlan(num_prefill_side_blocks=0, num_decode_side_blocks=4),
        ),
    )


def test_a_decode_placed_id_may_be_submitted_again(scheduler, topology):
    _place_on_prefill(scheduler, topology, [100])
    idle = {"seqs": [0] * 4, "tokens": [0] * 4, "free_blocks": [ROOMY_BLOCKS] * 4}
    assert len(_fetch_decode(scheduler, topology, DECODE_GROUP_1, **idle)) == 1
    scheduler.submit(make_request(0))  # e.g. re-placed after its engine was lost
    assert scheduler.num_waiting_prefill == 1

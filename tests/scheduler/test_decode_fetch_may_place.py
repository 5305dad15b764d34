"""``decode_fetch_may_place`` / ``report_decode_load``: a DE fetch that could place nothing
only records its group's load, so a leader (the simulator) may send just that.

Leaving such a fetch out and reporting the load instead must change nothing: the fetch would
place nothing, and every later answer is the one the scheduler would give had it been made.
The lockstep test checks exactly that on random runs, and is shown to catch a lying answer.

The cluster of the unit tests: PE node 0 (engines 0-3, group 0), DE nodes 1 and 2 (engines
4-7, group 1; 8-11, group 2). Requests have no output tokens, so len_r is the prompt.
"""

from __future__ import annotations

import random

import pytest

from dualpath.scheduler import DualPathScheduler, EngineRole, make_scheduler
from tests.scheduler.factories import (
    BLOCK_SIZE_TOKENS,
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
    return make_topology(num_prefill_nodes=1, num_decode_nodes=2, engines_per_node=4)


@pytest.fixture
def scheduler(topology):
    return DualPathScheduler(make_config(beta_tokens=1_000_000), topology)


def _decode_snapshot(topology, group_id, tokens, free_blocks=ROOMY_BLOCKS):
    first_engine = 4 * group_id
    engines = [
        make_engine(first_engine + i, num_tokens=t, num_free_kv_blocks=free_blocks)
        for i, t in enumerate(tokens)
    ]
    return make_group_snapshot(topology, group_id, engines=engines)


def _place_on_prefill(scheduler, topology, prompt_tokens, first_id=0):
    for request_id, tokens in enumerate(prompt_tokens, first_id):
        scheduler.submit(make_request(request_id, num_prompt_tokens=tokens))
    result = scheduler.fetch_prefill(make_group_snapshot(topology, PREFILL_GROUP))
    assert len(result) == len(prompt_tokens)


def test_nothing_to_place_when_nothing_waits(scheduler):
    assert not scheduler.decode_fetch_may_place(DECODE_GROUP_1)
    assert not scheduler.decode_fetch_may_place(DECODE_GROUP_2)


def test_the_queues_say_which_fetch_may_place(scheduler, topology):
    _place_on_prefill(scheduler, topology, [100, 100])
    # In the global queue: any DE fetch runs phase 1, for every group.
    assert scheduler.decode_fetch_may_place(DECODE_GROUP_1)
    assert scheduler.decode_fetch_may_place(DECODE_GROUP_2)
    # Group 2 reports 150 tokens and no free memory: phase 1 sends both requests to group 1
    # (0 < 150), and group 2 places nothing.
    report = _decode_snapshot(topology, DECODE_GROUP_2, [150, 0, 0, 0], free_blocks=0)
    assert len(scheduler.fetch_decode(report)) == 0
    assert not scheduler.decode_fetch_may_place(DECODE_GROUP_2)
    assert scheduler.decode_fetch_may_place(DECODE_GROUP_1)  # its private queue holds both
    placed = scheduler.fetch_decode(_decode_snapshot(topology, DECODE_GROUP_1, [0, 0, 0, 0]))
    assert placed.request_ids == (0, 1)
    assert not scheduler.decode_fetch_may_place(DECODE_GROUP_1)


def _phase_one_groups(scheduler, topology, report_group_2):
    """Group 2 reports a load of 150 tokens (by ``report_group_2``), then four requests of
    100 tokens go through phase 1 at group 1's fetch: which group takes each."""
    report_group_2()
    _place_on_prefill(scheduler, topology, [100, 100, 100, 100])
    first = scheduler.fetch_decode(_decode_snapshot(topology, DECODE_GROUP_1, [0] * 4))
    second = scheduler.fetch_decode(_decode_snapshot(topology, DECODE_GROUP_2, [150, 0, 0, 0]))
    return first.request_ids, second.request_ids


def test_a_reported_load_steers_phase_one_as_a_fetch_does(topology):
    by_fetch = DualPathScheduler(make_config(beta_tokens=1_000_000), topology)
    by_report = DualPathScheduler(make_config(beta_tokens=1_000_000), topology)
    snapshot = _decode_snapshot(topology, DECODE_GROUP_2, [150, 0, 0, 0])
    expected = _phase_one_groups(by_fetch, topology, lambda: by_fetch.fetch_decode(snapshot))
    # Loads 0 vs 150, each request adding its len_r: r0, r1 -> g1; r2 -> g2; r3 -> g1.
    assert expected == ((0, 1, 3), (2,))
    assert (
        _phase_one_groups(
            by_report, topology, lambda: by_report.report_decode_load(DECODE_GROUP_2, 150)
        )
        == expected
    )


def test_a_dead_groups_reported_load_is_ignored(scheduler, topology):
    for engine_id in range(4, 8):
        scheduler.withdraw_engine(engine_id)
    scheduler.report_decode_load(DECODE_GROUP_1, 0)  # still dead: phase 1 skips it
    scheduler.report_decode_load(DECODE_GROUP_2, 10_000)
    _place_on_prefill(scheduler, topology, [100, 100])
    placed = scheduler.fetch_decode(_decode_snapshot(topology, DECODE_GROUP_2, [10_000, 0, 0, 0]))
    assert placed.request_ids == (0, 1)


@pytest.mark.parametrize("name", ["dualpath", "round_robin"])
def test_only_decode_groups_of_the_topology_may_ask_or_report(topology, name):
    scheduler = make_scheduler(make_config(scheduler=name), topology)
    for call in (
        lambda group_id: scheduler.decode_fetch_may_place(group_id),
        lambda group_id: scheduler.report_decode_load(group_id, 0),
    ):
        with pytest.raises(ValueError, match="unknown group"):
            call(99)
        with pytest.raises(ValueError, match="prefill group"):
            call(PREFILL_GROUP)


def test_round_robin_may_place_only_what_waits_for_the_group(topology):
    scheduler = make_scheduler(make_config(scheduler="round_robin"), topology)
    assert not scheduler.decode_fetch_may_place(DECODE_GROUP_1)
    scheduler.submit(make_request(0))  # PE 0, then the first DE: engine 4 of group 1
    scheduler.fetch_prefill(make_group_snapshot(topology, PREFILL_GROUP))
    assert scheduler.decode_fetch_may_place(DECODE_GROUP_1)
    assert not scheduler.decode_fetch_may_place(DECODE_GROUP_2)


# --- lockstep: reporting instead of fetching changes no answer -----------------------------


def _real_may_place(scheduler, group_id):
    return scheduler.decode_fetch_may_place(group_id)


def _real_report(scheduler, group_id, num_tokens):
    scheduler.report_decode_load(group_id, num_tokens)


def _lockstep_divergence(name, seed, may_place=_real_may_place, report=_real_report):
    """Drive two schedulers with the same random run of a small cluster (2 PE groups, 3 DE
    groups, engines whose loads follow the placements and random finishes): ``full`` makes
    every DE fetch; ``skipping`` leaves out those that ``may_place(scheduler, group_id)`` says
    can place nothing and sends ``report(scheduler, group_id, num_tokens)`` instead (the real
    methods by default). Returns a description of the first difference (a skipped fetch that
    would have placed, or any later answer or count that differs), None when there is none."""
    num_ops = 1000
    rng = random.Random(seed)
    topology = make_topology(num_prefill_nodes=2, num_decode_nodes=3, engines_per_node=2)
    config = make_config(scheduler=name, beta_tokens=600, alpha_tokens=50)
    full = make_scheduler(config, topology)
    skipping = make_scheduler(config, topology)
    prefill_groups = [g for g in topology.groups if g.role == EngineRole.PREFILL]
    decode_groups = [g for g in topology.groups if g.role == EngineRole.DECODE]
    # The cluster as the leaders see it: per engine [seqs, tokens, free blocks].
    load = {e: [0, 0, 0] for g in prefill_groups for e in g.engine_ids}
    load.update({e: [0, 0, 24] for g in decode_groups for e in g.engine_ids})
    on_prefill: list[tuple[int, int]] = []  # (engine, prompt tokens) until the prefill ends
    on_decode: list[tuple[int, int, int]] = []  # (engine, len_r, blocks) until it finishes
    requests = {}
    next_id = 0
    num_skipped = 0

    def snapshot(group):
        engines = [
            make_engine(
                e, num_seqs=load[e][0], num_tokens=load[e][1], num_free_kv_blocks=load[e][2]
            )
            for e in group.engine_ids
        ]
        read_q = [rng.randrange(0, 200, BLOCK_SIZE_TOKENS) for _ in group.node_ids]
        return make_group_snapshot(
            topology, group.group_id, engines=engines, read_queue_tokens=read_q
        )

    for step in range(num_ops):
        op = rng.random()
        if op < 0.25:
            prompt = rng.randrange(16, 320)
            hit = min(rng.randrange(0, 10), prompt // BLOCK_SIZE_TOKENS) * BLOCK_SIZE_TOKENS
            request = make_request(
                next_id,
                num_prompt_tokens=prompt,
                num_cached_tokens=hit,
                max_num_output_tokens=rng.randrange(0, 64),
            )
            requests[next_id] = request
            next_id += 1
            full.submit(request)
            skipping.submit(request)
        elif op < 0.45:
            group = rng.choice(prefill_groups)
            snap = snapshot(group)
            answer = full.fetch_prefill(snap)
            if answer != skipping.fetch_prefill(snap):
                return f"step {step}: prefill answers differ"
            for request_id, engine_id in zip(
                answer.request_ids, answer.prefill_engine_ids, strict=True
            ):
                tokens = requests[request_id].num_prompt_tokens
                load[engine_id][0] += 1
                load[engine_id][1] += tokens
                on_prefill.append((engine_id, tokens))
        elif op < 0.55 and on_prefill:
            engine_id, tokens = on_prefill.pop(rng.randrange(len(on_prefill)))
            load[engine_id][0] -= 1
            load[engine_id][1] -= tokens
        elif op < 0.85:
            group = rng.choice(decode_groups)
            snap = snapshot(group)
            num_tokens = sum(engine.num_tokens for engine in snap.engines)
            answer = full.fetch_decode(snap)
            if not may_place(skipping, group.group_id):
                report(skipping, group.group_id, num_tokens)
                num_skipped += 1
                if len(answer):
                    return f"step {step}: a skipped fetch of group {group.group_id} placed"
            elif answer != skipping.fetch_decode(snap):
                return f"step {step}: decode answers differ"
            for request_id, engine_id in zip(
                answer.request_ids, answer.decode_engine_ids, strict=True
            ):
                len_r = requests[request_id].num_decode_tokens
                blocks = -(-len_r // BLOCK_SIZE_TOKENS)
                load[engine_id][0] += 1
                load[engine_id][1] += len_r
                load[engine_id][2] -= blocks
                on_decode.append((engine_id, len_r, blocks))
        elif on_decode:
            engine_id, len_r, blocks = on_decode.pop(rng.randrange(len(on_decode)))
            load[engine_id][0] -= 1
            load[engine_id][1] -= len_r
            load[engine_id][2] += blocks
        if (full.num_waiting_prefill, full.num_waiting_decode) != (
            skipping.num_waiting_prefill,
            skipping.num_waiting_decode,
        ):
            return f"step {step}: waiting counts differ"
    assert num_skipped >= 10, f"the run must exercise the query ({num_skipped} skips)"
    return None


@pytest.mark.parametrize("name", ["dualpath", "round_robin"])
@pytest.mark.parametrize("seed", range(8))
def test_reporting_instead_of_a_fetch_that_cannot_place_changes_no_answer(name, seed):
    assert _lockstep_divergence(name, seed) is None


def _ignores_the_global_queue(scheduler, group_id):
    index = scheduler._cluster.group(group_id, EngineRole.DECODE).index
    return bool(scheduler._decode_group_queues[index])


def _ignores_the_private_queue(scheduler, group_id):
    return bool(scheduler._decode_global_queue)


def _reports_nothing(scheduler, group_id, num_tokens):
    pass


@pytest.mark.parametrize(
    "lie",
    [
        {"may_place": _ignores_the_global_queue},
        {"may_place": _ignores_the_private_queue},
        {"report": _reports_nothing},
    ],
    ids=["ignores the global queue", "ignores the private queue", "the load is not recorded"],
)
def test_the_lockstep_check_catches_a_lie(lie):
    # Each lie drops one part of the contract: the check must see a difference in some run.
    assert any(_lockstep_divergence("dualpath", seed, **lie) for seed in range(8))

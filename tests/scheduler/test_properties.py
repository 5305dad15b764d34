"""Hypothesis properties of the scheduler (issue #3, "Must show").

* No request is lost or placed twice, for both schedulers and every read path.
* A DE fetch never places more on an engine than its reported free memory.
* Algorithm 1 and phases 1 and 2 agree with a direct, slow reading of SPEC §6.
* Split reads: both sides' read times differ by at most one block, and no split is better.
* Batching never exceeds the quota except for a single minimum chunk, cuts the overflowing
  request as long as it can, and loses no token.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath.scheduler import (
    READ_PATHS,
    SCHEDULER_NAMES,
    DualPathScheduler,
    EngineRole,
    FittedAttentionTimePredictor,
    PrefillBatcher,
    PrefillWork,
    SplitLoadPlanner,
    make_scheduler,
    pack_prefill_batch,
)
from tests.scheduler.factories import (
    BLOCK_SIZE_TOKENS,
    make_config,
    make_engine,
    make_group_snapshot,
    make_request,
    make_topology,
)

BETA_TOKENS = 1000
ALPHA_TOKENS = 100

requests_strategy = st.lists(
    st.tuples(
        st.integers(1, 600),  # prompt tokens
        st.integers(0, 40),  # hit blocks (capped at the prompt)
        st.integers(0, 200),  # max output tokens
    ),
    min_size=1,
    max_size=30,
)


def _request(request_id, spec):
    prompt_tokens, hit_blocks, output_tokens = spec
    cached_tokens = min(
        hit_blocks * BLOCK_SIZE_TOKENS, prompt_tokens // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
    )
    return make_request(
        request_id,
        num_prompt_tokens=prompt_tokens,
        num_cached_tokens=cached_tokens,
        max_num_output_tokens=output_tokens,
    )


def _random_snapshot(data, topology, group):
    engines = [
        make_engine(
            engine_id,
            num_seqs=data.draw(st.integers(0, 5)),
            num_tokens=data.draw(st.integers(0, 2 * BETA_TOKENS)),
            num_free_kv_blocks=data.draw(st.integers(0, 60)),
        )
        for engine_id in group.engine_ids
    ]
    read_queue_tokens = [data.draw(st.integers(0, 3 * ALPHA_TOKENS)) for _ in group.node_ids]
    return make_group_snapshot(
        topology, group.group_id, engines=engines, read_queue_tokens=read_queue_tokens
    )


def _idle_snapshot(topology, group):
    engines = [make_engine(e, num_free_kv_blocks=10**6) for e in group.engine_ids]
    return make_group_snapshot(topology, group.group_id, engines=engines)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    scheduler_name=st.sampled_from(SCHEDULER_NAMES),
    read_path=st.sampled_from(READ_PATHS),
    nodes_per_group=st.integers(1, 2),
    engines_per_node=st.integers(1, 3),
    request_specs=requests_strategy,
)
def test_no_request_is_lost_or_placed_twice_and_memory_is_respected(
    data, scheduler_name, read_path, nodes_per_group, engines_per_node, request_specs
):
    topology = make_topology(
        num_prefill_nodes=nodes_per_group * data.draw(st.integers(1, 2)),
        num_decode_nodes=nodes_per_group * data.draw(st.integers(1, 3)),
        engines_per_node=engines_per_node,
        nodes_per_group=nodes_per_group,
    )
    config = make_config(scheduler=scheduler_name, read_path=read_path)
    scheduler = make_scheduler(config, topology)
    requests = [_request(i, spec) for i, spec in enumerate(request_specs)]
    groups = topology.groups
    prefill_engine_of: dict[int, int] = {}
    decode_engine_of: dict[int, int] = {}

    def check_prefill(group, result):
        assert set(result.prefill_engine_ids) <= set(group.engine_ids)
        for request_id, engine_id in zip(
            result.request_ids, result.prefill_engine_ids, strict=True
        ):
            assert request_id not in prefill_engine_of, f"request {request_id} placed twice"
            prefill_engine_of[request_id] = engine_id

    def check_decode(group, snapshot, result):
        blocks_placed: Counter[int] = Counter()
        for request_id, prefill_engine_id, decode_engine_id, plan in zip(
            result.request_ids,
            result.prefill_engine_ids,
            result.decode_engine_ids,
            result.load_plans,
            strict=True,
        ):
            assert prefill_engine_of.get(request_id) == prefill_engine_id
            assert request_id not in decode_engine_of, f"request {request_id} placed twice"
            decode_engine_of[request_id] = decode_engine_id
            request = requests[request_id]
            assert plan.num_hit_blocks * BLOCK_SIZE_TOKENS == request.num_cached_tokens
            blocks_placed[decode_engine_id] += -(-request.num_decode_tokens // BLOCK_SIZE_TOKENS)
        free = {engine.engine_id: engine.num_free_kv_blocks for engine in snapshot.engines}
        assert set(blocks_placed) <= set(group.engine_ids)
        for engine_id, num_blocks in blocks_placed.items():
            assert num_blocks <= free[engine_id], "a DE fetch overcommitted memory"

    def fetch(group, snapshot):
        if group.role == EngineRole.PREFILL:
            check_prefill(group, scheduler.fetch_prefill(snapshot))
        else:
            check_decode(group, snapshot, scheduler.fetch_decode(snapshot))

    num_submitted = 0
    for _ in range(data.draw(st.integers(0, 25))):
        if num_submitted < len(requests) and data.draw(st.booleans()):
            scheduler.submit(requests[num_submitted])
            num_submitted += 1
        group = data.draw(st.sampled_from(groups))
        fetch(group, _random_snapshot(data, topology, group))
        placed = set(prefill_engine_of)
        assert len(placed) + scheduler.num_waiting_prefill == num_submitted
        assert len(placed - set(decode_engine_of)) == scheduler.num_waiting_decode

    for request in requests[num_submitted:]:
        scheduler.submit(request)
    for _ in range(len(requests) + 1):  # idle engines with ample memory drain every queue
        if scheduler.num_waiting_prefill + scheduler.num_waiting_decode == 0:
            break
        for group in groups:
            fetch(group, _idle_snapshot(topology, group))
    assert sorted(decode_engine_of) == list(range(len(requests)))


def _reference_algorithm_1(tokens, is_short_queue, prompt_tokens):
    """SPEC §6 Algorithm 1, read literally: positions chosen, in FIFO order."""
    tokens = list(tokens)
    chosen = []
    for num_tokens in prompt_tokens:
        eligible = [p for p in range(len(tokens)) if tokens[p] <= BETA_TOKENS]
        category_a = [p for p in eligible if is_short_queue[p]]
        candidates = category_a or eligible
        if not candidates:
            break
        position = min(candidates, key=lambda p: (tokens[p], p))
        tokens[position] += num_tokens
        chosen.append(position)
    return chosen


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    nodes_per_group=st.integers(1, 3),
    engines_per_node=st.integers(1, 8),
    prompt_tokens=st.lists(st.integers(1, 700), min_size=1, max_size=25),
)
def test_algorithm_1_matches_a_direct_reading_of_spec(
    data, nodes_per_group, engines_per_node, prompt_tokens
):
    topology = make_topology(
        num_prefill_nodes=nodes_per_group,
        num_decode_nodes=nodes_per_group,
        engines_per_node=engines_per_node,
        nodes_per_group=nodes_per_group,
    )
    (group,) = topology.groups_of(EngineRole.PREFILL)
    tokens = [data.draw(st.integers(0, 1300)) for _ in group.engine_ids]
    read_queue_tokens = [data.draw(st.integers(0, 200)) for _ in group.node_ids]
    scheduler = DualPathScheduler(make_config(), topology)
    for request_id, num_tokens in enumerate(prompt_tokens):
        scheduler.submit(make_request(request_id, num_prompt_tokens=num_tokens))
    engines = [make_engine(e, num_tokens=t) for e, t in zip(group.engine_ids, tokens, strict=True)]
    snapshot = make_group_snapshot(
        topology, group.group_id, engines=engines, read_queue_tokens=read_queue_tokens
    )
    result = scheduler.fetch_prefill(snapshot)
    is_short_queue = [
        read_queue_tokens[p // engines_per_node] <= ALPHA_TOKENS for p in range(len(tokens))
    ]
    expected = _reference_algorithm_1(tokens, is_short_queue, prompt_tokens)
    assert result.prefill_engine_ids == tuple(group.engine_ids[p] for p in expected)
    assert result.request_ids == tuple(range(len(expected)))


def _reference_phase_2(seqs, tokens, free_blocks, decode_tokens, z_factor=1.05):
    """SPEC §6 phase 2, read literally: positions chosen, in queue order."""
    seqs, tokens, free_blocks = list(seqs), list(tokens), list(free_blocks)
    need = [-(-n // BLOCK_SIZE_TOKENS) for n in decode_tokens]
    num_r = 0
    while num_r < len(need) and sum(need[: num_r + 1]) <= sum(free_blocks):
        num_r += 1
    z_tokens = z_factor * (sum(decode_tokens[:num_r]) + sum(tokens)) / len(tokens)
    chosen = []
    for num_tokens, num_blocks in zip(decode_tokens, need, strict=True):
        with_room = [p for p in range(len(tokens)) if free_blocks[p] >= num_blocks]
        if not with_room:
            break
        under_z = [p for p in with_room if tokens[p] + num_tokens <= z_tokens]
        if under_z:
            position = min(under_z, key=lambda p: (seqs[p], tokens[p], p))
        else:
            position = min(with_room, key=lambda p: (tokens[p], p))
        seqs[position] += 1
        tokens[position] += num_tokens
        free_blocks[position] -= num_blocks
        chosen.append(position)
    return chosen


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    num_engines=st.integers(1, 16),  # 16: a group of two 8-GPU nodes
    decode_tokens=st.lists(st.integers(1, 400), min_size=1, max_size=20),
)
def test_decode_phase_2_matches_a_direct_reading_of_spec(data, num_engines, decode_tokens):
    topology = make_topology(num_prefill_nodes=1, num_decode_nodes=1, engines_per_node=num_engines)
    (group,) = topology.groups_of(EngineRole.DECODE)
    seqs = [data.draw(st.integers(0, 4)) for _ in range(num_engines)]
    tokens = [data.draw(st.integers(0, 800)) for _ in range(num_engines)]
    free_blocks = [data.draw(st.integers(0, 40)) for _ in range(num_engines)]
    scheduler = DualPathScheduler(make_config(beta_tokens=10**9), topology)
    for request_id, num_tokens in enumerate(decode_tokens):
        scheduler.submit(make_request(request_id, num_prompt_tokens=num_tokens))
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    engines = [
        make_engine(e, num_seqs=s, num_tokens=t, num_free_kv_blocks=f)
        for e, s, t, f in zip(group.engine_ids, seqs, tokens, free_blocks, strict=True)
    ]
    result = scheduler.fetch_decode(make_group_snapshot(topology, group.group_id, engines=engines))
    expected = _reference_phase_2(seqs, tokens, free_blocks, decode_tokens)
    assert result.decode_engine_ids == tuple(group.engine_ids[p] for p in expected)


@settings(max_examples=200, deadline=None)
@given(
    group_loads=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    prompt_tokens=st.lists(st.integers(1, 200), min_size=1, max_size=25),
)
def test_decode_phase_1_matches_a_direct_reading_of_spec(group_loads, prompt_tokens):
    """Each request, FIFO, to the DE group with the least Σ tok_e + Σ len_r queued, ties to
    the group listed first (loads drawn from a small range, so ties are common)."""
    topology = make_topology(
        num_prefill_nodes=1, num_decode_nodes=len(group_loads), nodes_per_group=1
    )
    decode_groups = topology.groups_of(EngineRole.DECODE)
    scheduler = DualPathScheduler(make_config(beta_tokens=10**9), topology)
    for group, load in zip(decode_groups, group_loads, strict=True):
        scheduler.report_decode_load(group.group_id, load)
    requests = [make_request(i, num_prompt_tokens=n) for i, n in enumerate(prompt_tokens)]
    for request in requests:
        scheduler.submit(request)
    scheduler.fetch_prefill(make_group_snapshot(topology, 0))
    loads = list(group_loads)
    expected: list[list[int]] = [[] for _ in decode_groups]
    for request in requests:
        index = min(range(len(loads)), key=lambda g: (loads[g], g))
        expected[index].append(request.request_id)
        loads[index] += request.num_decode_tokens
    for index, (group, load) in enumerate(zip(decode_groups, group_loads, strict=True)):
        # Each group reports the load it was given (the first fetch runs phase 1 for all)
        # and has room for everything, so phase 2 places its whole private queue.
        engines = [
            make_engine(e, num_tokens=load if i == 0 else 0, num_free_kv_blocks=10**6)
            for i, e in enumerate(group.engine_ids)
        ]
        result = scheduler.fetch_decode(
            make_group_snapshot(topology, group.group_id, engines=engines)
        )
        assert sorted(result.request_ids) == expected[index]


@settings(max_examples=500, deadline=None)
@given(
    num_hit_blocks=st.integers(0, 300),
    block_size_tokens=st.sampled_from([16, 64]),
    prefill_read_queue_tokens=st.integers(0, 10**6),
    decode_read_queue_tokens=st.integers(0, 10**6),
    prefill_rate=st.floats(1.0, 1e7),
    decode_rate=st.floats(1.0, 1e7),
)
def test_split_reads_finish_within_one_block_of_each_other(
    num_hit_blocks,
    block_size_tokens,
    prefill_read_queue_tokens,
    decode_read_queue_tokens,
    prefill_rate,
    decode_rate,
):
    plan = SplitLoadPlanner(block_size_tokens).plan(
        num_hit_blocks,
        prefill_read_queue_tokens,
        decode_read_queue_tokens,
        prefill_rate,
        decode_rate,
    )
    assert plan.num_prefill_side_blocks >= 0 and plan.num_decode_side_blocks >= 0
    assert plan.num_hit_blocks == num_hit_blocks

    def finish_times_s(k):
        return (
            (prefill_read_queue_tokens + k * block_size_tokens) / prefill_rate,
            (decode_read_queue_tokens + (num_hit_blocks - k) * block_size_tokens) / decode_rate,
        )

    prefill_s, decode_s = finish_times_s(plan.num_prefill_side_blocks)
    if plan.is_split:
        one_block_s = max(block_size_tokens / prefill_rate, block_size_tokens / decode_rate)
        assert abs(prefill_s - decode_s) <= one_block_s * (1 + 1e-9)
    best_s = min(max(finish_times_s(k)) for k in range(num_hit_blocks + 1))
    assert max(prefill_s, decode_s) <= best_s * (1 + 1e-12)


chunk_costs = st.tuples(
    st.sampled_from([0.0, 2.0**-30, 2.0**-24]),
    st.sampled_from([0.0, 2.0**-12, 2.0**-10]),
    st.sampled_from([0.0, 2.0**-8]),
    st.sampled_from([0.0, 2.0**-6]),
)
waiting_strategy = st.lists(
    st.tuples(st.integers(0, 20_000), st.integers(1, 3000)), min_size=1, max_size=15
)


@settings(max_examples=300, deadline=None)
@given(
    costs=chunk_costs,
    waiting_specs=waiting_strategy,
    quota_s=st.floats(0.01, 2.0),
    min_chunk_tokens=st.integers(1, 256),
)
def test_batches_stay_within_the_quota_except_for_one_minimum_chunk(
    costs, waiting_specs, quota_s, min_chunk_tokens
):
    predictor = FittedAttentionTimePredictor(*costs)
    waiting = [PrefillWork(i, cached, new) for i, (cached, new) in enumerate(waiting_specs)]
    batch = pack_prefill_batch(
        waiting, predictor, quota_s=quota_s, min_chunk_tokens=min_chunk_tokens
    )
    chunks = batch.chunks
    assert chunks, "a batch always makes progress"
    for chunk, work in zip(chunks, waiting, strict=False):  # a FIFO prefix
        assert (chunk.request_id, chunk.num_cached_tokens) == (
            work.request_id,
            work.num_cached_tokens,
        )
    assert all(
        c.num_new_tokens == w.num_new_tokens for c, w in zip(chunks[:-1], waiting, strict=False)
    )
    pairs = [(c.num_cached_tokens, c.num_new_tokens) for c in chunks]
    assert batch.predicted_attention_time_s == predictor.predict_s(pairs)
    if batch.predicted_attention_time_s > quota_s:
        (only,) = chunks
        assert only.num_new_tokens == min(min_chunk_tokens, waiting[0].num_new_tokens)
        return
    last, last_work = chunks[-1], waiting[len(chunks) - 1]
    if not last.is_last_chunk:  # cut as long as the quota allows
        longer = [*pairs[:-1], (last.num_cached_tokens, last.num_new_tokens + 1)]
        assert predictor.predict_s(longer) > quota_s
        assert last.num_new_tokens >= min_chunk_tokens
    elif len(chunks) < len(waiting):  # the next request could not add a minimum chunk
        following = waiting[len(chunks)]
        smallest = min(min_chunk_tokens, following.num_new_tokens)
        assert predictor.predict_s([*pairs, (following.num_cached_tokens, smallest)]) > quota_s
    assert last.num_new_tokens <= last_work.num_new_tokens


@settings(max_examples=100, deadline=None)
@given(costs=chunk_costs, waiting_specs=waiting_strategy, quota_s=st.floats(0.01, 2.0))
def test_the_batcher_computes_every_new_token_exactly_once(costs, waiting_specs, quota_s):
    batcher = PrefillBatcher(
        FittedAttentionTimePredictor(*costs), quota_s=quota_s, min_chunk_tokens=64
    )
    for request_id, (cached, new) in enumerate(waiting_specs):
        batcher.add(PrefillWork(request_id, cached, new))
    next_cached = {i: cached for i, (cached, _) in enumerate(waiting_specs)}
    finished = []
    while batcher.num_waiting:
        for chunk in batcher.next_batch().chunks:
            assert chunk.num_cached_tokens == next_cached[chunk.request_id]
            next_cached[chunk.request_id] += chunk.num_new_tokens
            if chunk.is_last_chunk:
                finished.append(chunk.request_id)
    assert finished == list(range(len(waiting_specs)))
    for request_id, (cached, new) in enumerate(waiting_specs):
        assert next_cached[request_id] == cached + new

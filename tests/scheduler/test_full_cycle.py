"""One request through the whole policy, as the runtime or the simulator drives it."""

from __future__ import annotations

from dualpath.scheduler import (
    ConstantAttentionTimePredictor,
    DecodeAssignment,
    LoadPlan,
    PrefillBatcher,
    PrefillChunk,
    PrefillWork,
    SchedulerRequest,
    make_scheduler,
)
from tests.scheduler.factories import make_config, make_engine, make_group_snapshot, make_topology


def test_submit_prefill_fetch_decode_fetch_then_batch_on_the_prefill_engine():
    # PE node 0 (engines 0, 1), DE node 1 (engines 2, 3); blocks of 16 tokens.
    topology = make_topology()
    config = make_config(read_path="split", attention_quota_s=0.25, min_prefill_chunk_tokens=16)
    scheduler = make_scheduler(config, topology)
    scheduler.submit(
        SchedulerRequest(7, num_prompt_tokens=400, num_cached_tokens=320, max_num_output_tokens=32)
    )

    prefill_snapshot = make_group_snapshot(
        topology,
        0,
        engines=[make_engine(0, num_tokens=500), make_engine(1)],
        read_queue_tokens=[64],
    )
    placed = scheduler.fetch_prefill(prefill_snapshot)
    assert (placed.request_ids, placed.prefill_engine_ids) == ((7,), (1,))

    decode_snapshot = make_group_snapshot(
        topology,
        1,
        engines=[make_engine(2, num_free_kv_blocks=27), make_engine(3, num_free_kv_blocks=26)],
        read_queue_tokens=[0],
    )
    final = scheduler.fetch_decode(decode_snapshot)
    # 20 hit blocks, queues 64 vs 0 tokens at equal rates: 8 blocks on the PE side and 12 on
    # the DE side both finish at 192 tokens. len_r = 432 tokens needs 27 blocks: only e2.
    assert final.assignments() == (
        DecodeAssignment(7, prefill_engine_id=1, decode_engine_id=2, load_plan=LoadPlan(8, 12)),
    )

    batcher = PrefillBatcher.from_config(config, ConstantAttentionTimePredictor(2.0**-9))
    batcher.add(PrefillWork(7, num_cached_tokens=320, num_new_tokens=80))
    assert batcher.next_batch().chunks == (PrefillChunk(7, 320, 80, True),)

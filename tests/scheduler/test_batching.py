"""Compute-quota batching (SPEC §6): FIFO packing, binary-search chunking, remainders.

Costs are powers of two so that every predicted time below is exact in floating point.
"""

from __future__ import annotations

import pytest

from dualpath.scheduler import (
    ConstantAttentionTimePredictor,
    FittedAttentionTimePredictor,
    PrefillBatch,
    PrefillBatcher,
    PrefillChunk,
    PrefillWork,
    SchedulerConfig,
    pack_prefill_batch,
)

TOKEN_S = 2.0**-10  # seconds per new token of the constant predictor
QUOTA_S = 300 * TOKEN_S  # 300 tokens per batch
PER_TOKEN = ConstantAttentionTimePredictor(seconds_per_new_token=TOKEN_S)


def _pack(waiting, predictor=PER_TOKEN, *, quota_s=QUOTA_S, min_chunk_tokens=16):
    return pack_prefill_batch(
        waiting, predictor, quota_s=quota_s, min_chunk_tokens=min_chunk_tokens
    )


def test_fifo_packing_cuts_the_request_that_overflows():
    waiting = [PrefillWork(1, 0, 100), PrefillWork(2, 64, 150), PrefillWork(3, 0, 200)]
    assert _pack(waiting) == PrefillBatch(
        chunks=(
            PrefillChunk(request_id=1, num_cached_tokens=0, num_new_tokens=100, is_last_chunk=True),
            PrefillChunk(2, 64, 150, True),
            PrefillChunk(3, 0, 50, False),  # 250 + 50 = 300 tokens: exactly the quota
        ),
        predicted_attention_time_s=QUOTA_S,
    )


def test_binary_search_finds_the_longest_chunk_under_a_quadratic_cost():
    # Cost = Σ new x (cached + new/2) pairs x 2^-20 s. With 1,000 cached tokens, a chunk of
    # 1,000 new tokens is 1.5M pairs; make that the quota exactly: 1,001 would be over.
    predictor = FittedAttentionTimePredictor(2.0**-20, 0.0, 0.0, 0.0)
    quota_s = 1_500_000 * 2.0**-20
    batch = _pack([PrefillWork(5, 1000, 4000)], predictor, quota_s=quota_s)
    assert batch.chunks == (PrefillChunk(5, 1000, 1000, False),)
    assert batch.predicted_attention_time_s == quota_s


def test_a_cut_shorter_than_the_minimum_chunk_waits_for_the_next_batch():
    waiting = [PrefillWork(i, 0, 40) for i in range(10)]
    # 7 x 40 = 280 tokens fit; the eighth request could add only 20 tokens.
    assert [c.num_new_tokens for c in _pack(waiting, min_chunk_tokens=16).chunks] == [40] * 7 + [20]
    assert [c.num_new_tokens for c in _pack(waiting, min_chunk_tokens=32).chunks] == [40] * 7


def test_only_a_single_minimum_chunk_may_exceed_the_quota():
    # The per-batch overhead alone fills the quota: nothing fits, so the head gets exactly one
    # minimum chunk and the batch ends there.
    predictor = ConstantAttentionTimePredictor(
        seconds_per_new_token=TOKEN_S, seconds_per_batch=QUOTA_S
    )
    batch = _pack([PrefillWork(1, 0, 500), PrefillWork(2, 0, 10)], predictor)
    assert batch.chunks == (PrefillChunk(1, 0, 16, False),)
    assert batch.predicted_attention_time_s == QUOTA_S + 16 * TOKEN_S
    # A remainder shorter than the minimum chunk is taken whole.
    assert _pack([PrefillWork(1, 0, 9)], predictor).chunks == (PrefillChunk(1, 0, 9, True),)


def test_nothing_waiting_gives_an_empty_batch():
    assert _pack([]) == PrefillBatch(chunks=(), predicted_attention_time_s=0.0)


def test_batcher_carries_the_remainder_as_chunked_prefill():
    batcher = PrefillBatcher(PER_TOKEN, quota_s=QUOTA_S, min_chunk_tokens=16)
    batcher.add(PrefillWork(1, 0, 100))
    batcher.add(PrefillWork(2, 0, 700))
    batcher.add(PrefillWork(3, 128, 50))
    batches = [batcher.next_batch().chunks for _ in range(4)]
    assert batches == [
        (PrefillChunk(1, 0, 100, True), PrefillChunk(2, 0, 200, False)),
        (PrefillChunk(2, 200, 300, False),),  # the chunk already computed counts as cached
        (PrefillChunk(2, 500, 200, True), PrefillChunk(3, 128, 50, True)),
        (),
    ]
    assert batcher.num_waiting == 0


def test_batcher_from_config_uses_the_quota_and_minimum_chunk():
    config = SchedulerConfig(attention_quota_s=QUOTA_S, min_prefill_chunk_tokens=32)
    batcher = PrefillBatcher.from_config(config, PER_TOKEN)
    for request_id in range(10):
        batcher.add(PrefillWork(request_id, 0, 40))
    assert [c.num_new_tokens for c in batcher.next_batch().chunks] == [40] * 7


def test_aligned_cuts_end_on_a_block_boundary():
    # 300 tokens fit; with 64-token blocks the head is cut to 256, never 300.
    batcher = PrefillBatcher(PER_TOKEN, quota_s=QUOTA_S, min_chunk_tokens=64, chunk_align_tokens=64)
    batcher.add(PrefillWork(1, 128, 700))
    batches = [batcher.next_batch().chunks for _ in range(4)]
    assert batches == [
        (PrefillChunk(1, 128, 256, False),),
        (PrefillChunk(1, 384, 256, False),),
        (PrefillChunk(1, 640, 188, True),),  # the last chunk takes the unaligned rest
        (),
    ]
    # Unaligned, the same quota cuts at 300 tokens.
    assert _pack([PrefillWork(1, 128, 700)]).chunks == (PrefillChunk(1, 128, 300, False),)


def test_remove_drops_a_waiting_request_even_mid_chunking():
    batcher = PrefillBatcher(PER_TOKEN, quota_s=QUOTA_S, min_chunk_tokens=16)
    batcher.add(PrefillWork(1, 0, 400))
    batcher.add(PrefillWork(2, 0, 50))
    assert batcher.next_batch().chunks == (PrefillChunk(1, 0, 300, False),)
    assert batcher.remove(1)
    assert not batcher.remove(1)
    assert batcher.next_batch().chunks == (PrefillChunk(2, 0, 50, True),)
    assert batcher.num_waiting == 0


def test_pack_rejects_bad_limits():
    with pytest.raises(ValueError, match="multiple of chunk_align_tokens"):
        PrefillBatcher(PER_TOKEN, quota_s=QUOTA_S, min_chunk_tokens=16, chunk_align_tokens=64)
    with pytest.raises(ValueError, match="quota_s"):
        _pack([PrefillWork(1, 0, 1)], quota_s=0.0)
    with pytest.raises(ValueError, match="num_new_tokens > 0"):
        PrefillWork(1, 0, 0)

"""Profile one decoder layer of a PE's model and fit the batcher's time predictor (SPEC §6).

The compute-quota batcher needs the time of one layer for a batch of ``(num_cached_tokens,
num_new_tokens)`` chunks. A PE measures it once at start-up, on its own device and threads,
for a small grid of batches, and fits ``FittedAttentionTimePredictor`` (non-negative least
squares, so the prediction grows with the work). We time the whole layer -- attention and MLP --
because that is what a batch waits for; on a GPU the attention share dominates at long
contexts, which the fitted quadratic term captures.

    predictor = profile_layer_time(model, device=device, max_context_tokens=2048)
"""

from __future__ import annotations

import statistics
import time

import torch

from dualpath.model.layerwise import LayerwiseModel, PackedBatch
from dualpath.scheduler.attention_predictor import (
    AttentionProfileSample,
    FittedAttentionTimePredictor,
)

# (num_cached_tokens, num_new_tokens) per chunk, as fractions of the profiled context: short
# and long chunks, with and without a cached prefix, one and two chunks per batch.
_GRID = (
    ((0.0, 1 / 16),),
    ((0.0, 1 / 4),),
    ((0.0, 1 / 2),),
    ((1 / 2, 1 / 8),),
    ((3 / 4, 1 / 4),),
    ((0.0, 1 / 8), (1 / 4, 1 / 8)),
    ((1 / 2, 1 / 4), (0.0, 1 / 16)),
)


def profile_batches(max_context_tokens: int) -> list[tuple[tuple[int, int], ...]]:
    """The profiled batches: ``(num_cached_tokens, num_new_tokens)`` per chunk, the grid's
    fractions of ``max_context_tokens`` (every engine kind profiles the same ones)."""
    return [
        tuple(
            (int(cached * max_context_tokens), max(1, int(new * max_context_tokens)))
            for cached, new in fractions
        )
        for fractions in _GRID
    ]


@torch.inference_mode()
def profile_layer_time(
    model: LayerwiseModel,
    *,
    device: torch.device,
    max_context_tokens: int,
    num_repeats: int = 3,
) -> FittedAttentionTimePredictor:
    """Fit the layer-time predictor from timed forwards of layer 0 (median of ``num_repeats``
    each, after one warm-up) over a grid of batches up to ``max_context_tokens``."""
    if max_context_tokens < 16:
        raise ValueError(f"max_context_tokens must be >= 16, got {max_context_tokens}")
    config = model.config
    dtype = model.model.embed_tokens.weight.dtype
    samples = []
    for chunks in profile_batches(max_context_tokens):
        batch = PackedBatch(
            num_cached_tokens=tuple(c for c, _ in chunks),
            num_new_tokens=tuple(n for _, n in chunks),
        )
        hidden = torch.randn(sum(n for _, n in chunks), config.hidden_size, device=device).to(dtype)
        rope = model.rope(batch.positions(device))
        entry_shape = model.cache_entry_shape
        past = [torch.randn(c, *entry_shape, device=device).to(dtype) for c, _ in chunks]
        times_s = [_time_layer(model, hidden, rope, batch, past) for _ in range(num_repeats + 1)]
        samples.append(AttentionProfileSample(chunks, statistics.median(times_s[1:])))
    return FittedAttentionTimePredictor.fit(samples)


def _time_layer(model, hidden, rope, batch, past) -> float:
    device = hidden.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    model.forward_layer(0, hidden, rope, batch, past)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start

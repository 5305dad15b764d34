"""Sampling parameters and the sampler (greedy, seeded temperature / top-k / top-p)."""

from __future__ import annotations

import torch

from dualpath.types import SamplingParams, TokenLogprob

__all__ = ["SamplingParams", "TokenLogprob", "make_generator", "sample"]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.is_greedy:
        return None
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    banned_token_ids: tuple[int, ...] = (),
) -> tuple[int, TokenLogprob | None]:
    """Pick one token from a float32 CPU logits row ``[vocab]``; optionally its logprobs."""
    if banned_token_ids:
        logits = logits.clone()
        logits[list(banned_token_ids)] = float("-inf")
    if params.is_greedy:
        token_id = int(torch.argmax(logits))
    else:
        token_id = _sample_random(logits, params, generator)
    if params.logprobs is None:
        return token_id, None
    logprobs = torch.log_softmax(logits, dim=-1)
    top = ()
    if params.logprobs:
        values, ids = torch.topk(logprobs, params.logprobs)
        top = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return token_id, TokenLogprob(token_id, float(logprobs[token_id]), top)


def _sample_random(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(sorted_ids[choice])
    return int(torch.multinomial(probs, 1, generator=generator))

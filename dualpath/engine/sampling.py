"""Sampling parameters and the sampler (greedy, seeded temperature / top-k / top-p).

The sampler never raises on what a request asked for: probabilities it cannot draw from
(every token banned or filtered out, an underflow, NaN logits) fall back to the argmax of the
logits, so one request's values cannot take an engine down.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from dualpath.types import SamplingParams, TokenLogprob

__all__ = [
    "SamplingParams",
    "TokenLogprob",
    "banned_token_ids",
    "make_generator",
    "next_generator",
    "sample",
    "token_finish_reason",
]

logger = logging.getLogger(__name__)


def make_generator(params: SamplingParams, num_output_tokens: int = 0) -> torch.Generator | None:
    """The random source for a request's output token ``num_output_tokens`` (None: greedy).

    A seeded request draws each output token from a generator seeded by (seed, its index), not
    from one stream: any engine samples token i the same way, whoever sampled the tokens before
    it (the PE samples the first, a DE the rest, and after the loss of its DE a request goes on
    from any token on another). Unseeded, a fresh random one (the caller may keep it)."""
    if params.is_greedy:
        return None
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(_token_seed(params.seed, num_output_tokens))
    return gen


def next_generator(
    params: SamplingParams, num_output_tokens: int, kept: torch.Generator | None
) -> torch.Generator | None:
    """The generator for the next output token: ``kept`` (one made once per request) unless
    the request is seeded, when each token has its own (``make_generator``)."""
    if params.seed is None:
        return kept
    return make_generator(params, num_output_tokens)


def _token_seed(seed: int, index: int) -> int:
    """A 64-bit seed for output token ``index`` of a request seeded with ``seed`` (SplitMix64's
    mix of seed + index x golden ratio: neighbouring indices give unrelated seeds)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def banned_token_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Iterable[int]
) -> tuple[int, ...]:
    """Tokens that may not be sampled next: end-of-sequence and stop tokens until the request
    has ``min_tokens`` (the same rule for the first token, on the PE, as for the rest)."""
    if num_output_tokens >= params.min_tokens:
        return ()
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return eos + params.stop_token_ids


def token_finish_reason(
    params: SamplingParams, token_id: int, num_output_tokens: int, eos_token_ids: Iterable[int]
) -> str | None:
    """Why output token ``num_output_tokens`` (0-based), ``token_id``, ends the request, if it
    does: "stop" for a stop or end-of-sequence token, "length" at ``max_tokens``. Stop
    strings need the text: the caller checks them."""
    if token_id in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if num_output_tokens + 1 >= params.max_tokens:
        return "length"
    return None


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    banned_token_ids: tuple[int, ...] = (),
) -> tuple[int, TokenLogprob | None]:
    """Pick one token from a float32 CPU logits row ``[vocab]``; optionally its logprobs.

    Banned ids outside the row are ignored; if every token is banned, the ban is lifted.
    """
    banned = [t for t in banned_token_ids if 0 <= t < logits.numel()]
    if banned and len(set(banned)) < logits.numel():
        logits = logits.clone()
        logits[banned] = float("-inf")
    token_id = _argmax(logits) if params.is_greedy else _sample_random(logits, params, generator)
    if params.logprobs is None:
        return token_id, None
    logprobs = torch.log_softmax(logits, dim=-1)
    top = ()
    if params.logprobs:
        values, ids = torch.topk(logprobs, min(params.logprobs, logprobs.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return token_id, TokenLogprob(token_id, float(logprobs[token_id]), top)


def _argmax(logits: torch.Tensor) -> int:
    token_id = int(torch.argmax(logits))
    if torch.isnan(logits[token_id]):  # argmax takes NaN for the largest: only then a copy
        token_id = int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))
    return token_id


def _sample_random(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    ids = None
    if params.top_p < 1.0:
        probs, ids = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays
        # (top_p may round to 0 in float32).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False
        probs = probs.masked_fill(drop, 0.0)
    total = float(probs.sum())
    if not (total > 0 and torch.isfinite(probs).all()):
        logger.warning("unusable sampling probabilities (sum %s): taking the argmax", total)
        return _argmax(logits)
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return choice if ids is None else int(ids[choice])

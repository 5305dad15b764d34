"""Sampling parameters and the sampler (greedy, seeded temperature / top-k / top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, per request (names as in vLLM and OpenAI)."""

    max_tokens: int = 16
    # 0 = greedy. Greedy output is identical whichever path the KV took (SPEC: correctness).
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # Seeds a per-request generator: the same seed and prompt give the same tokens.
    seed: int | None = None
    # Generate exactly max_tokens, ignoring end-of-sequence (benchmarks need exact lengths).
    ignore_eos: bool = False
    min_tokens: int = 0  # end-of-sequence and stop tokens are masked until this many exist
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Return this many top log-probabilities per generated token (0 = only the chosen one's).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first


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

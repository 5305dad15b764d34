"""Plain types shared across subsystems; imports nothing else from the package, nor torch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# Temperatures below this sample greedily, as vLLM treats them: dividing logits by a smaller
# one overflows float32 (below ~1e-38 every scaled logit is infinite) and means argmax anyway.
GREEDY_TEMPERATURE = 1e-5
# Integers cross process boundaries as msgpack, which holds at most 64 bits.
MAX_WIRE_INT = (1 << 63) - 1
MAX_TOKEN_ID = (1 << 31) - 1  # token ids are int32 in the paged cache and on the wire


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, per request (names as in vLLM and OpenAI)."""

    max_tokens: int = 16
    # 0 (or below GREEDY_TEMPERATURE) = greedy. Greedy output is identical whichever path the
    # KV took (SPEC: correctness).
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
        if not isinstance(self.max_tokens, int) or not 0 < self.max_tokens <= MAX_WIRE_INT:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_WIRE_INT:
            raise ValueError(f"top_k must be in [0, 2**63), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_WIRE_INT:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        bad = [t for t in self.stop_token_ids if not 0 <= t <= MAX_TOKEN_ID]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside [0, 2**31)")
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
        return self.temperature < GREEDY_TEMPERATURE


# vLLM's rule for a cache salt: it becomes part of store keys and of paths in some stores.
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN_CHARS = "@/\\\0"


@dataclass(frozen=True, slots=True)
class RequestScope:
    """Who a request belongs to beyond its tokens.

    ``cache_salt``: the tenant namespace its KV is keyed in; a request reads only blocks
    written under the same salt (None: the shared namespace). ``session_id``: the agent
    session it continues (None: none named).
    """

    cache_salt: str | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)


def check_cache_salt(cache_salt: object) -> None:
    """``ValueError`` unless ``cache_salt`` is None or a salt vLLM would also take."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt must be a non-empty string if given")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS or not set(CACHE_SALT_FORBIDDEN_CHARS).isdisjoint(
        cache_salt
    ):
        raise ValueError(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters and must not "
            "contain '@', '/', '\\' or NUL"
        )


NO_SCOPE = RequestScope()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first


def sampling_params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """A plain dict for the control channel (``SamplingParams(**d)`` rebuilds it)."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def sampling_params_from_dict(fields: dict[str, Any]) -> SamplingParams:
    """Inverse of ``sampling_params_to_dict``; ``ValueError`` for unknown or bad fields."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown sampling fields {unknown}")
    values = dict(fields)
    for name in ("stop", "stop_token_ids"):
        if name in values:
            values[name] = tuple(values[name])
    return SamplingParams(**values)

"""Random token ids for workloads: ordinary vocabulary ids, special tokens left out.

Random ids stand in for text: the engine's prefix cache only compares ids, so what matters is
that equal content gives equal ids and different content different ids (with overwhelming
probability: two random 16-token runs from a 32K vocabulary collide with odds of 2**-240).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def allowed_token_ids(vocab_size: int, avoid_token_ids: Iterable[int] = ()) -> np.ndarray:
    """The ids in ``[0, vocab_size)`` not in ``avoid_token_ids``, sorted (int32).

    Ids to avoid that lie outside the vocabulary are ignored (a tokenizer's added special
    tokens may sit above the model's vocabulary); ``ValueError`` if nothing is left.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    avoid = np.fromiter((int(t) for t in avoid_token_ids), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), avoid).astype(np.int32)
    if allowed.size == 0:
        raise ValueError(f"every id of a {vocab_size}-token vocabulary is avoided")
    return allowed


def random_token_ids(rng: np.random.Generator, num_tokens: int, allowed: np.ndarray) -> np.ndarray:
    """``num_tokens`` ids drawn uniformly from ``allowed`` (int32)."""
    return allowed[rng.integers(0, allowed.size, num_tokens)]

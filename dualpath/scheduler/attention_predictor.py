"""Predicted time of one attention layer for a PE batch, the input of compute-quota batching.

SPEC §6: attention must take the same time on every GPU of an expert-parallel group, so each
PE packs batches up to a time quota. A batch is a list of ``(num_cached_tokens,
num_new_tokens)`` pairs, one per request chunk. ``FittedAttentionTimePredictor`` is fitted
from profiled samples; ``ConstantAttentionTimePredictor`` gives hand-computable times for
tests and quick simulations.

Features of the fitted model, per batch (our choice; SPEC says only "fitted from profiling"):

* Σ new·(cached + new/2) -- query-key pairs of causal attention over the cached prefix plus
  the chunk itself: the FLOPs of QK^T and PV;
* Σ new -- per-token work that does not grow with context (softmax rows, KV writes);
* the number of chunks -- per-sequence metadata and kernel tiles;
* 1 -- launch overhead.

The fit is non-negative least squares, so that adding work never lowers the prediction: the
batcher's searches rely on that monotonicity.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

NUM_FEATURES = 4


class AttentionTimePredictor(Protocol):
    """Seconds of one attention layer for a batch; pure, may be called any number of times."""

    def predict_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Predicted seconds for ``(num_cached_tokens, num_new_tokens)`` chunks; 0.0 if empty."""
        ...


@dataclass(frozen=True, slots=True)
class ConstantAttentionTimePredictor:
    """A fixed cost per new token plus a fixed cost per non-empty batch."""

    seconds_per_new_token: float
    seconds_per_batch: float = 0.0

    def __post_init__(self) -> None:
        if self.seconds_per_new_token < 0 or self.seconds_per_batch < 0:
            raise ValueError(
                f"costs must be >= 0, got {self.seconds_per_new_token} per token and "
                f"{self.seconds_per_batch} per batch"
            )

    def predict_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        return self.seconds_per_batch + self.seconds_per_new_token * sum(n for _, n in chunks)


@dataclass(frozen=True, slots=True)
class AttentionProfileSample:
    """One profiled batch: its chunks and the measured time of one attention layer."""

    chunks: tuple[tuple[int, int], ...]
    attention_time_s: float

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError("a profile sample needs at least one chunk")
        if self.attention_time_s < 0:
            raise ValueError(f"attention_time_s must be >= 0, got {self.attention_time_s}")


@dataclass(frozen=True, slots=True)
class FittedAttentionTimePredictor:
    """Linear in the module docstring's four features, with non-negative coefficients."""

    seconds_per_attended_pair: float  # x Σ new*(cached + new/2)
    seconds_per_new_token: float  # x Σ new
    seconds_per_chunk: float  # x number of chunks
    seconds_per_batch: float  # once per non-empty batch

    def predict_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        num_pairs, num_new_tokens, num_chunks, _ = _features(chunks)
        return (
            self.seconds_per_attended_pair * num_pairs
            + self.seconds_per_new_token * num_new_tokens
            + self.seconds_per_chunk * num_chunks
            + self.seconds_per_batch
        )

    @classmethod
    def fit(cls, samples: Sequence[AttentionProfileSample]) -> FittedAttentionTimePredictor:
        """Non-negative least squares over ``samples``, by trying every subset of features.

        With four features, the best non-negative solution is the best of the unconstrained
        fits on the 16 feature subsets whose coefficients come out non-negative. A subset
        whose columns are linearly dependent (e.g. one chunk per sample makes the chunk count
        equal the constant) is skipped; a smaller subset covers it. Ties keep the earlier
        subset, so the fit is deterministic.
        """
        if not samples:
            raise ValueError("fitting needs at least one profile sample")
        rows = [_features(sample.chunks) for sample in samples]
        times_s = [sample.attention_time_s for sample in samples]
        best_coefficients = [0.0] * NUM_FEATURES
        best_residual = math.fsum(t * t for t in times_s)
        for size in range(1, NUM_FEATURES + 1):
            for subset in itertools.combinations(range(NUM_FEATURES), size):
                columns = [[row[j] for row in rows] for j in subset]
                solution = _least_squares(columns, times_s)
                if solution is None or min(solution) < 0:
                    continue
                residual = math.fsum(
                    (t - math.fsum(c * col[i] for c, col in zip(solution, columns, strict=True)))
                    ** 2
                    for i, t in enumerate(times_s)
                )
                if residual < best_residual:
                    best_residual = residual
                    best_coefficients = [0.0] * NUM_FEATURES
                    for j, coefficient in zip(subset, solution, strict=True):
                        best_coefficients[j] = coefficient
        return cls(*best_coefficients)


def _features(chunks: Sequence[tuple[int, int]]) -> tuple[float, int, int, int]:
    num_pairs = 0.0
    num_new_tokens = 0
    for num_cached_tokens, num_new in chunks:
        num_pairs += num_new * (num_cached_tokens + num_new / 2)
        num_new_tokens += num_new
    return num_pairs, num_new_tokens, len(chunks), 1


def _least_squares(columns: list[list[float]], targets: list[float]) -> list[float] | None:
    """argmin |A x - y| for A given by ``columns``; None when they are linearly dependent.

    Modified Gram-Schmidt QR, then back substitution: better conditioned than the normal
    equations, and the features span many orders of magnitude.
    """
    num_columns = len(columns)
    q_columns: list[list[float]] = []
    r = [[0.0] * num_columns for _ in range(num_columns)]
    for j, column in enumerate(columns):
        v = list(column)
        norm = math.sqrt(math.fsum(x * x for x in v))
        for i, q in enumerate(q_columns):
            r[i][j] = math.fsum(a * b for a, b in zip(q, v, strict=True))
            v = [a - r[i][j] * b for a, b in zip(v, q, strict=True)]
        r[j][j] = math.sqrt(math.fsum(x * x for x in v))
        if norm == 0 or r[j][j] <= 1e-9 * norm:
            return None
        q_columns.append([x / r[j][j] for x in v])
    qty = [math.fsum(a * b for a, b in zip(q, targets, strict=True)) for q in q_columns]
    solution = [0.0] * num_columns
    for i in reversed(range(num_columns)):
        tail = math.fsum(r[i][k] * solution[k] for k in range(i + 1, num_columns))
        solution[i] = (qty[i] - tail) / r[i][i]
    return solution

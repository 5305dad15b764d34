"""Intra-PE compute-quota batching (SPEC §6): FIFO packing under an attention-time quota.

A PE's waiting prefill work is packed, in FIFO order, while the predicted time of one
attention layer for the batch stays within the quota (300 ms on the paper's hardware). The
request that would overflow is cut by binary search on its new tokens, and its remainder runs as
chunked prefill in a later batch, where the chunk already computed counts as cached:

    request: | cached (hit) | chunk in batch t | remainder, batch t+1 ... |
                              ^ num_cached_tokens of the remainder moves here

The only overrun allowed: a batch whose first request cannot fit even one minimum chunk holds
exactly that chunk (``min_chunk_tokens``, or the whole rest if it is shorter), so every batch
makes progress. The searches assume the predictor is monotone (more work never predicts less
time; the fitted predictor guarantees it) and never accept a batch they have not predicted.

A cut may be aligned (``chunk_align_tokens``): an engine whose KV moves in Full Blocks cuts at
block boundaries, so that every chunk but the last fills whole blocks and the next chunk starts
on a fresh one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dualpath.config import SchedulerConfig
from dualpath.scheduler.attention_predictor import AttentionTimePredictor


@dataclass(frozen=True, slots=True, init=False)
class PrefillWork:
    """A request's prefill still to do on its PE."""

    request_id: int
    num_cached_tokens: int  # KV already there: the hit plus chunks computed earlier
    num_new_tokens: int  # tokens still to compute; > 0

    def __init__(self, request_id: int, num_cached_tokens: int, num_new_tokens: int) -> None:
        if num_cached_tokens < 0 or num_new_tokens <= 0:
            raise ValueError(
                f"request {request_id}: need num_cached_tokens >= 0 and "
                f"num_new_tokens > 0, got {num_cached_tokens} and {num_new_tokens}"
            )
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "num_cached_tokens", num_cached_tokens)
        object.__setattr__(self, "num_new_tokens", num_new_tokens)


@dataclass(frozen=True, slots=True, init=False)
class PrefillChunk:
    """How many new tokens of one request a batch computes."""

    request_id: int
    num_cached_tokens: int  # context before this chunk
    num_new_tokens: int  # computed in this batch
    is_last_chunk: bool  # the prompt is complete after this batch

    def __init__(
        self, request_id: int, num_cached_tokens: int, num_new_tokens: int, is_last_chunk: bool
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "num_cached_tokens", num_cached_tokens)
        object.__setattr__(self, "num_new_tokens", num_new_tokens)
        object.__setattr__(self, "is_last_chunk", is_last_chunk)


@dataclass(frozen=True, slots=True, init=False)
class PrefillBatch:
    """One PE batch; ``chunks`` in FIFO order, at most the last one cut."""

    chunks: tuple[PrefillChunk, ...]
    predicted_attention_time_s: float

    def __init__(self, chunks: tuple[PrefillChunk, ...], predicted_attention_time_s: float) -> None:
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "predicted_attention_time_s", predicted_attention_time_s)


def pack_prefill_batch(
    waiting: Sequence[PrefillWork],
    predictor: AttentionTimePredictor,
    *,
    quota_s: float,
    min_chunk_tokens: int,
    chunk_align_tokens: int = 1,
) -> PrefillBatch:
    """The next batch from ``waiting`` (FIFO); pure, leaves ``waiting`` untouched.

    Whole requests are taken while the prediction stays within ``quota_s`` (galloping then
    binary search over the prefix length, O(k log k) predictions' work for k requests); the
    next request is cut to the most new tokens in ``[min_chunk_tokens, rest)`` that still fit,
    a multiple of ``chunk_align_tokens`` (which must divide ``min_chunk_tokens``).
    """
    _check_quota(quota_s, min_chunk_tokens, chunk_align_tokens)
    align = chunk_align_tokens
    # (The predicates call a module-level _fits, not a nested function: compiled with mypyc,
    # a nested function that a lambda calls and the lambda's environment reference each
    # other, a cycle per batch that the simulator's run, collector off, would keep.)
    num_whole = _largest_fitting_prefix(
        len(waiting), lambda k: _fits(waiting, predictor, quota_s, k)
    )
    chunks = [
        PrefillChunk(work.request_id, work.num_cached_tokens, work.num_new_tokens, True)
        for work in waiting[:num_whole]
    ]
    if num_whole < len(waiting):
        work = waiting[num_whole]
        num_units = _most_tokens_fitting(
            min_chunk_tokens // align,
            (work.num_new_tokens - 1) // align,
            lambda n: _fits(waiting, predictor, quota_s, num_whole, n * align),
        )
        cut_tokens = None if num_units is None else num_units * align
        if cut_tokens is None and num_whole == 0:
            cut_tokens = min(min_chunk_tokens, work.num_new_tokens)  # the one allowed overrun
        if cut_tokens is not None:
            chunks.append(
                PrefillChunk(
                    work.request_id,
                    work.num_cached_tokens,
                    cut_tokens,
                    cut_tokens == work.num_new_tokens,
                )
            )
    batch_pairs = [(chunk.num_cached_tokens, chunk.num_new_tokens) for chunk in chunks]
    return PrefillBatch(tuple(chunks), predictor.predict_s(batch_pairs))


def _fits(
    waiting: Sequence[PrefillWork],
    predictor: AttentionTimePredictor,
    quota_s: float,
    num_whole: int,
    cut_tokens: int | None = None,
) -> bool:
    """Whether the first ``num_whole`` requests, plus ``cut_tokens`` of the next one, stay
    within the quota."""
    batch = [(work.num_cached_tokens, work.num_new_tokens) for work in waiting[:num_whole]]
    if cut_tokens is not None:
        batch.append((waiting[num_whole].num_cached_tokens, cut_tokens))
    return predictor.predict_s(batch) <= quota_s


def _check_quota(quota_s: float, min_chunk_tokens: int, chunk_align_tokens: int) -> None:
    if quota_s <= 0 or min_chunk_tokens <= 0 or chunk_align_tokens <= 0:
        raise ValueError(
            "need quota_s, min_chunk_tokens and chunk_align_tokens > 0, got "
            f"{quota_s}, {min_chunk_tokens}, {chunk_align_tokens}"
        )
    if min_chunk_tokens % chunk_align_tokens:
        raise ValueError(
            f"min_chunk_tokens ({min_chunk_tokens}) must be a multiple of chunk_align_tokens "
            f"({chunk_align_tokens})"
        )


def _largest_fitting_prefix(num_items: int, fits: Callable[[int], bool]) -> int:
    """Largest k <= num_items with fits(k), given fits(0) and monotone fits."""
    low, step = 0, 1  # invariant: fits(low)
    while low + step <= num_items and fits(low + step):
        low += step
        step *= 2
    high = min(low + step, num_items + 1)  # fits(high) is false, or high is out of range
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def _most_tokens_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """Largest n in [low, high] with fits(n), by binary search; None if fits(low) is false."""
    best = None
    while low <= high:
        middle = (low + high) // 2
        if fits(middle):
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best


class PrefillBatcher:
    """A PE's FIFO of prefill work that hands out quota batches and carries remainders.

    Owned by one engine (or one simulated engine); not thread-safe. ``next_batch`` removes
    what the batch computes; a cut request stays at the head with its remainder.
    """

    def __init__(
        self,
        predictor: AttentionTimePredictor,
        *,
        quota_s: float,
        min_chunk_tokens: int,
        chunk_align_tokens: int = 1,
    ) -> None:
        _check_quota(quota_s, min_chunk_tokens, chunk_align_tokens)
        self._predictor = predictor
        self._quota_s = quota_s
        self._min_chunk_tokens = min_chunk_tokens
        self._chunk_align_tokens = chunk_align_tokens
        self._waiting: list[PrefillWork] = []

    @classmethod
    def from_config(
        cls, config: SchedulerConfig, predictor: AttentionTimePredictor, chunk_align_tokens: int = 1
    ) -> PrefillBatcher:
        """A batcher with the config's quota and minimum chunk."""
        return cls(
            predictor,
            quota_s=config.attention_quota_s,
            min_chunk_tokens=config.min_prefill_chunk_tokens,
            chunk_align_tokens=chunk_align_tokens,
        )

    @property
    def quota_s(self) -> float:
        """Predicted seconds of one layer a batch may hold (SPEC §6's compute quota)."""
        return self._quota_s

    @property
    def num_waiting(self) -> int:
        """Requests with prefill work left, a cut one included."""
        return len(self._waiting)

    def add(self, work: PrefillWork) -> None:
        """Queue a request's prefill behind everything already waiting."""
        self._waiting.append(work)

    def remove(self, request_id: int) -> bool:
        """Drop a request's remaining work (a cancel); False if it was not waiting."""
        for index, work in enumerate(self._waiting):
            if work.request_id == request_id:
                del self._waiting[index]
                return True
        return False

    def next_batch(self) -> PrefillBatch:
        """The next batch (empty when nothing waits)."""
        batch = pack_prefill_batch(
            self._waiting,
            self._predictor,
            quota_s=self._quota_s,
            min_chunk_tokens=self._min_chunk_tokens,
            chunk_align_tokens=self._chunk_align_tokens,
        )
        num_done = sum(chunk.is_last_chunk for chunk in batch.chunks)
        del self._waiting[:num_done]
        if batch.chunks and not batch.chunks[-1].is_last_chunk:
            cut = batch.chunks[-1]
            head = self._waiting[0]
            assert head.request_id == cut.request_id, "a cut chunk must be the head's"
            self._waiting[0] = PrefillWork(
                head.request_id,
                head.num_cached_tokens + cut.num_new_tokens,
                head.num_new_tokens - cut.num_new_tokens,
            )
        return batch

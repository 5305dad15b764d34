"""Per-request state inside one engine: counts, a block table, and a derived phase.

Token bookkeeping of a sequence with block size 4 (``|`` = block boundary)::

    all_token_ids:        p p p p | p p p o | o o
    num_computed_tokens:  ------------------^ 8   (KV in the device cache)
    num_persisted_blocks: 2                       (leading full blocks known to be in the store)
    next step computes:   tokens 8, 9 ... up to num_tokens - 1; the last row's logits sample

The last sampled token never has KV until it is fed back, which is why a finished sequence
has KV for ``num_tokens - 1`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import torch

from dualpath.engine.sampling import SamplingParams, TokenLogprob
from dualpath.kv.hashing import BlockKey, extend_block_keys


class SequenceStatus(IntEnum):
    """Lifecycle, in order. A preempted sequence goes back to WAITING."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # Prompt tokens whose KV came from the store at first admission (what usage reports).
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    num_persisted_blocks: int = 0
    # Chained keys of this sequence's full blocks, computed as the blocks fill, in the
    # tenant namespace ``cache_salt`` names (``kv.hashing``; None: the shared one).
    block_keys: list[BlockKey] = field(default_factory=list)
    cache_salt: str | None = None
    is_admitted_once: bool = False
    num_preemptions: int = 0
    finish_reason: str | None = None
    # Character offset where a stop string matched; the text is cut there.
    stop_text_end: int | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    load_s: float = 0.0  # time spent reading hit blocks from the store

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def ensure_block_keys(self, num_blocks: int, block_size: int, fingerprint: str) -> None:
        """Extend ``block_keys`` to cover the first ``num_blocks`` full blocks of the tokens."""
        if num_blocks * block_size > self.num_tokens:
            raise RuntimeError(
                f"caller bug: {num_blocks} full blocks requested of a {self.num_tokens}-token "
                f"sequence {self.request_id}"
            )
        if num_blocks > len(self.block_keys):  # all_token_ids is a new list each time
            extend_block_keys(
                self.block_keys,
                self.all_token_ids,
                num_blocks,
                block_size,
                fingerprint,
                cache_salt=self.cache_salt,
            )

"""A request as the scheduler tracks it from submit to its last token, across placements."""

from __future__ import annotations

import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dualpath.kv.hashing import BlockKey
from dualpath.protocol import pack_token_ids
from dualpath.types import NO_SCOPE, RequestScope, SamplingParams

# How many times one request may be placed: the first placement and re-placements after the
# loss of an engine (a request that keeps landing on dying engines fails in the end).
MAX_PLACEMENTS = 3
# Placements lost only because another request's DE failed the batch they shared: not
# counted toward MAX_PLACEMENTS up to this many.
MAX_COLLATERAL = 5


@dataclass
class RequestState:
    request_id: int  # this placement's (see ``client_request_id``)
    # The id the caller knows; it differs from ``request_id`` after a re-placement, so that
    # messages about an abandoned placement match nothing.
    client_request_id: int
    # What a placement prefills, packed once (the Assignment carries it as is): the prompt,
    # then, going on after a lost DE, the first ``num_output_tokens`` tokens sent.
    prompt_token_ids: array.array
    params: SamplingParams
    sampling: dict[str, Any]  # sampling_params_to_dict(params), made on the submitting thread
    num_cached_tokens: int
    # Keys of the prompt's full blocks (all but its last token), hashed at submit; kept only
    # until the request is queued for placement (see ``_enqueue``).
    block_keys: list[BlockKey] | None = None
    prefill_engine_id: int | None = None
    decode_engine_id: int | None = None
    is_prefill_done: bool = False  # this placement's PE is done with it
    num_placements: int = 1
    num_collateral: int = 0  # placements lost with another request's failed DE
    num_output_tokens: int = 0  # of prompt_token_ids: outputs (a continued placement)
    output_token_ids: list[int] = field(default_factory=list)  # every token sent out
    # num_cached_tokens as the caller was told with its first token (kept when it goes on).
    reported_cached_tokens: int | None = None
    lost_at_s: float | None = None  # when its engine was lost, until a token comes again
    # Why the last token sent ends the request, per its PE (the DE sends the finish itself).
    finish_reason_pending: str | None = None
    # Placed on a vLLM server DE: the front door forwards it and streams its tokens; a lost
    # placement is handed back to the front door (``RequestEvent.is_engine_lost``).
    is_forwarded: bool = False
    scope: RequestScope = NO_SCOPE  # its tenant's cache salt and its agent session
    # Its first token's path through the scheduler, by the scheduler's clock: when it was
    # submitted, then when each stage ended (``first_token.FirstTokenStages``). None once it is
    # placed again (a re-placement's first token is ``replacement_delays``').
    first_token_marks_s: list[float] | None = None

    @property
    def is_local_prefill(self) -> bool:
        """Placed on its DE alone, which prefills it too (``Assignment.is_local_prefill``)."""
        return (
            self.prefill_engine_id is not None and self.prefill_engine_id == self.decode_engine_id
        )

    def abandon_placement(self, *, counts: bool, now_s: float) -> None:
        """This placement is given up (``now_s``: when its engine was lost, if no token came
        since an earlier loss): the next one, on engines yet to be chosen, goes on from the
        tokens sent (``go_on_from_output``); ``counts`` toward MAX_PLACEMENTS. Its first
        token is no longer timed by stage."""
        self.prefill_engine_id = self.decode_engine_id = None
        self.num_placements += counts
        if self.lost_at_s is None:
            self.lost_at_s = now_s
        self.go_on_from_output()
        self.is_prefill_done = False
        self.first_token_marks_s = None

    def go_on_from_output(self) -> None:
        """The next placement prefills the prompt and every token sent so far, and goes on
        from there (``Assignment.num_output_tokens``)."""
        if len(self.output_token_ids) > self.num_output_tokens:
            num_prompt_tokens = len(self.prompt_token_ids) - self.num_output_tokens
            self.prompt_token_ids = self.prompt_token_ids[:num_prompt_tokens] + pack_token_ids(
                self.output_token_ids
            )
            self.num_output_tokens = len(self.output_token_ids)


def num_requests_by_engine(states: Iterable[RequestState]) -> dict[int, int]:
    """Engine id -> requests in flight that its loss would place again (or fail, past
    MAX_PLACEMENTS); engines that hold none are left out."""
    counts: dict[int, int] = {}
    for request in states:
        if request.finish_reason_pending is not None:
            continue  # only its finish is outstanding: a loss sends that, nothing more
        # One engine, where its DE prefilled it (``Assignment.is_local_prefill``).
        for engine_id in {request.prefill_engine_id, request.decode_engine_id}:
            if engine_id is not None and needs_engine(request, engine_id):
                counts[engine_id] = counts.get(engine_id, 0) + 1
    return counts


def may_place_again(state: RequestState) -> bool:
    return state.num_placements < MAX_PLACEMENTS


def needs_engine(state: RequestState, engine_id: int) -> bool:
    """Whether the request still needs the engine: its DE until its last token, its PE
    until it is prefilled (a prefilled request no longer needs its PE)."""
    return engine_id == state.decode_engine_id or (
        engine_id == state.prefill_engine_id and not state.is_prefill_done
    )


class Delays:
    """Count, sum and maximum of the delays from an engine's loss to the re-placed token."""

    __slots__ = ("count", "sum_s", "max_s")

    def __init__(self) -> None:
        self.count = 0
        self.sum_s = 0.0
        self.max_s = 0.0

    def add(self, delay_s: float) -> None:
        self.count += 1
        self.sum_s += delay_s
        self.max_s = max(self.max_s, delay_s)

"""Each stage of a request's path to its first token, as the scheduler sees it, timed on
first placements (``dualpath_first_token_stage_seconds``, and each request's log line):

    stages = FirstTokenStages()
    stages.start(state, now_s)                 # submitted
    stages.mark(state, "placement", now_s)     # ... each stage as it ends, in order
    stages.of(state)                           # its three durations, once all are marked

Each stage runs from the end of the last: ``placement`` from submit to the Assignment (the
scheduler's queue, and a wait for blocks a DE is still writing), ``decode_ready`` to the DE's
DecodeReady (its buffer slots and its side's reads, relayed to the PE), ``prefill`` to the
PE's PrefillDone (the PE's reads, its engine's prefill and the KV sent to the DE). A vLLM
server PE's path has no DecodeReady, nor has a request its DE prefills itself (``pairing.py``),
so those are timed up to the Assignment only. A
request placed again is timed no further (``RequestState.first_token_marks_s`` None): the
time from the loss to its next token is the lifecycle's ``replacement_delays``.
"""

from __future__ import annotations

import itertools

from dualpath.cluster.request_state import Delays, RequestState

FIRST_TOKEN_STAGES = ("placement", "decode_ready", "prefill")


class FirstTokenStages:
    """The count and sum of seconds of each stage over the requests timed so far; each
    request's own marks are on its ``RequestState``."""

    def __init__(self) -> None:
        self._delays = {stage: Delays() for stage in FIRST_TOKEN_STAGES}

    @staticmethod
    def start(state: RequestState, now_s: float) -> None:
        state.first_token_marks_s = [now_s]

    def mark(self, state: RequestState, stage: str, now_s: float) -> None:
        """``stage`` ended at ``now_s``: its time is added, unless the request is no longer
        timed or its path skipped the stage before (or already marked this one)."""
        marks = state.first_token_marks_s
        if marks is None or len(marks) != FIRST_TOKEN_STAGES.index(stage) + 1:
            return
        self._delays[stage].add(now_s - marks[-1])
        marks.append(now_s)

    @staticmethod
    def of(state: RequestState) -> tuple[float, ...] | None:
        """The seconds of each stage of ``state``'s first token, once every one was marked."""
        marks = state.first_token_marks_s
        if marks is None or len(marks) != len(FIRST_TOKEN_STAGES) + 1:
            return None
        return tuple(end - start for start, end in itertools.pairwise(marks))

    def totals(self) -> dict[str, tuple[int, float]]:
        """Stage -> (count, sum of seconds), since the start."""
        return {stage: (d.count, d.sum_s) for stage, d in self._delays.items()}

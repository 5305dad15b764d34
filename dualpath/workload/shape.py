"""Shaping a workload for a small machine, and checking that it fits the model.

    workload = scale_generations(cap_turns(workload, 16), 0.2)
    misfit = first_misfit(workload, max_model_len=16_384)  # None: every turn fits

The same knobs shape synthetic trajectories and traces (``bench/presets.py`` says why each
preset picks its values): ``cap_turns`` keeps each session's first turns and
``scale_generations`` shortens every output. Lengths are scaled where tokens are made
(``length_scale`` of ``generate_trajectories`` and ``load_mooncake_trace``), cloning is
``clone.clone_sessions``.

``first_misfit`` is the check a benchmark runs before it starts a server: a turn whose prompt
and output do not fit the model's context would fail in every mode, and a run with failed
turns is no result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dualpath.workload.types import Session, Workload


def cap_turns(workload: Workload, max_turns: int | None) -> Workload:
    """Each session's first ``max_turns`` turns (None: all of them)."""
    if max_turns is None:
        return workload
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    sessions = [Session(s.session_id, s.arrival_s, s.turns[:max_turns]) for s in workload.sessions]
    return Workload(tuple(sessions), f"{workload.source} max_turns={max_turns}")


def scale_generations(workload: Workload, gen_scale: float) -> Workload:
    """Every turn generates ``max(1, round(g * gen_scale))`` tokens instead of g."""
    if not gen_scale > 0:
        raise ValueError(f"gen_scale must be > 0, got {gen_scale}")
    if gen_scale == 1.0:
        return workload
    sessions = [
        Session(
            s.session_id,
            s.arrival_s,
            tuple(
                dataclasses.replace(t, output_tokens=max(1, round(t.output_tokens * gen_scale)))
                for t in s.turns
            ),
        )
        for s in workload.sessions
    ]
    return Workload(tuple(sessions), f"{workload.source} gen_scale={gen_scale}")


@dataclass(frozen=True, slots=True)
class Misfit:
    """The first turn (in workload order) that a server with these limits would refuse."""

    session_id: str
    turn: int  # 0-based, in the replayed session (a clone's turn 0 is its fresh prefix)
    prompt_tokens: int
    output_tokens: int
    max_model_len: int
    max_prompt_tokens: int
    num_misfits: int  # turns of the whole workload that do not fit
    # The largest need over limit of any turn: (prompt + output) / max_model_len or prompt /
    # max_prompt_tokens (> 1); lengths divided by it would about fit.
    max_fill: float

    @property
    def is_prompt_too_long(self) -> bool:
        """The prompt alone is over ``max_prompt_tokens`` (else prompt + output is over
        ``max_model_len``)."""
        return self.prompt_tokens > self.max_prompt_tokens

    def describe(self) -> str:
        if self.is_prompt_too_long:
            limit = f"the {self.max_prompt_tokens:,}-token prompt limit"
        else:
            limit = f"the model's {self.max_model_len:,}-token context (prompt + output)"
        return (
            f"session {self.session_id} turn {self.turn} has a {self.prompt_tokens:,}-token "
            f"prompt and {self.output_tokens:,} output tokens, over {limit}; "
            f"{self.num_misfits:,} turns in all do not fit"
        )


def first_misfit(
    workload: Workload, *, max_model_len: int, max_prompt_tokens: int | None = None
) -> Misfit | None:
    """The first turn whose prompt is over ``max_prompt_tokens`` (default ``max_model_len -
    1``, as the server's) or whose prompt + output is over ``max_model_len``; None if all fit.

    Prompt lengths follow from the replay rules alone (outputs are exact), so this needs no
    model and no server.
    """
    if max_prompt_tokens is None:
        max_prompt_tokens = max_model_len - 1
    first: tuple[Session, int, int, int] | None = None
    num_misfits = 0
    max_fill = 0.0
    for session in workload.sessions:
        for turn, prompt_tokens in enumerate(session.prompt_lengths_tokens()):
            output_tokens = session.turns[turn].output_tokens
            fill = max(
                prompt_tokens / max_prompt_tokens, (prompt_tokens + output_tokens) / max_model_len
            )
            max_fill = max(max_fill, fill)
            if fill > 1:
                num_misfits += 1
                if first is None:
                    first = (session, turn, prompt_tokens, output_tokens)
    if first is None:
        return None
    session, turn, prompt_tokens, output_tokens = first
    return Misfit(
        session.session_id,
        turn,
        prompt_tokens,
        output_tokens,
        max_model_len,
        max_prompt_tokens,
        num_misfits,
        max_fill,
    )

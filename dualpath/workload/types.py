"""The common shape of every workload: sessions of turns, each turn an append and an output length.

A synthetic trajectory (``synthetic.py``) and a Mooncake trace (``mooncake.py``) both become a
``Workload``: sessions that arrive at an offset from the start, each replayed turn by turn with
the rules in ``replay.py``. Token ids are stored per turn as the tokens *added* by that turn;
the model's generated tokens are only known at replay time, so a full prompt exists only once
the previous turn has run (``Session.next_prompt``).

No torch; numpy arrays hold token ids (int32, read-only) because a trace holds millions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dualpath.types import SamplingParams
from dualpath.workload.replay import (
    next_prompt,
    prompt_lengths_tokens,
    sampling_params_for_turn,
)


def _read_only_token_ids(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(token_ids)
    if array.size == 0:
        array = np.zeros(0, dtype=np.int32)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"token ids must be a 1-D sequence of ints, got {array.dtype}")
    if array.size and int(array.min()) < 0:
        raise ValueError(f"token ids must be >= 0, got {int(array.min())}")
    if array.dtype != np.int32 or array.flags.writeable:
        array = array.astype(np.int32)  # a private copy: the caller's array stays theirs
        array.flags.writeable = False
    return array


@dataclass(frozen=True, slots=True, eq=False)
class Turn:
    """One request of a session: what it adds to the context, and how much it generates.

    ::

        keep_prefix_tokens is None (the usual case: the context only grows)
            prompt_{i+1} = [ prompt_i ............ ][ generated_i ][ append_token_ids ]
        keep_prefix_tokens = k (a trace whose context was edited: cut, then re-sent)
            prompt_{i+1} = [ prompt_i[:k] ][ append_token_ids ]

    The first turn's prompt is its ``append_token_ids``. Compared by identity (``eq=False``):
    clones share their original's Turn objects.
    """

    append_token_ids: np.ndarray  # int32, read-only; may be empty after the first turn
    output_tokens: int  # generated exactly (max_tokens = min_tokens, EOS ignored)
    keep_prefix_tokens: int | None = None  # None: keep the previous prompt and its output
    # Seconds from the previous turn's request to this one's in the source trace (0 for a
    # first turn and for synthetic turns): what an online replay with --replay-gaps waits.
    gap_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "append_token_ids", _read_only_token_ids(self.append_token_ids))
        if not isinstance(self.output_tokens, int) or self.output_tokens < 1:
            raise ValueError(f"output_tokens must be an int >= 1, got {self.output_tokens!r}")
        if self.keep_prefix_tokens is not None and self.keep_prefix_tokens < 0:
            raise ValueError(f"keep_prefix_tokens must be >= 0, got {self.keep_prefix_tokens}")
        if not math.isfinite(self.gap_s) or self.gap_s < 0:
            raise ValueError(f"gap_s must be finite and >= 0, got {self.gap_s}")

    @property
    def num_append_tokens(self) -> int:
        return int(self.append_token_ids.size)


@dataclass(frozen=True, slots=True, eq=False)
class Session:
    """One agent's trajectory: turns replayed in order, the next one after the previous ends.

    Prompt lengths are fixed in advance (every output length is exact), so
    ``prompt_lengths_tokens`` needs no model; the prompt *tokens* need the generated tokens.
    """

    session_id: str
    arrival_s: float  # offset from the workload's start
    turns: tuple[Turn, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "turns", tuple(self.turns))
        if not self.turns:
            raise ValueError(f"session {self.session_id!r} has no turns")
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(
                f"session {self.session_id!r}: arrival_s must be >= 0, got {self.arrival_s}"
            )
        first = self.turns[0]
        if first.keep_prefix_tokens is not None or first.num_append_tokens == 0:
            raise ValueError(
                f"session {self.session_id!r}: the first turn needs a non-empty append "
                "and no keep_prefix_tokens"
            )
        prompt_lengths_tokens(self.turns)  # raises ValueError if a turn keeps too much

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def prompt_lengths_tokens(self) -> tuple[int, ...]:
        """Each turn's prompt length under the replay rules."""
        return prompt_lengths_tokens(self.turns)

    def first_prompt(self) -> list[int]:
        return self.turns[0].append_token_ids.tolist()

    def next_prompt(
        self, turn_index: int, previous_prompt: Sequence[int], generated_token_ids: Sequence[int]
    ) -> list[int]:
        """Turn ``turn_index``'s prompt (>= 1), from turn ``turn_index - 1``'s prompt and the
        tokens it actually generated. ``ValueError`` if their lengths are not the ones this
        session replays (a client that lost or cut tokens). Pure: the inputs stay untouched."""
        if not 1 <= turn_index < self.num_turns:
            raise ValueError(
                f"session {self.session_id!r}: turn_index must be in [1, {self.num_turns}), "
                f"got {turn_index}"
            )
        expected = self.prompt_lengths_tokens()[turn_index - 1]
        if len(previous_prompt) != expected:
            raise ValueError(
                f"session {self.session_id!r} turn {turn_index - 1}: previous prompt has "
                f"{len(previous_prompt)} tokens, the replay expects {expected}"
            )
        return next_prompt(
            previous_prompt,
            generated_token_ids,
            self.turns[turn_index],
            previous_output_tokens=self.turns[turn_index - 1].output_tokens,
        )

    def sampling_params(
        self, turn_index: int, base: SamplingParams | None = None
    ) -> SamplingParams:
        """``base`` (default: greedy) forced to generate exactly the turn's output length."""
        return sampling_params_for_turn(self.turns[turn_index], base)


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """Sessions to replay (the loaders sort them by arrival), and where they came from."""

    sessions: tuple[Session, ...]
    source: str  # e.g. "synthetic 64k x64 seed=0 length_scale=1.0" or the trace's path

    def __post_init__(self) -> None:
        object.__setattr__(self, "sessions", tuple(self.sessions))
        if not self.sessions:
            raise ValueError(f"workload {self.source!r} has no sessions")
        ids = [s.session_id for s in self.sessions]
        if len(set(ids)) != len(ids):
            raise ValueError(f"workload {self.source!r} has duplicate session ids")

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    def with_arrival_offsets(self, arrival_offsets_s: Sequence[float]) -> Workload:
        """A copy whose i-th session arrives at ``arrival_offsets_s[i]`` (e.g. Poisson arrivals
        for an online run: ``arrival.poisson_arrival_offsets_s``); the turns are shared."""
        if len(arrival_offsets_s) != self.num_sessions:
            raise ValueError(
                f"{len(arrival_offsets_s)} arrival offsets for {self.num_sessions} sessions"
            )
        sessions = [
            Session(s.session_id, float(t), s.turns)
            for s, t in zip(self.sessions, arrival_offsets_s, strict=True)
        ]
        return Workload(tuple(sessions), self.source)

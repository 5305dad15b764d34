"""Replay rules (SPEC §7), as pure functions of lengths and token ids.

- Turn i+1's prompt is turn i's prompt, the tokens turn i actually generated, and turn i+1's
  append. A trace turn whose context was edited instead keeps only a prefix of turn i's prompt
  and re-sends the rest (``Turn.keep_prefix_tokens``; see ``mooncake.py`` for when).
- Every turn generates exactly its output length: ``max_tokens = min_tokens = g`` with EOS
  ignored, so prompt lengths are known before the run and every mode replays the same lengths.

A benchmark client drives a session with ``Session.first_prompt`` and ``Session.next_prompt``;
``replay_session`` is the same loop for a synchronous ``generate`` (tests, simple tools).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dualpath.types import SamplingParams

if TYPE_CHECKING:
    from dualpath.workload.types import Session, Turn


def next_prompt_length_tokens(
    previous_prompt_tokens: int, previous_output_tokens: int, turn: Turn
) -> int:
    """The length of ``next_prompt``'s result; ``ValueError`` if the turn keeps more than the
    previous prompt has."""
    if turn.keep_prefix_tokens is None:
        return previous_prompt_tokens + previous_output_tokens + turn.num_append_tokens
    if turn.keep_prefix_tokens > previous_prompt_tokens:
        raise ValueError(
            f"turn keeps {turn.keep_prefix_tokens} prompt tokens of a previous prompt of "
            f"{previous_prompt_tokens}"
        )
    return turn.keep_prefix_tokens + turn.num_append_tokens


def prompt_lengths_tokens(turns: Sequence[Turn]) -> tuple[int, ...]:
    """Every turn's prompt length; the first turn's is its append."""
    lengths = [turns[0].num_append_tokens]
    for previous, turn in zip(turns, turns[1:], strict=False):
        lengths.append(next_prompt_length_tokens(lengths[-1], previous.output_tokens, turn))
    return tuple(lengths)


def next_prompt(
    previous_prompt: Sequence[int],
    generated_token_ids: Sequence[int],
    turn: Turn,
    *,
    previous_output_tokens: int,
) -> list[int]:
    """``turn``'s prompt from the previous turn's prompt and generated tokens (a new list).

    ``ValueError`` unless exactly ``previous_output_tokens`` tokens were generated: a shorter
    output would silently shorten every later prompt.
    """
    if len(generated_token_ids) != previous_output_tokens:
        raise ValueError(
            f"the previous turn generated {len(generated_token_ids)} tokens; the replay needs "
            f"exactly {previous_output_tokens} (max_tokens = min_tokens, ignore_eos)"
        )
    if turn.keep_prefix_tokens is None:
        kept = list(previous_prompt)
        kept.extend(generated_token_ids)
    else:
        if turn.keep_prefix_tokens > len(previous_prompt):
            raise ValueError(
                f"turn keeps {turn.keep_prefix_tokens} tokens of a {len(previous_prompt)}-token "
                "previous prompt"
            )
        kept = list(previous_prompt[: turn.keep_prefix_tokens])
    kept.extend(turn.append_token_ids.tolist())
    return kept


def sampling_params_for_turn(turn: Turn, base: SamplingParams | None = None) -> SamplingParams:
    """``base`` (default: greedy) set to generate exactly ``turn.output_tokens``."""
    return dataclasses.replace(
        base or SamplingParams(),
        max_tokens=turn.output_tokens,
        min_tokens=turn.output_tokens,
        ignore_eos=True,
    )


def replay_session(
    session: Session,
    generate: Callable[[list[int], SamplingParams], Sequence[int]],
    base: SamplingParams | None = None,
) -> list[list[int]]:
    """Run ``session``'s turns in order through ``generate(prompt, params) -> token ids``;
    returns every turn's prompt."""
    prompts = [session.first_prompt()]
    generated = list(generate(prompts[0], session.sampling_params(0, base)))
    for turn_index in range(1, session.num_turns):
        prompts.append(session.next_prompt(turn_index, prompts[-1], generated))
        generated = list(generate(prompts[-1], session.sampling_params(turn_index, base)))
    return prompts

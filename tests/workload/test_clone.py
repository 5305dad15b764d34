"""The paper's cloning rule: clones are cache-disjoint yet replay the original after turn 1."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath.workload import (
    PRESETS,
    Session,
    Turn,
    Workload,
    clone_sessions,
    generate_trajectories,
    replay_session,
)

VOCAB_SIZE = 1000


def _constant_generate(prompt: list[int], params) -> list[int]:
    return [7] * params.max_tokens  # the same output for the same turn, whoever asks


@pytest.fixture(scope="module")
def originals() -> Workload:
    return generate_trajectories(
        PRESETS["32k"], 3, seed=0, vocab_size=VOCAB_SIZE, length_scale=0.02, max_turns=6
    )


def test_clones_are_cache_disjoint(originals: Workload) -> None:
    cloned = clone_sessions(originals, 8, seed=1, vocab_size=VOCAB_SIZE, prefix_tokens=16)
    assert cloned.num_sessions == 8
    assert cloned.sessions[:3] == originals.sessions  # the originals, unchanged
    first_blocks = {tuple(s.first_prompt()[:16]) for s in cloned.sessions}
    assert len(first_blocks) == 8  # no two sessions share a first block


def test_clones_share_everything_after_the_first_turn(originals: Workload) -> None:
    cloned = clone_sessions(originals, 8, seed=1, vocab_size=VOCAB_SIZE, prefix_tokens=16)
    for index, clone in enumerate(cloned.sessions[3:]):
        original = originals.sessions[index % 3]
        assert clone.session_id == f"{original.session_id}+clone{index // 3}"
        assert clone.num_turns == original.num_turns + 1
        assert clone.turns[0].num_append_tokens == 16 and clone.turns[0].output_tokens == 1
        assert all(c is o for c, o in zip(clone.turns[1:], original.turns, strict=True))
        clone_prompts = replay_session(clone, _constant_generate)
        head = clone_prompts[0] + [7]
        for clone_prompt, prompt in zip(
            clone_prompts[1:], replay_session(original, _constant_generate), strict=True
        ):
            assert clone_prompt == head + prompt


def test_a_clone_of_an_edited_trace_session_keeps_the_same_prefix() -> None:
    edited = Session(
        "s",
        0.0,
        (Turn(np.arange(10), 2), Turn(np.arange(20, 25), 3, keep_prefix_tokens=4)),
    )
    cloned = clone_sessions(Workload((edited,), "t"), 2, seed=0, vocab_size=VOCAB_SIZE)
    clone = cloned.sessions[1]
    assert clone.turns[2].keep_prefix_tokens == 4 + 64 + 1
    prompts = replay_session(clone, _constant_generate)
    assert prompts[2] == prompts[0] + [7] + list(range(4)) + list(range(20, 25))


def test_clones_differ_by_seed_and_the_count_is_checked(originals: Workload) -> None:
    one = clone_sessions(originals, 4, seed=1, vocab_size=VOCAB_SIZE)
    two = clone_sessions(originals, 4, seed=2, vocab_size=VOCAB_SIZE)
    assert one.sessions[3].first_prompt() != two.sessions[3].first_prompt()
    with pytest.raises(ValueError, match="below"):
        clone_sessions(originals, 2, seed=1, vocab_size=VOCAB_SIZE)

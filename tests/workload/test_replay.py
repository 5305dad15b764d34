"""Replay rules, the session and workload types, statistics and arrivals on hand-built data."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath.types import SamplingParams
from dualpath.workload import (
    PRESETS,
    Session,
    Turn,
    Workload,
    generate_trajectories,
    next_prompt,
    poisson_arrival_offsets_s,
    prompt_lengths_tokens,
    replay_session,
    sampling_params_for_turn,
    workload_stats,
)


def _session(*turns: Turn, session_id: str = "s") -> Session:
    return Session(session_id, 0.0, turns)


def test_a_continuation_is_the_previous_prompt_its_output_and_the_append() -> None:
    turn = Turn([7, 8], output_tokens=1)
    assert next_prompt([1, 2, 3], [4, 5], turn, previous_output_tokens=2) == [1, 2, 3, 4, 5, 7, 8]


def test_an_edit_keeps_a_prefix_and_drops_the_output() -> None:
    turn = Turn([7, 8], output_tokens=1, keep_prefix_tokens=2)
    assert next_prompt([1, 2, 3], [4, 5], turn, previous_output_tokens=2) == [1, 2, 7, 8]


def test_next_prompt_rejects_a_short_output_and_leaves_its_inputs_alone() -> None:
    previous, generated = [1, 2, 3], [4]
    with pytest.raises(ValueError, match="generated 1 tokens; the replay needs exactly 2"):
        next_prompt(previous, generated, Turn([7], 1), previous_output_tokens=2)
    with pytest.raises(ValueError, match="keeps 4 tokens"):
        next_prompt(previous, [4, 5], Turn([7], 1, keep_prefix_tokens=4), previous_output_tokens=2)
    next_prompt(previous, [4, 5], Turn([7], 1), previous_output_tokens=2)
    assert previous == [1, 2, 3] and generated == [4]


def test_prompt_lengths_follow_the_rules() -> None:
    turns = (
        Turn(np.arange(10), 3),
        Turn(np.arange(5), 2),
        Turn(np.arange(4), 1, keep_prefix_tokens=6),
    )
    assert prompt_lengths_tokens(turns) == (10, 18, 10)
    with pytest.raises(ValueError, match="keeps 30 prompt tokens of a previous prompt of 10"):
        _session(Turn(np.arange(10), 3), Turn([1], 1, keep_prefix_tokens=30))


def test_exact_output_lengths() -> None:
    base = SamplingParams(temperature=0.5, seed=3)
    params = sampling_params_for_turn(Turn([1], 17), base)
    assert (params.max_tokens, params.min_tokens, params.ignore_eos) == (17, 17, True)
    assert (params.temperature, params.seed) == (0.5, 3)
    assert sampling_params_for_turn(Turn([1], 4)).is_greedy


def test_a_session_replays_turn_by_turn() -> None:
    session = generate_trajectories(
        PRESETS["48k"], 1, seed=0, vocab_size=100, length_scale=0.02, max_turns=8
    ).sessions[0]
    outputs: list[list[int]] = []

    def generate(prompt: list[int], params: SamplingParams) -> list[int]:
        outputs.append([100 + len(outputs)] * params.max_tokens)
        return outputs[-1]

    prompts = replay_session(session, generate)
    assert [len(p) for p in prompts] == list(session.prompt_lengths_tokens())
    assert prompts[0] == session.turns[0].append_token_ids.tolist()
    for i in range(1, session.num_turns):
        appended = session.turns[i].append_token_ids.tolist()
        assert prompts[i] == prompts[i - 1] + outputs[i - 1] + appended
        assert len(outputs[i - 1]) == session.turns[i - 1].output_tokens


def test_session_next_prompt_checks_what_the_client_passes() -> None:
    session = _session(Turn([1, 2], 2), Turn([3], 1))
    assert session.next_prompt(1, [1, 2], [9, 9]) == [1, 2, 9, 9, 3]
    with pytest.raises(ValueError, match="previous prompt has 3 tokens, the replay expects 2"):
        session.next_prompt(1, [1, 2, 5], [9, 9])
    with pytest.raises(ValueError, match="turn_index must be in"):
        session.next_prompt(2, [1, 2], [9, 9])


def test_turns_and_sessions_validate() -> None:
    with pytest.raises(ValueError, match="output_tokens"):
        Turn([1], 0)
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        Turn([1, -2], 1)
    with pytest.raises(ValueError, match="non-empty append"):
        _session(Turn([], 1))
    with pytest.raises(ValueError, match="no turns"):
        Session("s", 0.0, ())
    with pytest.raises(ValueError, match="duplicate session ids"):
        Workload((_session(Turn([1], 1)), _session(Turn([2], 1))), "t")


def test_turn_token_ids_are_a_private_read_only_copy() -> None:
    source = np.array([1, 2, 3])
    turn = Turn(source, 1)
    source[0] = 99
    assert turn.append_token_ids.tolist() == [1, 2, 3]
    with pytest.raises(ValueError):
        turn.append_token_ids[0] = 5


def test_statistics_of_a_hand_built_workload() -> None:
    one = _session(Turn(np.arange(10), 3), Turn(np.arange(5), 2), session_id="one")
    two = _session(
        Turn(np.arange(4), 1), Turn(np.arange(2), 1, keep_prefix_tokens=3), session_id="two"
    )
    stats = workload_stats(Workload((one, two), "t"), block_size_tokens=1)
    # one: prompts 10, 18; total 20. two: prompts 4, 5; total 6.
    assert stats.turns == 2
    assert stats.total_tokens == 13
    assert stats.context_tokens == (14 + 4.5) / 2
    assert stats.append_tokens == (7.5 + 3) / 2
    assert stats.gen_tokens == (2.5 + 1) / 2
    assert stats.max_total_tokens == 20
    assert stats.max_prompt_tokens == 18
    # Hits, short of each prompt's last token, of what has KV: one's turn 1 hits its first
    # prompt and 2 of its 3 outputs; two's first prompt is one's first 4 tokens (3 hit) and
    # its turn 1 hits the 3 tokens it keeps.
    assert stats.ideal_hit_ratio == (12 + 3 + 3) / (28 + 9)
    assert stats.block_size_tokens == 1


def test_poisson_arrivals() -> None:
    offsets_s = poisson_arrival_offsets_s(4000, rate_per_s=2.0, seed=0)
    assert offsets_s[0] == 0 and np.all(np.diff(offsets_s) >= 0)
    assert np.mean(np.diff(offsets_s)) == pytest.approx(0.5, rel=0.05)
    assert np.array_equal(offsets_s, poisson_arrival_offsets_s(4000, rate_per_s=2.0, seed=0))
    workload = Workload((_session(Turn([1], 1), session_id="a"), _session(Turn([2], 1))), "t")
    timed = workload.with_arrival_offsets([0.0, 1.5])
    assert [s.arrival_s for s in timed.sessions] == [0.0, 1.5]
    assert timed.sessions[1].turns is workload.sessions[1].turns
    with pytest.raises(ValueError, match="2 sessions"):
        workload.with_arrival_offsets([0.0])


def test_the_workload_package_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, dualpath.workload; sys.exit(3 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

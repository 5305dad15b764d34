"""The trajectory generator against SPEC §7's table, its determinism and its scaling knobs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from dualpath.workload import (
    PRESETS,
    TrajectoryTargets,
    fit_trajectories,
    generate_trajectories,
    workload_stats,
)

VOCAB_SIZE = 1000


@pytest.fixture(scope="module")
def preset_workloads():
    return {
        name: generate_trajectories(targets, 64, seed=0, vocab_size=VOCAB_SIZE)
        for name, targets in PRESETS.items()
    }


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_statistics_match_the_table(preset_workloads, name: str) -> None:
    targets = PRESETS[name]
    stats = workload_stats(preset_workloads[name])
    print(f"{name}: {stats}")  # the achieved append and gen means, for the record
    assert stats.num_sessions == 64
    assert stats.turns == pytest.approx(targets.num_turns, rel=0.05)
    assert stats.total_tokens == pytest.approx(targets.total_tokens, rel=0.05)
    assert stats.context_tokens == pytest.approx(targets.context_tokens, rel=0.05)
    # Not required by SPEC §7 (only reported), but the model fits them too.
    assert stats.append_tokens == pytest.approx(targets.append_tokens, rel=0.05)
    assert stats.gen_tokens == pytest.approx(targets.gen_tokens, rel=0.05)
    assert stats.max_total_tokens <= targets.max_total_tokens


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_long_trajectories_have_shorter_turns(preset_workloads, name: str) -> None:
    sessions = sorted(preset_workloads[name].sessions, key=lambda s: s.num_turns)
    per_turn = [
        (s.prompt_lengths_tokens()[-1] + s.turns[-1].output_tokens) / s.num_turns for s in sessions
    ]
    quarter = len(sessions) // 4
    assert np.mean(per_turn[:quarter]) > 2 * np.mean(per_turn[-quarter:])
    assert sessions[0].turns[0].num_append_tokens > 1000  # a large first prompt


def test_no_trajectory_averages_fewer_than_the_floor_of_tokens_per_turn() -> None:
    targets = PRESETS["64k"]

    def turns_and_per_turn(min_tokens_per_turn: int) -> tuple[np.ndarray, np.ndarray]:
        floored = dataclasses.replace(targets, min_tokens_per_turn=min_tokens_per_turn)
        lengths, _ = fit_trajectories(floored, 1024, seed=0)
        turns = np.array([one.output_tokens.size for one in lengths])
        totals = np.array([one.append_tokens.sum() + one.output_tokens.sum() for one in lengths])
        return turns, totals / turns

    turns, per_turn = turns_and_per_turn(targets.min_tokens_per_turn)
    assert per_turn.min() >= targets.min_tokens_per_turn
    assert turns.mean() == pytest.approx(targets.num_turns, rel=0.01)
    assert per_turn.mean() == pytest.approx(targets.append_tokens + targets.gen_tokens, rel=0.01)
    # Without the floor the lognormal's tail runs to turns of a few tokens.
    loose_turns, loose_per_turn = turns_and_per_turn(2)
    assert loose_per_turn.min() < targets.min_tokens_per_turn / 2
    assert loose_turns.max() > 1.5 * turns.max()


def test_fit_trajectories_gives_the_lengths_that_are_generated(preset_workloads) -> None:
    lengths, fit = fit_trajectories(PRESETS["64k"], 64, seed=0)
    for one, session in zip(lengths, preset_workloads["64k"].sessions, strict=True):
        assert one.append_tokens.tolist() == [t.num_append_tokens for t in session.turns]
        assert one.output_tokens.tolist() == [t.output_tokens for t in session.turns]
    assert 0.3 < fit.turns_sigma < 1.5  # turn counts vary widely (module docstring)
    assert 0.1 < fit.first_prompt_fraction < 0.3
    assert 0.1 < fit.output_fraction < 0.5


def test_every_turn_appends_and_generates_at_least_one_token(preset_workloads) -> None:
    for workload in preset_workloads.values():
        for session in workload.sessions:
            assert all(t.num_append_tokens >= 1 and t.output_tokens >= 1 for t in session.turns)
            assert all(t.keep_prefix_tokens is None for t in session.turns)


def test_a_single_trajectory_hits_the_means() -> None:
    targets = PRESETS["32k"]
    stats = workload_stats(generate_trajectories(targets, 1, seed=3, vocab_size=VOCAB_SIZE))
    assert stats.turns == targets.num_turns
    assert stats.total_tokens == pytest.approx(targets.total_tokens, abs=1)
    assert stats.context_tokens == pytest.approx(targets.context_tokens, rel=0.01)


def _token_ids(workload) -> list[list[int]]:
    return [
        np.concatenate([t.append_token_ids for t in s.turns]).tolist() for s in workload.sessions
    ]


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    def make(seed: int):
        return generate_trajectories(
            PRESETS["48k"], 4, seed=seed, vocab_size=VOCAB_SIZE, length_scale=0.05
        )

    first, again, other = make(7), make(7), make(8)
    assert _token_ids(first) == _token_ids(again)
    assert [[t.output_tokens for t in s.turns] for s in first.sessions] == [
        [t.output_tokens for t in s.turns] for s in again.sessions
    ]
    assert _token_ids(first) != _token_ids(other)
    assert [s.turns[0].append_token_ids[:8].tolist() for s in first.sessions] != [
        s.turns[0].append_token_ids[:8].tolist() for s in other.sessions
    ]


def test_trajectories_are_distinct() -> None:
    workload = generate_trajectories(
        PRESETS["32k"], 8, seed=0, vocab_size=VOCAB_SIZE, length_scale=0.1
    )
    first_blocks = {tuple(s.turns[0].append_token_ids[:16].tolist()) for s in workload.sessions}
    assert len(first_blocks) == 8


def test_avoided_token_ids_never_appear() -> None:
    avoid = set(range(10)) | {49}
    workload = generate_trajectories(
        PRESETS["32k"], 3, seed=0, vocab_size=50, avoid_token_ids=avoid, length_scale=0.05
    )
    tokens = np.concatenate([t.append_token_ids for s in workload.sessions for t in s.turns])
    assert tokens.min() >= 10 and tokens.max() <= 48
    assert set(np.unique(tokens).tolist()) == set(range(10, 49))  # every other id is used


@pytest.mark.parametrize("length_scale", [0.01, 0.1])
def test_length_scale_scales_lengths_and_keeps_the_scaled_max(
    preset_workloads, length_scale: float
) -> None:
    targets = PRESETS["64k"]
    full = preset_workloads["64k"]
    scaled = generate_trajectories(
        targets, 64, seed=0, vocab_size=VOCAB_SIZE, length_scale=length_scale
    )
    max_total = math.floor(targets.max_total_tokens * length_scale)
    for small, big in zip(scaled.sessions, full.sessions, strict=True):
        assert small.prompt_lengths_tokens()[-1] + small.turns[-1].output_tokens <= max_total
        # Only trailing turns are ever dropped; kept turns are the full ones, scaled.
        assert 1 <= small.num_turns <= big.num_turns
        for s, b in zip(small.turns, big.turns, strict=False):
            assert s.num_append_tokens == max(1, round(b.num_append_tokens * length_scale))
            assert s.output_tokens == max(1, round(b.output_tokens * length_scale))
    stats = workload_stats(scaled)
    assert stats.total_tokens == pytest.approx(targets.total_tokens * length_scale, rel=0.15)


def test_turn_scale_and_max_turns_keep_the_first_turns(preset_workloads) -> None:
    full = preset_workloads["32k"]
    cut = generate_trajectories(PRESETS["32k"], 64, seed=0, vocab_size=VOCAB_SIZE, turn_scale=0.25)
    capped = generate_trajectories(PRESETS["32k"], 64, seed=0, vocab_size=VOCAB_SIZE, max_turns=5)
    for big, quarter, five in zip(full.sessions, cut.sessions, capped.sessions, strict=True):
        assert quarter.num_turns == math.ceil(big.num_turns * 0.25)
        assert five.num_turns == min(5, big.num_turns)
        assert np.array_equal(quarter.turns[1].append_token_ids, big.turns[1].append_token_ids)
    assert workload_stats(cut).turns == pytest.approx(PRESETS["32k"].num_turns / 4, rel=0.05)


def test_a_length_scale_too_small_for_the_first_turn_is_rejected() -> None:
    with pytest.raises(ValueError, match="raise length_scale"):
        generate_trajectories(PRESETS["32k"], 2, seed=0, vocab_size=VOCAB_SIZE, length_scale=1e-5)


def test_bad_targets_and_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="total_tokens"):
        TrajectoryTargets(32_768, 60, 608, 148, 40_000, 17_183)
    with pytest.raises(ValueError, match="context_tokens"):
        TrajectoryTargets(32_768, 60, 608, 148, 28_639, 30_000)
    with pytest.raises(ValueError, match="min_tokens_per_turn"):
        TrajectoryTargets(32_768, 60, 608, 148, 28_639, 17_183, min_tokens_per_turn=500)
    with pytest.raises(ValueError, match="min_tokens_per_turn"):
        TrajectoryTargets(32_768, 60, 608, 148, 28_639, 17_183, min_tokens_per_turn=1)
    with pytest.raises(ValueError, match="num_trajectories"):
        generate_trajectories(PRESETS["32k"], 0, seed=0, vocab_size=VOCAB_SIZE)
    with pytest.raises(ValueError, match="length_scale"):
        generate_trajectories(PRESETS["32k"], 1, seed=0, vocab_size=VOCAB_SIZE, length_scale=2)

"""Shaping (turn caps, generation scale), the fit check, the hit bound and trace gaps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dualpath.workload import (
    Session,
    Turn,
    Workload,
    cap_turns,
    clone_sessions,
    first_misfit,
    ideal_hit_ratio,
    load_mooncake_trace,
    packaged_trace_path,
    scale_generations,
)

DATA = Path(__file__).parent / "data"
AGENTIC = DATA / "agentic_head.jsonl"  # trace_0008 turns 0-19, trace_0182 turns 0-9
VOCAB_SIZE = 5000


@pytest.fixture
def hand_trace(tmp_path: Path) -> Path:
    """Two sessions in 4-token trace blocks. Session a: turn 1 continues turn 0 (all its
    blocks), turn 2 edits (keeps block 0 only); session b is one turn."""
    rows = [
        {"session_id": "a", "turn": 0, "timestamp": 0, "input_length": 8, "output_length": 3,
         "hash_ids": [0, 1]},
        {"session_id": "b", "turn": 0, "timestamp": 0, "input_length": 5, "output_length": 1,
         "hash_ids": [10, 11]},
        {"session_id": "a", "turn": 1, "timestamp": 2000, "input_length": 14,
         "output_length": 1, "hash_ids": [0, 1, 2, 3]},
        {"session_id": "a", "turn": 2, "timestamp": 5000, "input_length": 9,
         "output_length": 1, "hash_ids": [0, 5, 6]},
    ]  # fmt: skip
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _load(path: Path, **kwargs) -> Workload:
    return load_mooncake_trace(path, vocab_size=VOCAB_SIZE, block_size_tokens=4, **kwargs)


def test_the_hit_bound_of_a_hand_made_trace(hand_trace: Path) -> None:
    workload = _load(hand_trace)
    a = workload.sessions[0]
    # a: 8-token prompt + 3 generated; turn 1 appends 14 - 11 = 3; turn 2 keeps 4 of them
    # and re-sends 5 (an edit); b: 5 tokens. 36 prompt tokens in all.
    assert a.prompt_lengths_tokens() == (8, 14, 9)
    # Blocks of 4: turn 0 caches p0-3, p4-7 (its KV: prompt + 2 of 3 generated tokens);
    # turn 1 (p0-7 g0-2 x0-2) hits 2 blocks, its third (g0 g1 g2 x0) is new; turn 2 (p0-3,
    # then the edit) hits 1. b shares nothing: 12 of 36.
    assert ideal_hit_ratio(workload, block_size_tokens=4) == pytest.approx(12 / 36)
    # Blocks of 2: turn 0 also caches g0 g1 (its KV holds 2 generated tokens): turn 1 hits
    # 5 blocks, turn 2 still 2: 14 of 36.
    assert ideal_hit_ratio(workload, block_size_tokens=2) == pytest.approx(14 / 36)
    # One token: each turn hits everything computed before it, short of its last token:
    # turn 1 the 8 + 2 tokens with KV, turn 2 the 4 it keeps.
    assert ideal_hit_ratio(workload, block_size_tokens=1) == pytest.approx(14 / 36)


def test_a_trace_keeps_its_gaps_between_requests(hand_trace: Path) -> None:
    a = _load(hand_trace).sessions[0]
    assert [t.gap_s for t in a.turns] == [0.0, 2.0, 3.0]
    capped = scale_generations(cap_turns(Workload((a,), "t"), 2), 0.5).sessions[0]
    assert [t.gap_s for t in capped.turns] == [0.0, 2.0]  # shaping keeps them
    cloned = clone_sessions(Workload((a,), "t"), 2, seed=0, vocab_size=VOCAB_SIZE)
    assert [t.gap_s for t in cloned.sessions[1].turns] == [0.0, 0.0, 2.0, 3.0]
    assert cloned.sessions[1].turns[3].keep_prefix_tokens == 4 + 64 + 1


def test_turn_caps_and_generation_scale_shape_a_trace() -> None:
    trace = load_mooncake_trace(AGENTIC, vocab_size=VOCAB_SIZE, length_scale=0.1)
    shaped = scale_generations(cap_turns(trace, 5), 0.2)
    for original, session in zip(trace.sessions, shaped.sessions, strict=True):
        assert session.num_turns == 5
        assert session.turns[0].append_token_ids is original.turns[0].append_token_ids
        assert [t.output_tokens for t in session.turns] == [
            max(1, round(t.output_tokens * 0.2)) for t in original.turns[:5]
        ]
        assert [t.keep_prefix_tokens for t in session.turns] == [
            t.keep_prefix_tokens for t in original.turns[:5]
        ]
    assert cap_turns(trace, None) is trace and scale_generations(trace, 1.0) is trace
    with pytest.raises(ValueError, match="max_turns"):
        cap_turns(trace, 0)


def test_clones_of_trace_sessions_are_cache_disjoint() -> None:
    trace = load_mooncake_trace(AGENTIC, vocab_size=VOCAB_SIZE, length_scale=0.1)
    cloned = clone_sessions(trace, 6, seed=3, vocab_size=VOCAB_SIZE)

    def hit_tokens(workload: Workload) -> float:
        prompts = sum(sum(s.prompt_lengths_tokens()) for s in workload.sessions)
        return ideal_hit_ratio(workload, block_size_tokens=16) * prompts

    # Disjoint sessions hit together exactly what each hits alone: no block is shared.
    alone = sum(hit_tokens(Workload((s,), "one")) for s in cloned.sessions)
    assert hit_tokens(cloned) == pytest.approx(alone)
    # ... yet a clone hits what its original does within itself (its fresh first turn aside).
    assert hit_tokens(Workload((cloned.sessions[2],), "c")) >= hit_tokens(
        Workload((trace.sessions[0],), "o")
    )


def test_first_misfit_names_the_session_and_turn() -> None:
    fits = Session("s", 0.0, (Turn(np.arange(10), 5), Turn(np.arange(10), 5)))
    grows = Session("t", 0.0, (Turn(np.arange(20), 5), Turn(np.arange(70), 5)))
    workload = Workload((fits, grows), "w")
    assert first_misfit(workload, max_model_len=100) is None  # t's turn 1: 95 + 5 fits
    misfit = first_misfit(workload, max_model_len=99)
    assert (misfit.session_id, misfit.turn, misfit.prompt_tokens) == ("t", 1, 95)
    assert not misfit.is_prompt_too_long and misfit.num_misfits == 1
    assert misfit.max_fill == pytest.approx(100 / 99)
    assert "session t turn 1" in misfit.describe() and "99-token context" in misfit.describe()
    limited = first_misfit(workload, max_model_len=100, max_prompt_tokens=30)
    assert (limited.session_id, limited.turn, limited.is_prompt_too_long) == ("t", 1, True)
    assert "30-token prompt limit" in limited.describe()


def test_the_agentic_trace_ships_with_the_package() -> None:
    path = packaged_trace_path("agentic_coding_dev")
    assert path.is_file() and (path.parent / "README.md").is_file()
    with pytest.raises(ValueError, match="agentic_coding_dev"):
        packaged_trace_path("nope")

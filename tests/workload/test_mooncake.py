"""The Mooncake trace loader: validation, hash ids to tokens, and the trace turn rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.workload import (
    TraceFormatError,
    load_mooncake_trace,
    read_trace_rows,
    replay_session,
)

DATA = Path(__file__).parent / "data"
AGENTIC = DATA / "agentic_head.jsonl"  # trace_0008 turns 0-19, trace_0182 turns 0-9
MOONCAKE = DATA / "mooncake_head.jsonl"
VOCAB_SIZE = 5000


def _write(tmp_path: Path, rows: list[dict | str]) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _row(input_length: int, hash_ids: list[int], **extra) -> dict:
    return {
        "timestamp": 0,
        "input_length": input_length,
        "output_length": 3,
        "hash_ids": hash_ids,
        **extra,
    }


def _generate(prompt: list[int], params) -> list[int]:
    return [len(prompt) % VOCAB_SIZE] * params.max_tokens  # depends on the turn, not the mode


def test_rows_without_sessions_are_one_turn_sessions_at_their_timestamps() -> None:
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    workload = load_mooncake_trace(MOONCAKE, vocab_size=VOCAB_SIZE)
    assert workload.num_sessions == 30
    for session, row in zip(workload.sessions, rows, strict=True):
        assert session.num_turns == 1
        assert session.arrival_s == row["timestamp"] / 1000
        assert session.prompt_lengths_tokens() == (row["input_length"],)
        assert session.turns[0].output_tokens == row["output_length"]
    assert [s.session_id for s in workload.sessions][:2] == ["line1", "line2"]


def test_agentic_rows_group_into_sessions_ordered_by_turn() -> None:
    workload = load_mooncake_trace(AGENTIC, vocab_size=VOCAB_SIZE)
    assert [(s.session_id, s.num_turns, s.arrival_s) for s in workload.sessions] == [
        ("trace_0008", 20, 0.0),
        ("trace_0182", 10, 0.0),
    ]
    only_first = load_mooncake_trace(AGENTIC, vocab_size=VOCAB_SIZE, max_sessions=1)
    assert [s.session_id for s in only_first.sessions] == ["trace_0008"]


def test_interleaved_sessions_sort_by_arrival(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            _row(10, [0], session_id="b", turn=0, timestamp=5000),
            _row(10, [1], session_id="a", turn=0, timestamp=2000),
            _row(20, [0], session_id="b", turn=1, timestamp=9000),
        ],
    )
    workload = load_mooncake_trace(path, vocab_size=VOCAB_SIZE)
    assert [(s.session_id, s.arrival_s, s.num_turns) for s in workload.sessions] == [
        ("a", 2.0, 1),
        ("b", 5.0, 2),
    ]


def test_the_trace_turn_rule_on_the_real_fixture() -> None:
    rows = [json.loads(line) for line in AGENTIC.read_text().splitlines()][:20]
    session = load_mooncake_trace(AGENTIC, vocab_size=VOCAB_SIZE).sessions[0]
    lengths = session.prompt_lengths_tokens()
    assert lengths[0] == rows[0]["input_length"]
    for i in range(1, 20):
        turn, previous = session.turns[i], rows[i - 1]
        if i == 9:  # shares 19 of turn 8's 134 blocks: an edit
            assert turn.keep_prefix_tokens == 19 * 512
            assert lengths[i] == rows[i]["input_length"]
        else:  # shares all of turn i-1's blocks but its fresh last one: a continuation
            assert turn.keep_prefix_tokens is None
            grown = lengths[i - 1] + previous["output_length"]
            assert lengths[i] == max(rows[i]["input_length"], grown)
    # the replay never lags the trace, and catches up after turns that dropped outputs
    assert all(p >= r["input_length"] for p, r in zip(lengths, rows, strict=True))


def test_prefix_reuse_survives_the_conversion() -> None:
    session = load_mooncake_trace(AGENTIC, vocab_size=VOCAB_SIZE).sessions[0]
    prompts = replay_session(session, _generate)
    for i in range(1, session.num_turns):
        keep = session.turns[i].keep_prefix_tokens
        if keep is None:
            output = _generate(prompts[i - 1], session.sampling_params(i - 1))
            assert prompts[i][: len(prompts[i - 1]) + len(output)] == prompts[i - 1] + output
        else:
            assert prompts[i][:keep] == prompts[i - 1][:keep]
            assert prompts[i][keep] != prompts[i - 1][keep]


def test_equal_hash_ids_give_equal_tokens_and_different_ids_different(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            _row(1300, [1, 2, 3]),
            _row(1400, [1, 2, 4]),
            _row(600, [5, 6]),
            _row(512, [1]),
        ],
    )
    a, b, c, d = (
        s.first_prompt() for s in load_mooncake_trace(path, vocab_size=VOCAB_SIZE).sessions
    )
    assert (len(a), len(b), len(c), len(d)) == (1300, 1400, 600, 512)
    assert a[:1024] == b[:1024]
    assert a[:512] == d
    assert a[1024:1100] != b[1024:1100]
    assert a[:512] != c[:512]
    assert sum(x == y for x, y in zip(a[1024:1300], b[1024:1300], strict=True)) < 10
    reseeded = load_mooncake_trace(path, vocab_size=VOCAB_SIZE, seed=1).sessions[0].first_prompt()
    assert reseeded != a
    assert load_mooncake_trace(path, vocab_size=VOCAB_SIZE).sessions[0].first_prompt() == a


def test_avoided_token_ids_never_appear(tmp_path: Path) -> None:
    path = _write(tmp_path, [_row(2000, [1, 2, 3, 4])])
    prompt = (
        load_mooncake_trace(path, vocab_size=20, avoid_token_ids=range(10))
        .sessions[0]
        .first_prompt()
    )
    assert min(prompt) >= 10 and max(prompt) < 20


def test_length_scale_shrinks_blocks_and_keeps_the_sharing(tmp_path: Path) -> None:
    path = _write(tmp_path, [_row(1300, [1, 2, 3]), _row(1024, [1, 2]), _row(100, [5])])
    workload = load_mooncake_trace(path, vocab_size=VOCAB_SIZE, length_scale=0.01)
    a, b, c = (s.first_prompt() for s in workload.sessions)
    # 512-token blocks become 5 tokens; 1300 = 2 full blocks + 276 -> 2 * 5 + round(2.7)
    assert (len(a), len(b), len(c)) == (13, 10, 1)
    assert a[:10] == b
    assert workload.sessions[0].turns[0].output_tokens == 1  # max(1, round(3 * 0.01))
    scaled = load_mooncake_trace(AGENTIC, vocab_size=VOCAB_SIZE, length_scale=0.01).sessions[0]
    assert scaled.turns[9].keep_prefix_tokens == 19 * 5  # the same edit, in scaled blocks


def test_a_zero_output_replays_as_one_token(tmp_path: Path) -> None:
    path = _write(tmp_path, [{**_row(10, [0]), "output_length": 0}])
    assert load_mooncake_trace(path, vocab_size=VOCAB_SIZE).sessions[0].turns[0].output_tokens == 1


GOOD = _row(600, [0, 1])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({k: v for k, v in GOOD.items() if k != "timestamp"}, "missing field 'timestamp'"),
        ({k: v for k, v in GOOD.items() if k != "input_length"}, "missing field 'input_length'"),
        ({k: v for k, v in GOOD.items() if k != "output_length"}, "missing field 'output_length'"),
        ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "missing field 'hash_ids'"),
        ({**GOOD, "input_length": "600"}, "input_length must be int"),
        ({**GOOD, "input_length": 600.0}, "input_length must be int"),
        ({**GOOD, "output_length": True}, "output_length must be int"),
        ({**GOOD, "timestamp": "0"}, "timestamp must be int or float"),
        ({**GOOD, "hash_ids": "0,1"}, "hash_ids must be list"),
        ({**GOOD, "hash_ids": [0, "1"]}, "hash_ids must be ints"),
        ({**GOOD, "hash_ids": [0, -1]}, "hash_ids must be ints >= 0"),
        ({**GOOD, "output_length": -1}, "output_length >= 0"),
        ({**GOOD, "input_length": 0, "hash_ids": []}, "input_length >= 1"),
        ({**GOOD, "timestamp": -5}, "timestamp must be finite and >= 0"),
        ({**GOOD, "hash_ids": [0]}, "too few for input_length 600"),
        ({**GOOD, "hash_ids": [0, 1, 2]}, "too many for input_length 600"),
        ({**GOOD, "session_id": "s"}, "session_id and turn come together"),
    ],
)
def test_a_malformed_line_names_the_file_and_line(tmp_path: Path, bad, message: str) -> None:
    path = _write(tmp_path, [GOOD, "", bad])  # the blank line 2 is skipped but counted
    with pytest.raises(TraceFormatError, match=message) as info:
        load_mooncake_trace(path, vocab_size=VOCAB_SIZE)
    assert str(info.value).startswith(f"{path}:3: ")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("turns", "message"),
    [
        ([0, 0], "duplicate or out-of-order turn 0; expected turn 1"),
        ([1], "skips to turn 1; expected turn 0"),
        ([0, 2], "skips to turn 2; expected turn 1"),
        ([0, 1, 1], "duplicate or out-of-order turn 1; expected turn 2"),
    ],
)
def test_turns_out_of_order_name_the_line(tmp_path: Path, turns: list[int], message: str) -> None:
    rows = [_row(10, [0], session_id="other", turn=0)]
    rows += [_row(10, [0], session_id="s", turn=t) for t in turns]
    path = _write(tmp_path, rows)
    with pytest.raises(TraceFormatError, match=message) as info:
        read_trace_rows(path)
    assert str(info.value).startswith(f"{path}:{len(rows)}: ")


def test_mixing_rows_with_and_without_sessions_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, [_row(10, [0], session_id="s", turn=0), _row(10, [0])])
    with pytest.raises(TraceFormatError, match=r":2: rows with and without session_id"):
        read_trace_rows(path)


def test_an_empty_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no rows"):
        read_trace_rows(_write(tmp_path, [""]))

"""The scheduler process's session table: a session's DE, its outcomes, and its bounds."""

from __future__ import annotations

import pytest

from dualpath.cluster.sessions import Sessions


def test_a_sessions_turns_prefer_the_decode_engine_of_its_last_turn() -> None:
    sessions = Sessions(retention_s=300.0)
    assert sessions.decode_engine_of("a", 0.0) is None
    assert sessions.on_assigned("a", 2, 0.0) == "first"
    assert sessions.decode_engine_of("a", 1.0) == 2
    assert sessions.on_assigned("a", 2, 1.0) == "same_de"
    assert sessions.on_assigned("a", 3, 2.0) == "moved"
    assert sessions.decode_engine_of("a", 3.0) == 3
    assert sessions.outcome_to_num_placements == {"first": 1, "same_de": 1, "moved": 1}
    assert sessions.retention_s_of("a") == 300.0


def test_requests_without_a_session_are_neither_remembered_nor_counted() -> None:
    sessions = Sessions(retention_s=300.0)
    assert sessions.on_assigned(None, 2, 0.0) == ""
    assert sessions.decode_engine_of(None, 0.0) is None
    assert sessions.retention_s_of(None) == 0.0
    assert sessions.num_active(0.0) == 0
    assert sessions.outcome_to_num_placements == {"first": 0, "same_de": 0, "moved": 0}


def test_a_session_is_forgotten_the_retention_time_after_its_last_turn_ended() -> None:
    sessions = Sessions(retention_s=10.0)
    sessions.on_assigned("a", 2, 0.0)
    sessions.on_assigned("b", 3, 1.0)
    sessions.on_finished("a", 5.0)  # a's turn ends after b's began: a is the later one seen
    assert sessions.num_active(10.5) == 2
    assert sessions.decode_engine_of("b", 11.0) is None  # 10 s after b was seen
    assert sessions.decode_engine_of("a", 14.9) == 2
    assert sessions.num_active(15.0) == 0
    assert sessions.on_assigned("a", 2, 15.0) == "first"


def test_the_table_keeps_the_sessions_seen_most_recently() -> None:
    sessions = Sessions(retention_s=300.0, max_num_sessions=2)
    for time_s, session_id in enumerate(("a", "b", "c")):
        sessions.on_assigned(session_id, 2, float(time_s))
    assert sessions.num_active(3.0) == 2
    assert sessions.decode_engine_of("a", 3.0) is None
    sessions.on_assigned("b", 4, 4.0)  # b seen again: c is now the least recent
    sessions.on_assigned("d", 5, 5.0)
    assert [sessions.decode_engine_of(s, 6.0) for s in "bcd"] == [4, None, 5]


def test_a_lost_engines_sessions_start_afresh() -> None:
    sessions = Sessions(retention_s=300.0)
    sessions.on_assigned("a", 2, 0.0)
    sessions.on_assigned("b", 3, 0.0)
    sessions.engine_lost(2)
    assert sessions.decode_engine_of("a", 1.0) is None
    assert sessions.decode_engine_of("b", 1.0) == 3
    assert sessions.on_assigned("a", 3, 1.0) == "first"


def test_no_retention_turns_sessions_off() -> None:
    sessions = Sessions(retention_s=0.0)
    assert sessions.on_assigned("a", 2, 0.0) == "first"
    assert sessions.decode_engine_of("a", 0.0) is None
    assert sessions.on_assigned("a", 2, 0.0) == "first"
    assert sessions.retention_s_of("a") == 0.0
    assert sessions.num_active(0.0) == 0


@pytest.mark.parametrize(
    ("retention_s", "max_num_sessions", "field"),
    [(-1.0, 10, "retention_s"), (1.0, 0, "max_num_sessions")],
)
def test_bad_bounds_are_refused(retention_s, max_num_sessions, field) -> None:
    with pytest.raises(ValueError, match=field):
        Sessions(retention_s, max_num_sessions=max_num_sessions)

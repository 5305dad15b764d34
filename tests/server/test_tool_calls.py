"""The tool-call parser: what is a call and what stays text, and that any split of an output
gives the events of the whole (Hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.server.tool_calls import (
    Event,
    ParsedToolCall,
    ToolCallParser,
    new_tool_call_id,
    parse_tool_calls,
)

CALL = '<tool_call>\n{"name": "ls", "arguments": {"d": "."}}\n</tool_call>'
LS = ParsedToolCall(0, "ls", '{"d": "."}')


def events_of(pieces: list[str]) -> list[Event]:
    """The parser's events for ``pieces`` pushed one by one, adjacent text merged."""
    parser = ToolCallParser()
    events: list[Event] = []
    for piece in pieces:
        events += parser.push(piece)
    events += parser.finish()
    merged: list[Event] = []
    for event in events:
        if isinstance(event, str) and merged and isinstance(merged[-1], str):
            merged[-1] += event
        else:
            merged.append(event)
    return merged


# --- what is a call -------------------------------------------------------------------------


def test_a_call_alone_has_no_text() -> None:
    assert parse_tool_calls(CALL) == ("", [LS])


def test_text_before_a_call_keeps_its_words_not_the_newline() -> None:
    assert parse_tool_calls(f"Let me look.\n{CALL}") == ("Let me look.", [LS])


def test_two_calls_are_numbered_and_the_layout_between_them_dropped() -> None:
    second = CALL.replace('"ls"', '"cat"')
    text, calls = parse_tool_calls(f"{CALL}\n{second}\n")
    assert text == ""
    assert calls == [LS, ParsedToolCall(1, "cat", '{"d": "."}')]


def test_arguments_are_json_dumps_of_the_object() -> None:
    _, calls = parse_tool_calls(
        '<tool_call>{"name":"f","arguments":{"a":[1,2],"b":"é"}}</tool_call>'
    )
    assert calls[0].arguments == '{"a": [1, 2], "b": "é"}'
    assert json.loads(calls[0].arguments) == {"a": [1, 2], "b": "é"}


def test_missing_arguments_are_an_empty_object() -> None:
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')[1] == [
        ParsedToolCall(0, "now", "{}")
    ]


def test_the_last_call_may_lack_its_closing_tag() -> None:
    assert parse_tool_calls('<tool_call>\n{"name": "ls", "arguments": {"d": "."}}\n') == (
        "",
        [LS],
    )


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',  # not an object
        '<tool_call>["f", {}]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>',  # lone surrogate
        '<tool_call>{"name": "f"',  # cut off
        '<tool_call>{"name": "f", <tool_call>{"name": "g"}</tool_call>',
        "</tool_call>",
        "[" * 100_000,  # too deep for the JSON parser
    ],
)
def test_anything_else_stays_text_unchanged(block: str) -> None:
    output = f"Sure.\n{block}\nDone."
    assert parse_tool_calls(output) == (output, [])


def test_a_malformed_call_keeps_its_whitespace_and_a_good_one_after_it_still_counts() -> None:
    bad = "<tool_call>{oops}</tool_call>"
    assert parse_tool_calls(f"A\n{bad}\n{CALL}") == (f"A\n{bad}", [LS])


def test_text_after_a_call_is_kept() -> None:
    assert parse_tool_calls(f"{CALL}\nthen this\n") == ("then this\n", [LS])


def test_text_around_calls_is_separated_by_the_whitespace_before_them() -> None:
    assert parse_tool_calls(f"A \n{CALL}\n{CALL}\nB") == (
        "A \nB",
        [LS, ParsedToolCall(1, "ls", LS.arguments)],
    )
    assert parse_tool_calls(f"A{CALL}B") == ("AB", [LS])


def test_without_a_tag_the_text_is_the_output() -> None:
    for output in ("", "  hello  \n", "a <tool call> b <", "x</tool_call>y"):
        assert parse_tool_calls(output) == (output, [])


def test_ids_are_openai_shaped_and_distinct() -> None:
    first, second = new_tool_call_id(), new_tool_call_id()
    assert first.startswith("call_") and len(first) == 29 and first != second


# --- streaming ------------------------------------------------------------------------------


def test_a_possible_tag_start_and_whitespace_are_held_until_decided() -> None:
    parser = ToolCallParser()
    assert parser.push("Hi <tool") == ["Hi"]
    assert parser.push("_c") == []
    assert parser.push("at") == [" <tool_cat"]
    assert parser.push("\n\n") == []
    assert parser.push("<tool_call>") == []
    assert parser.push('{"name": "ls", "arguments": {"d": "."}}') == []
    assert parser.push("</tool_call>\n") == [LS]
    assert parser.finish() == []
    assert parser.num_calls == 1


def test_an_open_call_is_decided_at_the_end() -> None:
    parser = ToolCallParser()
    assert parser.push('A <tool_call>{"name": "f"') == ["A"]
    assert parser.finish() == [' <tool_call>{"name": "f"']
    with pytest.raises(RuntimeError):
        parser.push("more")


def test_a_long_call_is_searched_once_per_piece() -> None:
    # Correctness of the incremental search: a closing tag split across many pieces.
    pieces = [
        '<tool_call>{"name": "f", "arguments": {"s": "',
        "x" * 1000,
        '"}}</tool',
        "_",
        "call>",
    ]
    assert events_of(pieces) == [ParsedToolCall(0, "f", json.dumps({"s": "x" * 1000}))]


_FRAGMENTS = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<tool",
        "_call>",
        "<",
        "/",
        ">",
        '{"name": "f", "arguments": {"a": 1}}',
        '{"name": "g"}',
        '{"name": ',
        '"h", "arguments": {}}',
        "{",
        "}",
        '"',
        "\n",
        " ",
        "text",
        "é",
    ]
)


@st.composite
def outputs_and_splits(draw: st.DrawFn) -> tuple[str, list[str]]:
    output = "".join(draw(st.lists(_FRAGMENTS, max_size=30)))
    cuts = sorted(draw(st.lists(st.integers(0, len(output)), max_size=12)))
    bounds = [0, *cuts, len(output)]
    return output, [output[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@given(outputs_and_splits())
def test_any_split_gives_the_events_of_the_whole(case: tuple[str, list[str]]) -> None:
    output, pieces = case
    assert "".join(pieces) == output
    assert events_of(pieces) == events_of([output])


@given(outputs_and_splits())
def test_without_calls_the_text_is_the_output_and_calls_are_numbered(
    case: tuple[str, list[str]],
) -> None:
    output, pieces = case
    events = events_of(pieces)
    calls = [e for e in events if isinstance(e, ParsedToolCall)]
    assert [c.index for c in calls] == list(range(len(calls)))
    if not calls:
        assert "".join(e for e in events if isinstance(e, str)) == output


@given(
    st.lists(
        st.one_of(
            st.text(st.characters(codec="utf-8", exclude_characters="<"), min_size=1),
            st.tuples(
                st.text(min_size=1, max_size=8),
                st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5)),
            ),
        ),
        max_size=6,
    )
)
def test_calls_written_as_qwen_writes_them_come_back(parts: list) -> None:
    # Text pieces with no "<" and calls in Qwen2.5's layout, in any order.
    output, expected_calls, text_runs = "", [], [""]
    for part in parts:
        if isinstance(part, str):
            output += part
            text_runs[-1] += part
        else:
            name, arguments = part
            call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
            output += f"\n<tool_call>\n{call}\n</tool_call>\n"
            expected_calls.append((name, json.dumps(arguments, ensure_ascii=False)))
            text_runs.append("")
    text, calls = parse_tool_calls(output)
    assert [(c.name, c.arguments) for c in calls] == expected_calls
    if not calls:
        assert text == output
    else:  # the words are all there, in order, and text runs stay apart
        assert text.split() == "\n".join(text_runs).split()

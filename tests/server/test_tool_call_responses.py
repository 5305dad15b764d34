"""Tool calls in OpenAI's response shapes: the message of a whole output, and the chunks of a
streamed one, which add up to that message however the output arrives (no server here)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence

from hypothesis import given
from hypothesis import strategies as st

from dualpath.server.generation import ChoiceDelta
from dualpath.server.responses import ResponseMeta, chat_chunks, chat_message
from dualpath.server.tool_calls import ToolCallParser

META = ResponseMeta(id="chatcmpl-1", created_unix_s=0, model="tiny", return_token_ids=False)
CALL = '<tool_call>\n{"name": "ls", "arguments": {"d": "."}}\n</tool_call>'


class NoDecoder:
    def decode(self, token_ids: Sequence[int]) -> str:
        raise AssertionError("no log-probabilities were asked for")


def ids() -> Iterator[str]:
    return (f"call_{i}" for i in itertools.count())


def stream(
    pieces: list[str], finish_reason: str, *, parses_tool_calls: bool = True, meta=META
) -> list[dict]:
    """The chunks of an output arriving in ``pieces``, the last delta finishing it."""
    parser = ToolCallParser() if parses_tool_calls else None
    new_ids = ids()
    chunks = []
    for i, piece in enumerate(pieces):
        is_last = i == len(pieces) - 1
        delta = ChoiceDelta(0, piece, (i,), (), finish_reason if is_last else None)
        chunks += chat_chunks(
            meta,
            delta,
            parser,
            want_logprobs=False,
            decoder=NoDecoder(),
            new_call_id=lambda: next(new_ids),
        )
    return chunks


def accumulate(chunks: list[dict]) -> tuple[dict, str | None]:
    """The message a client builds from the chunks, as the openai library does."""
    content, calls, finish_reason = None, {}, None
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        if "content" in delta:
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], {"function": {"arguments": ""}})
            for key in ("id", "type"):
                if key in call:
                    entry[key] = call[key]
            function = call.get("function", {})
            if "name" in function:
                entry["function"]["name"] = function["name"]
            entry["function"]["arguments"] += function.get("arguments", "")
        finish_reason = choice["finish_reason"] or finish_reason
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish_reason


def test_a_call_is_a_tool_call_and_no_content() -> None:
    new_ids = ids()
    message, finish_reason = chat_message(
        CALL, "stop", parses_tool_calls=True, new_call_id=lambda: next(new_ids)
    )
    assert finish_reason == "tool_calls"
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "ls", "arguments": '{"d": "."}'},
            }
        ],
    }


def test_text_before_calls_is_content() -> None:
    message, _ = chat_message(f"Looking.\n{CALL}\n{CALL}", "stop", parses_tool_calls=True)
    assert message["content"] == "Looking."
    assert len(message["tool_calls"]) == 2
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])


def test_without_parsing_or_without_calls_the_output_is_content() -> None:
    for text, parses in ((CALL, False), ("plain", True), ("<tool_call>{bad}</tool_call>", True)):
        assert chat_message(text, "stop", parses_tool_calls=parses) == (
            {"role": "assistant", "content": text},
            "stop",
        )
    assert chat_message("", "stop", parses_tool_calls=True)[0]["content"] == ""


def test_an_output_cut_short_keeps_length() -> None:
    assert chat_message(CALL, "length", parses_tool_calls=True)[1] == "length"


def test_a_streamed_call_is_a_head_then_its_arguments_then_the_finish() -> None:
    pieces = [
        "Looking.",
        "\n<tool",
        "_call>\n",
        '{"name": "ls", ',
        '"arguments": {"d": "."}}',
        "\n",
    ]
    pieces += ["</tool_call>", ""]
    deltas = [c["choices"][0]["delta"] for c in stream(pieces, "stop")]
    finishes = [c["choices"][0]["finish_reason"] for c in stream(pieces, "stop")]
    assert deltas == [
        {"content": "Looking."},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "ls", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"d": "."}'}}]},
        {},
    ]
    assert finishes == [None, None, None, "tool_calls"]


def test_token_ids_go_with_the_first_chunk_of_a_delta() -> None:
    meta = ResponseMeta(id="x", created_unix_s=0, model="tiny", return_token_ids=True)
    chunks = stream([f"A\n{CALL}"], "stop", meta=meta)
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[0], [], []]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "tool_calls"]


def test_held_text_makes_no_chunk_until_decided() -> None:
    chunks = stream(["Hi", " <tool", "_ca", "t>"], "stop")
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"content": "Hi"},
        {"content": " <tool_cat>"},
    ]


_FRAGMENTS = st.sampled_from(
    [CALL, "<tool_call>", "</tool_call>", "<tool", '{"name": "f"}', "{", "\n", " ", "word"]
)


@given(
    st.lists(_FRAGMENTS, max_size=12).map("".join),
    st.lists(st.integers(0, 400), max_size=8),
    st.sampled_from(["stop", "length"]),
)
def test_the_stream_adds_up_to_the_message(output: str, cuts: list[int], finish: str) -> None:
    bounds = [0, *sorted(c for c in cuts if c <= len(output)), len(output)]
    pieces = [output[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    new_ids = ids()
    expected = chat_message(
        output, finish, parses_tool_calls=True, new_call_id=lambda: next(new_ids)
    )
    message, finish_reason = accumulate(stream(pieces, finish))
    if expected[0]["content"] == "":  # the stream sends no empty content
        expected[0]["content"] = None
    assert (message, finish_reason) == expected
    for call in message.get("tool_calls", ()):
        json.loads(call["function"]["arguments"])

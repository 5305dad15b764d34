"""Responses API requests and output without a server (dualpath/server/openai_responses.py,
responses_output.py): items become the chat messages a chat request would give, output items
go back into the same messages, a stream's events add up to the body's items."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import ValidationError

from dualpath.model.presets import CHAT_TEMPLATE
from dualpath.server.chat import ChatRenderer
from dualpath.server.errors import APIError
from dualpath.server.generation import ChoiceDelta
from dualpath.server.openai_responses import (
    ResponsesRequest,
    conversation_of,
    output_conversation,
)
from dualpath.server.protocol import ChatMessage
from dualpath.server.response_store import ResponseStore
from dualpath.server.responses_output import ResponseOutput
from dualpath.server.responses_routes import Turn, _stream, feed
from dualpath.server.tool_calls import ToolCallParser
from dualpath.types import RequestScope

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def request(input: Any, **fields: Any) -> ResponsesRequest:
    return ResponsesRequest(model="m", input=input, **fields)


def counters() -> dict[str, Any]:
    """Deterministic ids for ResponseOutput."""
    count = iter(range(1000))
    return {"new_id": lambda prefix: f"{prefix}_{next(count)}", "new_call_id": lambda: "call_x"}


# --- items -> messages -------------------------------------------------------------------------


def test_a_string_is_one_user_message() -> None:
    assert conversation_of(request("Hi").input_items()) == [{"role": "user", "content": "Hi"}]


def test_items_become_the_messages_chat_gives_the_same_conversation() -> None:
    arguments = json.dumps({"city": "Rome"})
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # dropped
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "c1",
            "name": "f",
            "arguments": arguments,
        },
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "ok"}],
        },
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "A"}, {"type": "input_text", "text": "B"}],
        },
    ]
    chat = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
    ]
    expected = [ChatMessage(**message).to_template() for message in chat]
    assert conversation_of(request(items).input_items()) == expected
    assert expected[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}


def test_a_call_without_text_before_it_is_an_assistant_message_of_its_own() -> None:
    items = [
        {"role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    (_, assistant) = conversation_of(request(items).input_items())
    assert assistant["role"] == "assistant" and assistant["content"] is None
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {}}


def test_output_items_sent_back_render_as_the_stored_conversation() -> None:
    output = ResponseOutput(**counters())
    output.add_text("Looking it up.")
    output.add_call("get_weather", '{"city": "Paris"}')
    output.finish(is_incomplete=False)
    # What a client sends back: the SDK's dump of the output items, ids and status included.
    sent_back = conversation_of(request(json.loads(json.dumps(output.items))).input_items())
    assert output_conversation(output.items) == sent_back
    renderer = ChatRenderer(CHAT_TEMPLATE)
    rendered = renderer.render([{"role": "user", "content": "Weather?"}, *sent_back])
    # The model's own words: its text, then the call as the template writes calls.
    assert f"<|im_start|>assistant\nLooking it up.\n{CALL}<|im_end|>" in rendered


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "location", "words"),
    [
        ({"input": [{"type": "local_shell_call"}]}, ("input",), "'local_shell_call'"),
        ({"tools": [{"type": "file_search"}]}, ("tools",), "'file_search'"),
        ({"stream_options": {}}, ("stream_options",), "Extra inputs"),
        (
            {"input": [{"role": "tool", "content": "x"}]},
            ("input", "items", 0, "message", "role"),
            "",
        ),
    ],
)
def test_unknown_fields_items_and_tools_are_refused_by_name(
    fields: dict[str, Any], location: tuple, words: str
) -> None:
    with pytest.raises(ValidationError) as error:
        ResponsesRequest(**{"model": "m", "input": "Hi", **fields})
    (first, *_) = error.value.errors()
    assert first["loc"] == location and words in first["msg"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"tools": [{"type": "function", "name": "f", "strict": True}]}, "tools"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ],
)
def test_what_cannot_be_honoured_is_a_400(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as error:
        request("Hi", **fields).check_supported()
    assert (error.value.status, error.value.param) == (400, param)


@pytest.mark.parametrize(
    "item",
    [
        {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1, 2"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "NaN"},
    ],
)
def test_unrenderable_items_are_a_400_naming_input(item: dict[str, Any]) -> None:
    with pytest.raises(APIError) as error:
        conversation_of(request([item]).input_items())
    assert (error.value.status, error.value.param) == (400, "input")


def test_function_tools_reach_the_template_as_chat_tools_do() -> None:
    parameters = {"type": "object", "properties": {}}
    body = request("Hi", tools=[{"type": "function", "name": "f", "parameters": parameters}])
    assert body.template_tools() == [
        {"type": "function", "function": {"name": "f", "parameters": parameters}}
    ]
    assert body.parses_tool_calls
    assert not request("Hi", tools=body.tools, tool_choice="none").parses_tool_calls


# --- output items and their events --------------------------------------------------------------


def test_items_come_in_the_order_written_each_finished_before_the_next() -> None:
    output = ResponseOutput(**counters())
    events = output.add_text("A") + output.add_call("f", "{}") + output.add_text("B")
    events += output.finish(is_incomplete=True)
    assert [(e["type"], e["output_index"]) for e in events] == [
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.content_part.added", 2),
        ("response.output_text.delta", 2),
        ("response.output_text.done", 2),
        ("response.content_part.done", 2),
        ("response.output_item.done", 2),
    ]
    assert [(item["type"], item["status"]) for item in output.items] == [
        ("message", "completed"),
        ("function_call", "completed"),
        ("message", "incomplete"),  # the output was cut short in it
    ]
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    assert events[5]["item"] == output.items[0]


def test_an_empty_output_is_one_empty_message() -> None:
    output = ResponseOutput(**counters())
    events = output.finish(is_incomplete=False)
    assert output.items == [
        {
            "id": "msg_0",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": []}],
        }
    ]
    assert [e["type"] for e in events][-1] == "response.output_item.done"


def test_any_split_of_an_output_gives_the_items_of_the_whole() -> None:
    text = f"Sure.\n{CALL}\nDone."

    def items_of(pieces: list[str]) -> tuple[list[dict], list[dict]]:
        output, parser = ResponseOutput(**counters()), ToolCallParser()
        events = []
        for i, piece in enumerate(pieces):
            events += feed(output, parser, piece, is_last=i == len(pieces) - 1)
        events += output.finish(is_incomplete=False)
        return output.items, events

    whole, whole_events = items_of([text])
    assert [item["type"] for item in whole] == ["message", "function_call", "message"]
    assert whole[1]["arguments"] == '{"city": "Paris"}'
    for cut in range(1, len(text)):
        items, events = items_of([text[:cut], text[cut:]])
        assert items == whole, cut
        # Text deltas differ with the split; every other event is the same.
        same = [e for e in events if e["type"] != "response.output_text.delta"]
        assert same == [e for e in whole_events if e["type"] != "response.output_text.delta"]


# --- a stream that fails --------------------------------------------------------------------


class FailingGeneration:
    """A ``Generation`` whose engine request fails after its first delta."""

    choices: list = []

    async def deltas(self):
        yield ChoiceDelta(0, "Hel", (1,), (), None)
        raise APIError(500, "generation failed: the prefill raised")


def test_a_generation_that_fails_mid_stream_ends_with_response_failed() -> None:
    store = ResponseStore.open(None, max_count=10, max_bytes=1 << 20)
    body = request("Hi")
    turn = Turn(store, body, RequestScope(), conversation_of(body.input_items()))

    async def events() -> list[dict[str, Any]]:
        sse = [event async for event in _stream(FailingGeneration(), turn, turn.head(None))]
        return [json.loads(event.split("data: ", 1)[1]) for event in sse]

    sent = asyncio.run(events())
    assert [e["type"] for e in sent] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.failed",
    ]
    assert [e["sequence_number"] for e in sent] == list(range(6))
    failed = sent[-1]["response"]
    assert failed["status"] == "failed" and failed["id"] == turn.id
    assert failed["error"] == {
        "code": "server_error",
        "message": "generation failed: the prefill raised",
    }
    assert failed["output"][0]["content"][0]["text"] == "Hel"
    assert store.get(turn.id, None) is None  # a failed response is not kept

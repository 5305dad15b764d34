"""The Anthropic Messages API without a server: requests converted to chat messages (and so to
the prompt /v1/chat/completions renders), outputs to messages and SSE events, and a forwarded
chat answer to the same (dualpath/server/anthropic_*.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from dualpath.model.generation_config import SamplingDefaults
from dualpath.model.presets import CHAT_TEMPLATE
from dualpath.server.anthropic_forwarding import (
    ForwardedMessageStream,
    chat_body,
    message_of_completion,
)
from dualpath.server.anthropic_protocol import (
    MessagesRequest,
    sampling_params,
    to_chat_messages,
    to_chat_tools,
    to_template_messages,
)
from dualpath.server.anthropic_responses import MessageStream, message_body
from dualpath.server.anthropic_routes import stream_events
from dualpath.server.chat import ChatRenderer
from dualpath.server.errors import APIError
from dualpath.server.generation import ChoiceDelta
from dualpath.server.protocol import ChatMessage

TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def request(messages: list[dict], **fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "tiny", "max_tokens": 16, "messages": messages, **fields}
    )


def tool_use(name: str, tool_input: dict) -> dict:
    return {"type": "tool_use", "id": "t", "name": name, "input": tool_input}


def tool_result(content: str | list) -> dict:
    return {"type": "tool_result", "tool_use_id": "t", "content": content}


def conversation() -> list[dict]:
    """A turn with a call and its result, as Claude Code sends it back (cache_control and
    keys we do not use included)."""
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look.", "citations": None},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [
                        {"type": "text", "text": "21 degrees"},
                        {"type": "text", "text": "sunny"},
                    ],
                    "is_error": False,
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "text", "text": "And tomorrow?"},
                {"type": "text", "text": ""},  # empty blocks are left out
            ],
        },
    ]


# --- requests -> chat messages ---------------------------------------------------------------


def test_a_conversation_becomes_the_chat_messages_of_the_same_turns() -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=ab12;"},
        {"type": "text", "text": "You are a helper.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": " Be brief."},
    ]
    body = request(conversation(), system=system, tools=[TOOL])
    arguments = json.dumps({"city": "Paris"})
    assert to_chat_messages(body) == [
        {"role": "system", "content": "You are a helper. Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 degrees\nsunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert to_chat_tools(body.tools) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city",
                "parameters": TOOL["input_schema"],
            },
        }
    ]


def test_the_template_reads_what_a_chat_request_of_the_same_turns_gives_it() -> None:
    anthropic = request(conversation())
    chat = [ChatMessage.model_validate(m) for m in to_chat_messages(anthropic)]
    assert to_template_messages(to_chat_messages(anthropic)) == [m.to_template() for m in chat]
    # An answer that was only a call renders back as the model wrote it.
    only_call = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [tool_use("get_weather", {"city": "Paris"})]},
        {"role": "user", "content": [tool_result("sunny")]},
    ]
    body = request(only_call, tools=[TOOL])
    prompt = ChatRenderer(CHAT_TEMPLATE).render(
        to_template_messages(to_chat_messages(body)), tools=to_chat_tools(body.tools)
    )
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>\n" in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in prompt


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        (
            [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}],
            "messages.0.content.0.type",
            "'image'",
        ),
        (
            [{"role": "user", "content": [tool_use("f", {})]}],
            "messages.0.content.0",
            "tool_use blocks belong in assistant messages",
        ),
        (
            [{"role": "user", "content": [tool_result([{"type": "image"}])]}],
            "messages.0.content.0.content.0",
            "'image'",
        ),
        (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
            "messages.1.role",
            "continuing an assistant message is not supported",
        ),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            "messages.0.content.0.text",
            "needs its text",
        ),
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hel"},
                {"role": "system", "content": "Be brief."},
            ],
            "messages.1.role",
            "continuing an assistant message is not supported",
        ),
        (
            [{"role": "system", "content": [tool_use("f", {})]}],
            "messages.0.content.0",
            "tool_use blocks belong in assistant messages",
        ),
    ],
)
def test_what_cannot_be_converted_is_a_400_naming_the_block(
    messages: list[dict], param: str, words: str
) -> None:
    with pytest.raises(APIError) as caught:
        to_chat_messages(request(messages))
    assert (caught.value.status, caught.value.param) == (400, param)
    assert words in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice"),
        (
            {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
            "tool_choice.disable_parallel_tool_use",
        ),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ],
)
def test_what_we_cannot_honour_is_refused(fields: dict, param: str) -> None:
    body = request([{"role": "user", "content": "Hi"}], tools=[TOOL], **fields)
    with pytest.raises(APIError) as caught:
        body.check_supported()
    assert (caught.value.status, caught.value.param) == (400, param)


def test_what_claude_code_sends_that_changes_no_token_is_accepted() -> None:
    text = {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}
    body = request(
        [{"role": "user", "content": [text]}],
        tools=[{**TOOL, "defer_loading": False, "input_examples": []}],
        tool_choice={"type": "auto"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "user_abc_session_1"},
        context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
        output_config={"effort": "high"},
        service_tier="auto",
    )
    body.check_supported()
    assert to_chat_messages(body) == [{"role": "user", "content": "Hi"}]
    # Claude Code's environment: a system message after the user's, rendered where it stands.
    environment = {"role": "system", "content": [{"type": "text", "text": "# Environment"}]}
    body = request([{"role": "user", "content": [text]}, environment])
    assert to_chat_messages(body) == [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "# Environment"},
    ]
    with pytest.raises(ValidationError, match="extra_forbidden|Extra inputs"):
        request([{"role": "user", "content": "Hi"}], container="c1")


def test_sampling_takes_the_checkpoints_defaults_and_checks_stop_sequences() -> None:
    defaults = SamplingDefaults(temperature=0.6, top_k=20)
    body = request([{"role": "user", "content": "Hi"}], top_p=0.5, stop_sequences=["\n\n"])
    params = sampling_params(body, max_tokens=16, defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.stop) == (
        0.6,
        0.5,
        20,
        ("\n\n",),
    )
    assert sampling_params(body, max_tokens=16, defaults=SamplingDefaults()).temperature == 1.0
    empty_stop = request([{"role": "user", "content": "Hi"}], stop_sequences=[""])
    with pytest.raises(APIError) as caught:
        sampling_params(empty_stop, max_tokens=16, defaults=defaults)
    assert caught.value.param == "stop_sequences"


# --- outputs -> messages and events ----------------------------------------------------------


def fake_generation(text: str, finish_reason: str, stop_string: str | None = None) -> Any:
    """What message_body and MessageStream read of a finished one-choice Generation."""
    choice = SimpleNamespace(
        text=text, finish_reason=finish_reason, detokenizer=SimpleNamespace(stop_string=stop_string)
    )
    usage = {
        "prompt_tokens": 200,
        "completion_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 128},
    }
    return SimpleNamespace(choices=[choice], usage=lambda: usage)


def accumulate(events: list[str]) -> dict[str, Any]:
    """The message a client builds from the SSE events (as Anthropic's SDK does)."""
    message: dict[str, Any] = {}
    partial_json: dict[int, str] = {}
    for event in events:
        name, data = event.removesuffix("\n\n").split("\n")
        data = json.loads(data.removeprefix("data: "))
        assert name == f"event: {data['type']}"
        if data["type"] == "message_start":
            message = data["message"]
        elif data["type"] == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(data["content_block"])
        elif data["type"] == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                partial_json[data["index"]] = (
                    partial_json.get(data["index"], "") + delta["partial_json"]
                )
                block["input"] = json.loads(partial_json[data["index"]])
        elif data["type"] == "message_delta":
            message.update(data["delta"], usage=data["usage"])
    assert json.loads(events[-1].split("data: ")[1]) == {"type": "message_stop"}
    return message


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    content = [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]
    return {**message, "content": content}


@pytest.mark.parametrize(
    ("text", "stop_string", "stop_reason", "block_types"),
    [
        (f"Let me look.\n{CALL}\nDone.", None, "tool_use", ["text", "tool_use", "text"]),
        (f"{CALL}\n{CALL}", None, "tool_use", ["tool_use", "tool_use"]),
        ("Hello there", "###", "stop_sequence", ["text"]),
        ("", None, "end_turn", ["text"]),
    ],
)
def test_streamed_events_add_up_to_the_whole_message(
    text: str, stop_string: str | None, stop_reason: str, block_types: list[str]
) -> None:
    generation = fake_generation(text, "stop", stop_string)
    whole = message_body("msg_1", "tiny", generation, parses_tool_calls=True)
    assert [b["type"] for b in whole["content"]] == block_types
    assert (whole["stop_reason"], whole["stop_sequence"]) == (stop_reason, stop_string)
    assert whole["usage"] == {
        "input_tokens": 72,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 128,
        "output_tokens": 30,
    }
    stream = MessageStream("msg_1", "tiny", generation, parses_tool_calls=True)
    events = [stream.push(ChoiceDelta(0, c, (1,), (), None)) for c in text]  # char by char
    events.append(stream.push(ChoiceDelta(0, "", (2,), (), "stop")))
    assert without_ids(accumulate([e for es in events for e in es])) == without_ids(whole)


def test_a_generation_that_fails_mid_stream_ends_with_an_error_event() -> None:
    generation = fake_generation("Hi", "stop")

    async def deltas() -> AsyncIterator[ChoiceDelta]:
        yield ChoiceDelta(0, "Hi", (1,), (), None)
        raise APIError(503, "generation failed: no engine could go on with it")

    generation.deltas = deltas
    stream = MessageStream("m", "tiny", generation, parses_tool_calls=False)

    async def collect() -> list[str]:
        return [event async for event in stream_events(stream, generation)]

    events = asyncio.run(collect())
    assert [e.split("\n")[0] for e in events] == [
        "event: message_start",
        "event: content_block_start",
        "event: content_block_delta",
        "event: error",
    ]
    assert json.loads(events[-1].split("data: ")[1]) == {
        "type": "error",
        "error": {
            "type": "overloaded_error",
            "message": "generation failed: no engine could go on with it",
        },
    }


def test_a_call_cut_by_max_tokens_says_so_and_without_tools_a_call_is_text() -> None:
    whole = message_body("m", "tiny", fake_generation(CALL, "length"), parses_tool_calls=True)
    assert whole["stop_reason"] == "max_tokens" and whole["content"][0]["type"] == "tool_use"
    whole = message_body("m", "tiny", fake_generation(CALL, "stop"), parses_tool_calls=False)
    assert whole["content"] == [{"type": "text", "text": CALL}]
    assert whole["stop_reason"] == "end_turn"


# --- forwarding: a vLLM server's chat answer as a message --------------------------------------


def test_the_chat_body_a_message_is_forwarded_as() -> None:
    body = request(
        conversation(),
        tools=[TOOL],
        tool_choice={"type": "auto"},
        stop_sequences=["END"],
        temperature=0,
        stream=True,
        cache_salt="tenant-a",
    )
    assert chat_body(body) == {
        "model": "tiny",
        "messages": to_chat_messages(body),
        "max_tokens": 16,
        "stream": True,
        "tools": to_chat_tools(body.tools),
        "tool_choice": "auto",
        "stop": ["END"],
        "temperature": 0,
        "cache_salt": "tenant-a",
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def chat_chunk(delta: dict | None = None, **fields: Any) -> str:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": None, **fields}
    return f"data: {json.dumps({'id': 'c', 'choices': [choice]})}\n\n"


async def pieces(*items: str) -> AsyncIterator[str]:
    for item in items:
        yield item


def forwarded_events(*items: str) -> list[str]:
    async def collect() -> list[str]:
        stream = ForwardedMessageStream("msg_9", "tiny")
        return [event async for event in stream.events(pieces(*items))]

    return asyncio.run(collect())


def test_a_forwarded_chat_stream_adds_up_to_the_forwarded_whole_answer() -> None:
    call = {"index": 0, "id": "chatcmpl-tool-1", "type": "function"}
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    role = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    events = forwarded_events(
        f"data: {json.dumps({**role, 'prompt_token_ids': list(range(100))})}\n\n",
        chat_chunk({"content": "Let me "}, token_ids=[1, 2]),
        chat_chunk({"content": "look."}, token_ids=[3]),
        chat_chunk({"tool_calls": [{**call, "function": {"name": "get_weather"}}]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chat_chunk(finish_reason="tool_calls", stop_reason=None),
        f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n",
        "data: [DONE]\n\n",
    )
    whole_call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    start = json.loads(events[0].split("data: ")[1])["message"]
    assert start["usage"]["input_tokens"] == 100  # the prompt, counted from its token ids
    completion = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Let me look.",
                    "tool_calls": [{**call, "function": whole_call}],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": usage,
    }
    whole = message_of_completion("msg_9", "tiny", json.dumps(completion).encode())
    assert accumulate(events) == whole
    assert whole["content"][1] == {
        "type": "tool_use",
        "id": "chatcmpl-tool-1",
        "name": "get_weather",
        "input": {"city": "Paris"},
    }
    assert (whole["stop_reason"], whole["usage"]["cache_read_input_tokens"]) == ("tool_use", 64)


def test_a_forwarded_stream_that_fails_ends_with_an_anthropic_error_event() -> None:
    error = {
        "error": {
            "message": "generation failed: lost",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    events = forwarded_events(
        chat_chunk({"content": "Hi"}), f"data: {json.dumps(error)}\n\n", "data: [DONE]\n\n"
    )
    assert events[-1] == (
        'event: error\ndata: {"type":"error","error":{"type":"api_error",'
        '"message":"generation failed: lost"}}\n\n'
    )
    cut = forwarded_events(chat_chunk({"content": "Hi"}))  # no [DONE]
    assert json.loads(cut[-1].split("data: ")[1])["error"]["type"] == "api_error"

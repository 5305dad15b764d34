"""/v1/responses in forwarding mode (dualpath/server/responses_forwarding.py): the request goes to
the fake vLLM servers of test_forwarding.py as its chat request, their chat answer comes back
as a response; streamed, as the response's events. Driven with the official `openai` client."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from dualpath.server.responses_forwarding import ChatAnswer
from dualpath.server.responses_output import ResponseOutput
from dualpath.types import RequestScope
from tests.server.fake_vllm import MODEL, SERVER_MODEL
from tests.server.test_forwarding import Fleet, fleet, servers  # noqa: F401 (fixtures)


@pytest.fixture
def client(fleet: Fleet) -> openai.OpenAI:  # noqa: F811 (the fixture imported above)
    return openai.OpenAI(base_url=f"{fleet.http.base_url}/v1", api_key="none", max_retries=0)


def chat_bodies(fleet: Fleet) -> list[dict[str, Any]]:  # noqa: F811
    """The chat requests the decode servers received, in order."""
    return [body for _, path, body in fleet.journal.entries if path == "/v1/chat/completions"]


def essence(response) -> dict[str, Any]:
    output = [item.model_dump(exclude={"id"}, exclude_none=True) for item in response.output]
    return {"status": response.status, "output": output, "usage": response.usage}


def test_a_response_is_the_chat_answer_to_its_messages(fleet: Fleet, client) -> None:  # noqa: F811
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hi there", max_output_tokens=4
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert response.output_text == chat.choices[0].message.content
    # The fake writes max_tokens tokens: cut short by max_output_tokens.
    assert (response.status, response.incomplete_details.reason) == (
        "incomplete",
        "max_output_tokens",
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 4
    forwarded, _ = chat_bodies(fleet)
    assert forwarded["model"] == SERVER_MODEL and forwarded["messages"] == messages
    assert forwarded["max_tokens"] == 4 and forwarded["stream"] is False


def test_a_forwarded_stream_ends_with_the_response_the_body_gives(client) -> None:
    fields = {"model": MODEL, "input": "Hi there", "max_output_tokens": 3, "store": False}
    whole = client.responses.create(**fields)
    events = list(client.responses.create(**fields, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and len(deltas) == 3
    assert essence(events[-1].response) == essence(whole)


def test_previous_response_id_sends_the_stored_conversation(fleet: Fleet, client) -> None:  # noqa: F811
    first = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hi there", max_output_tokens=2
    )
    second = client.responses.create(
        model=MODEL, input="And then?", max_output_tokens=2, previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    *_, forwarded = chat_bodies(fleet)
    assert forwarded["messages"] == [  # the instructions are not carried over
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]


def test_streamed_tool_calls_are_gathered_into_function_call_items() -> None:
    """vLLM's chunks: a call's id and name, then its arguments in pieces; text first."""
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Checking."}}]},
        {"choices": [{"delta": {"tool_calls": [_call(0, "call_a", "f", "")]}}]},
        {"choices": [{"delta": {"tool_calls": [_call(0, None, None, '{"x": ')]}}]},
        {"choices": [{"delta": {"tool_calls": [_call(0, None, None, "1}")]}}]},
        {"choices": [{"delta": {"tool_calls": [_call(1, "call_b", "g", "{}")]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}},
    ]
    chat, output = ChatAnswer(), ResponseOutput()
    events = [event for chunk in chunks for event in chat.on_chunk(chunk, output)]
    events += chat.finish(output)
    calls = [(i["call_id"], i["name"], i["arguments"]) for i in output.items[1:]]
    assert calls == [("call_a", "f", '{"x": 1}'), ("call_b", "g", "{}")]
    assert output.items[0]["content"][0]["text"] == "Checking."
    assert events[-1]["type"] == "response.output_item.done"
    response = chat.response({"id": "resp_1"}, output)
    assert response["status"] == "completed"
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 0}


def _call(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return call


def test_the_scope_reaches_the_scheduler(fleet: Fleet, client) -> None:  # noqa: F811
    """prompt_cache_key names the session when nothing else does; a session header wins."""
    salted = {"cache_salt": "tenant-a"}
    fields = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, "store": False}
    client.responses.create(**fields, prompt_cache_key="conversation-1", extra_body=salted)
    client.responses.create(
        **fields, prompt_cache_key="conversation-1", extra_headers={"X-Session-Id": "agent-7"}
    )
    assert fleet.cluster.scopes == [
        RequestScope(cache_salt="tenant-a", session_id="conversation-1"),
        RequestScope(session_id="agent-7"),
    ]
    *_, forwarded = chat_bodies(fleet)
    assert forwarded["session_id"] == "agent-7" and "cache_salt" not in forwarded

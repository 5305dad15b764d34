"""The Anthropic Messages API (/v1/messages) through a real `dualpath serve` and the official
`anthropic` client, on real weights.

SmolLM2-135M-Instruct with our Hermes/Qwen-style chat template and greedy decoding, as in
test_tool_call_serving.py: asked about the weather after two examples answered with a call,
it calls get_weather for the new city. One server for the module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.server.serving import API_KEY, MODEL, Server, auth, start_server
from tests.server.test_tool_call_serving import TOOLS, link_checkpoint

pytest.importorskip("nixl_cu12")

BLOCK_SIZE_TOKENS = 64  # serve's default
MAX_TOKENS = 40  # a call takes about 32 tokens
SYSTEM = "You answer every question with a tool call."
TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": TOOLS[0]["function"]["parameters"],
}


def question(city: str) -> dict:
    return {"role": "user", "content": f"What is the weather in {city}?"}


def few_shot() -> list[dict]:
    """Two questions answered with a call (as test_tool_call_serving's chat few-shot)."""
    messages = []
    for i, city in enumerate(("London", "Rome")):
        call = {
            "type": "tool_use",
            "id": f"toolu_{i}",
            "name": "get_weather",
            "input": {"city": city},
        }
        messages += [question(city), {"role": "assistant", "content": [call]}]
    return messages


def weather(city: str, **fields: Any) -> dict[str, Any]:
    """A messages.create request that the model answers with a call for ``city``. Greedy:
    ``temperature`` 0 (the SDK's 2.x signature lacks it; the API has it)."""
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "system": SYSTEM, "tools": [TOOL]}
    request |= {"messages": [*few_shot(), question(city)], "extra_body": {"temperature": 0}}
    return request | fields


@pytest.fixture(scope="module")
def server(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("anthropic")
    generation_config = {"eos_token_id": 2, "top_k": 1, "max_new_tokens": MAX_TOKENS}
    model_dir = link_checkpoint(smollm2_model_dir, root, generation_config)
    # Turn 2's hits are exact once turn 1's blocks are written: it waits for them. 1P1D:
    # nothing here depends on the topology, and one engine process fewer starts.
    with start_server(model_dir, root, "--persist-wait-s", "120", "--nodes", "1P1D") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    """Anthropic's SDK: the key goes as x-api-key."""
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def without_ids(blocks: list) -> list[dict]:
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in blocks]


def test_a_tool_call_comes_back_as_a_tool_use_block(client: anthropic.Anthropic) -> None:
    out = client.messages.create(**weather("Paris"))
    assert (out.type, out.role, out.model, out.stop_reason) == (
        "message",
        "assistant",
        MODEL,
        "tool_use",
    )
    assert out.id.startswith("msg_") and out.stop_sequence is None
    (block,) = out.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert block.id.startswith("toolu_")
    prompt = client.messages.count_tokens(
        model=MODEL, system=SYSTEM, tools=[TOOL], messages=[*few_shot(), question("Paris")]
    )
    usage = out.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt.input_tokens
    assert usage.cache_creation_input_tokens == 0 and 0 < usage.output_tokens <= MAX_TOKENS


def test_a_streamed_answer_adds_up_to_the_whole_one(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(**weather("Tokyo"))
    raw = list(client.messages.create(**weather("Tokyo"), stream=True))
    assert [event.type for event in raw] == [
        "message_start",
        "content_block_start",
        "content_block_delta",  # the whole input at once, when the call's closing tag is in
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert raw[2].delta.type == "input_json_delta"
    with client.messages.stream(**weather("Tokyo")) as stream:
        streamed = stream.get_final_message()
    assert without_ids(streamed.content) == without_ids(whole.content)
    assert streamed.content[0].input == {"city": "Tokyo"}
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (
        "tool_use",
        whole.usage.output_tokens,
    )
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )


def test_turn_two_finds_turn_one_prompt_and_answer_in_the_store(
    client: anthropic.Anthropic,
) -> None:
    messages = [*few_shot(), question("Berlin")]
    first = client.messages.create(**weather("Berlin"))
    (call,) = first.content
    # Turn 1's answer sent back as the SDK gave it, and the tool's result.
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees, sunny"}
    messages += [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result]},
    ]
    second = client.messages.create(**weather("Berlin", messages=messages, max_tokens=1))
    # Turn 1's prompt and answer have KV but for its last token (<|im_end|>): every full block
    # of them is found, if turn 2 renders them token for token.
    num_first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    num_first = num_first_prompt + first.usage.output_tokens - 1
    bound = num_first // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
    assert bound > num_first_prompt  # the answer's KV counts, not just the prompt
    num_second_prompt = client.messages.count_tokens(
        model=MODEL, system=SYSTEM, tools=[TOOL], messages=messages
    ).input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == num_second_prompt
    assert 0.9 * bound <= second.usage.cache_read_input_tokens <= bound


def test_a_conversation_gets_the_tokens_chat_completions_gives_it(
    server: Server, client: anthropic.Anthropic
) -> None:
    message = client.messages.create(**weather("Madrid"))
    chat_messages = [{"role": "system", "content": SYSTEM}]
    for m in [*few_shot(), question("Madrid")]:
        if isinstance(m["content"], str):
            chat_messages.append(m)
        else:
            (call,) = m["content"]
            function = {"name": call["name"], "arguments": json.dumps(call["input"])}
            tool_call = {"id": call["id"], "type": "function", "function": function}
            chat_messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
    chat = server.client.chat.completions.create(
        model=MODEL, messages=chat_messages, tools=TOOLS, temperature=0, max_tokens=MAX_TOKENS
    )
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    (chat_call,) = chat.choices[0].message.tool_calls
    assert json.loads(chat_call.function.arguments) == message.content[0].input
    tokenized = server.http.post("/tokenize", json={"model": MODEL, "messages": chat_messages})
    counted = client.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[*few_shot(), question("Madrid")]
    )
    assert counted.input_tokens == tokenized.json()["count"]  # no tools in either


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_met_ends_the_message_and_is_named(
    client: anthropic.Anthropic, stream: bool
) -> None:
    request = weather("Oslo", stop_sequences=["zzz", '"arguments"'])
    if stream:
        with client.messages.stream(**request) as events:
            out = events.get_final_message()
    else:
        out = client.messages.create(**request)
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", '"arguments"')
    # Cut inside the call: what the model wrote up to the stop sequence, as text.
    assert [(b.type, b.text) for b in out.content] == [
        ("text", '<tool_call>\n{"name": "get_weather", ')
    ]


def test_errors_come_in_anthropics_shape(server: Server, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(**weather("Lima", extra_body={"temperature": 0, "bogus": 1}))
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "unrecognized request argument: bogus",
        },
    }
    wrong_key = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        wrong_key.messages.create(**weather("Lima"))
    assert unauthorized.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.create(**weather("Lima", model="claude-sonnet-4-5"))
    assert not_found.value.body["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in not_found.value.body["error"]["message"]
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
    }
    for request, words in [
        (weather("Lima", messages=[{"role": "user", "content": [image]}]), "'image'"),
        (weather("Lima", tool_choice={"type": "any"}), "tool_choice 'any'"),
        (weather("Lima", max_tokens=0), "max_tokens"),
    ]:
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(**request)
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        assert words in refused.value.body["error"]["message"]
    # Past the context: Anthropic's words, which clients read to retry with fewer tokens.
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(**weather("Lima", max_tokens=100_000))
    assert (
        "input length and `max_tokens` exceed context limit"
        in too_long.value.body["error"]["message"]
    )


def test_a_request_as_claude_code_sends_it_is_served(server: Server) -> None:
    """Bearer key, beta headers and query, cache_control everywhere, thinking, metadata and
    context_management, Claude Code's attribution line in the system blocks, a stream."""
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cch=1f2e;"},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
    ]
    request = weather(
        "Paris",
        system=system,
        tools=[{**TOOL, "cache_control": {"type": "ephemeral"}}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "user_1_account__session_9"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        stream=True,
    )
    body = request | request.pop("extra_body")  # as JSON: temperature among the fields
    headers = {
        **auth(),  # Authorization: Bearer KEY (Claude Code's ANTHROPIC_AUTH_TOKEN)
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "x-session-id": "session-9",
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/messages?beta=true", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names
    delta = next(d for d in data if d["type"] == "content_block_delta")
    assert json.loads(delta["delta"]["partial_json"]) == {"city": "Paris"}
    # The attribution line is not in the prompt: it counts as the system text alone does.
    count = httpx.post(
        f"{server.url}/v1/messages/count_tokens",
        json={"model": MODEL, "system": system, "messages": [question("Paris")]},
        headers=auth(),
    ).json()["input_tokens"]
    without = httpx.post(
        f"{server.url}/v1/messages/count_tokens",
        json={"model": MODEL, "system": SYSTEM, "messages": [question("Paris")]},
        headers=auth(),
    ).json()["input_tokens"]
    assert count == without

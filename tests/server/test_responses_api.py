"""The Responses API (``POST /v1/responses``, GET, DELETE) through a real `dualpath serve` and the
official `openai` client, on real weights.

SmolLM2-135M-Instruct with our Hermes/Qwen-style template and greedy decoding, as in
test_tool_call_serving.py: after two few-shot questions answered with a call it calls
``get_weather`` for the new city, so an agent's two-turn conversation is reproducible: turn 1
answers with a function_call, turn 2 sends its function_call_output. One server for the module;
the last test stops it and starts another on the same directories.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.serving import MODEL, Server, start_server
from tests.server.test_tool_call_serving import link_checkpoint

pytest.importorskip("nixl_cu12")

BLOCK_SIZE_TOKENS = 64  # serve's default
MAX_NEW_TOKENS = 40
INSTRUCTIONS = "You answer every question with a tool call."
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
WEATHER = "21 degrees, sunny"


@dataclass
class Served:
    root: Path
    model_dir: Path
    server: Server


@pytest.fixture(scope="module")
def served(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("responses")
    generation_config = {"eos_token_id": 2, "top_k": 1, "max_new_tokens": MAX_NEW_TOKENS}
    model_dir = link_checkpoint(smollm2_model_dir, root, generation_config)
    with ExitStack() as stack:
        server = stack.enter_context(_start(model_dir, root))
        served = Served(root, model_dir, server)
        served.stack = stack  # type: ignore[attr-defined]  # the restart test adds its server
        yield served


def _start(model_dir: Path, root: Path):
    # Responses are kept where serve keeps them by default: $DUALPATH_HOME/responses.
    # 1P1D: nothing here depends on the topology; one engine process fewer to start (twice).
    return start_server(model_dir, root, "--persist-wait-s", "120", "--nodes", "1P1D")


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    return served.server.client


def few_shot(city: str) -> list[dict[str, Any]]:
    """Two questions answered with a call, then the question about ``city``."""
    items: list[dict[str, Any]] = []
    for i, known in enumerate(("London", "Rome")):
        items.append(question(known))
        arguments = json.dumps({"city": known})
        call = {"call_id": f"call_{i}", "name": "get_weather", "arguments": arguments}
        items.append({"type": "function_call", **call})
    return [*items, question(city)]


def question(city: str) -> dict[str, Any]:
    return {"role": "user", "content": f"What is the weather in {city}?"}


def tool_output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": WEATHER}


def create(client: openai.OpenAI, **fields: Any):
    return client.responses.create(model=MODEL, instructions=INSTRUCTIONS, tools=TOOLS, **fields)


def stream(client: openai.OpenAI, **fields: Any):
    with client.responses.stream(
        model=MODEL, instructions=INSTRUCTIONS, tools=TOOLS, **fields
    ) as events:
        return events.get_final_response()


def essence(response) -> dict[str, Any]:
    """What two runs of the same conversation must share: output and token counts, not ids."""
    output = []
    for item in response.output:
        fields = item.model_dump(exclude={"id", "call_id"}, exclude_none=True)
        output.append(fields)
    usage = response.usage
    return {
        "status": response.status,
        "output": output,
        "tokens": (usage.input_tokens, usage.output_tokens, usage.total_tokens),
    }


def cached_bound(turn_one) -> int:
    """The turn-2 prompt tokens that turn 1's prompt and answer already cover, in whole
    blocks: all of them but the answer's last token (its end, written as <|im_end|>), whose KV
    the decode never computes."""
    usage = turn_one.usage
    covered = usage.input_tokens + usage.output_tokens - 1
    return covered // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS


def as_input(items) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in items]


# --- a two-turn conversation with a function call --------------------------------------------


def test_turn_one_calls_the_tool_and_the_sdk_parses_it(client: openai.OpenAI) -> None:
    response = create(client, input=few_shot("Paris"))
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == MODEL
    (call,) = response.output
    assert isinstance(call, openai.types.responses.ResponseFunctionToolCall)
    assert (call.name, call.arguments, call.status) == (
        "get_weather",
        '{"city": "Paris"}',
        "completed",
    )
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert response.output_text == ""
    assert response.instructions == INSTRUCTIONS and response.tools[0].name == "get_weather"
    assert response.tool_choice == "auto" and response.store is True
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_turn_two_finds_turn_one_in_the_store_whole_or_by_previous_response_id(
    client: openai.OpenAI,
) -> None:
    items = few_shot("Madrid")
    first = create(client, input=items)
    (call,) = first.output
    # Turn 2 with the whole input: its prompt is turn 1's prompt and answer, from the store.
    whole = create(
        client, input=[*items, *as_input(first.output), tool_output(call.call_id)], store=False
    )
    assert whole.status == "completed"
    assert whole.output_text  # the model answers in words once it has the weather
    bound = cached_bound(first)
    assert bound > first.usage.input_tokens  # the answer's KV counts, not just the prompt
    assert whole.usage.input_tokens_details.cached_tokens >= 0.9 * bound
    # The same turn by previous_response_id: the same prompt and answer.
    chained = create(client, input=[tool_output(call.call_id)], previous_response_id=first.id)
    assert chained.previous_response_id == first.id
    assert essence(chained)["tokens"][0] == essence(whole)["tokens"][0]
    assert essence(chained)["output"] == essence(whole)["output"]
    assert chained.usage.input_tokens_details.cached_tokens >= 0.9 * cached_bound(first)
    # A third turn goes on from the second.
    third = create(client, input=[question("Rome")], previous_response_id=chained.id)
    assert third.usage.input_tokens > chained.usage.input_tokens + chained.usage.output_tokens


def test_a_stream_ends_with_the_response_the_body_gives(client: openai.OpenAI) -> None:
    items = few_shot("Vienna")
    first = create(client, input=items)
    first_streamed = stream(client, input=items)
    assert essence(first_streamed) == essence(first)
    (call,) = first_streamed.output
    turn_two = [*items, *as_input(first_streamed.output), tool_output(call.call_id)]
    assert essence(stream(client, input=turn_two)) == essence(create(client, input=turn_two))


def test_stream_events_are_numbered_and_shaped_as_openai_sends_them(
    client: openai.OpenAI,
) -> None:
    events = list(create(client, input=few_shot("Lisbon"), stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.status == "completed" and done.usage.input_tokens > 0
    assert done.output[0].arguments == '{"city": "Lisbon"}'
    assert events[5].item == done.output[0]


def test_streamed_text_comes_as_output_text_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL, input="Say hello.", max_output_tokens=3, stream=True, store=False
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert "".join(deltas) == final.output_text and len(deltas) >= 1
    # Cut short by max_output_tokens: incomplete, and still ended by response.completed.
    assert (final.status, final.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert final.output[0].status == "incomplete" and final.usage.output_tokens == 3


# --- stored responses --------------------------------------------------------------------------


def test_a_stored_response_is_read_and_deleted(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(response.id) == response
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.retrieve(response.id)
    assert error.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=response.id)
    assert error.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=response.id)


def test_a_response_is_read_only_under_its_cache_salt(served: Served) -> None:
    client, http = served.server.client, served.server.http
    salted = {"cache_salt": "tenant-a"}
    response = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, extra_body=salted
    )
    assert http.get(f"/v1/responses/{response.id}").status_code == 404
    assert (
        http.get(f"/v1/responses/{response.id}", params={"cache_salt": "tenant-b"}).status_code
        == 404
    )
    assert http.get(f"/v1/responses/{response.id}", params=salted).json()["id"] == response.id
    for salt in (None, "tenant-b"):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(
                model=MODEL,
                input="Hi",
                max_output_tokens=1,
                previous_response_id=response.id,
                extra_body={"cache_salt": salt} if salt else None,
            )
    chained = client.responses.create(
        model=MODEL,
        input="Hi",
        max_output_tokens=1,
        previous_response_id=response.id,
        extra_body=salted,
    )
    assert chained.usage.input_tokens > response.usage.input_tokens
    assert http.delete(f"/v1/responses/{response.id}").status_code == 404  # not without it
    assert http.delete(f"/v1/responses/{response.id}", params=salted).status_code == 200


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"seed": 1}, "seed", "unrecognized request argument"),
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
        ({"tool_choice": "required", "tools": TOOLS}, "tool_choice", "forcing"),
        ({"tools": [{**TOOLS[0], "strict": True}]}, "tools", "strict"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format", "json_object"),
        ({"truncation": "auto"}, "truncation", "auto"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "input_image",
        ),
        ({"max_output_tokens": 10**6}, "max_output_tokens", "context length"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input",
            "not valid JSON",
        ),
    ],
)
def test_what_we_cannot_honour_is_a_400_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL, "input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.post("/responses", body=body, cast_to=httpx.Response)
    assert error.value.body["param"] == param
    assert words in error.value.body["message"]


def test_accepted_and_ignored_fields_change_nothing(client: openai.OpenAI) -> None:
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    dressed = client.responses.create(
        model=MODEL,
        input=[
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "user", "content": "Hi"},
        ],
        max_output_tokens=4,
        store=False,
        reasoning={"effort": "low"},
        include=["reasoning.encrypted_content"],
        metadata={"k": "v"},
        user="someone",
        parallel_tool_calls=False,
        truncation="disabled",
        text={"format": {"type": "text"}, "verbosity": "low"},
        prompt_cache_key="session-1",
    )
    assert essence(dressed)["output"] == essence(plain)["output"]
    assert dressed.metadata == {"k": "v"} and dressed.parallel_tool_calls is False


def test_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model="gpt-4o", input="Hi")
    assert error.value.body["param"] == "model"


# --- a restart (last: it replaces the module's server) -----------------------------------------


def test_previous_response_id_outlives_a_restart(served: Served) -> None:
    items = few_shot("Athens")
    first = create(served.server.client, input=items)
    (call,) = first.output
    before = create(
        served.server.client,
        input=[*items, *as_input(first.output), tool_output(call.call_id)],
        store=False,
    )
    served.server.process.send_signal(signal.SIGTERM)
    assert served.server.process.wait(timeout=60) == 0
    served.server = served.stack.enter_context(_start(served.model_dir, served.root))  # type: ignore[attr-defined]
    client = served.server.client
    assert client.responses.retrieve(first.id) == first
    after = create(client, input=[tool_output(call.call_id)], previous_response_id=first.id)
    assert essence(after)["output"] == essence(before)["output"]
    assert essence(after)["tokens"] == essence(before)["tokens"]
    # The KV store outlived the restart too: turn 2's prompt was computed before it.
    assert after.usage.input_tokens_details.cached_tokens >= 0.9 * cached_bound(first)

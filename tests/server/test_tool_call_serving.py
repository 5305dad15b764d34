"""Tool calls through a real `dualpath serve` and the official `openai` client, on real weights.

SmolLM2-135M-Instruct (the embedded default) with a Hermes/Qwen-style ``chat_template.jinja``
(our default template; it overrides the checkpoint's own, which has no tools) and a
``generation_config.json`` that recommends greedy decoding (``top_k: 1``) and
``max_new_tokens``. At greedy decoding the model copies a few-shot pattern exactly: asked about
the weather after two examples answered with a ``<tool_call>``, it writes one for the new city,
then ``<|im_end|>``; after two examples written as a Python call inside the tags, it writes
that, which must stay text. One server for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dualpath.model.presets import CHAT_TEMPLATE
from tests.server.serving import MODEL, Server, start_server

pytest.importorskip("nixl_cu12")

BLOCK_SIZE_TOKENS = 64  # serve's default
MAX_NEW_TOKENS = 40  # the checkpoint's recommendation: a call takes about 32 tokens
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You answer every question with a tool call."}


def question(city: str) -> dict:
    return {"role": "user", "content": f"What is the weather in {city}?"}


def few_shot(*, as_json: bool) -> list[dict]:
    """Two questions answered with a call: as the client got them back, or, if not
    ``as_json``, written as a Python call inside the tags (which is not a tool call)."""
    messages = [SYSTEM]
    for i, city in enumerate(("London", "Rome")):
        messages.append(question(city))
        if as_json:
            arguments = json.dumps({"city": city})
            call = {"name": "get_weather", "arguments": arguments}
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": f"call_{i}", "type": "function", "function": call}],
                }
            )
        else:
            content = f"<tool_call>\nget_weather(city='{city}')\n</tool_call>"
            messages.append({"role": "assistant", "content": content})
    return messages


def link_checkpoint(source: Path, root: Path, generation_config: dict) -> Path:
    """``source``'s weights and tokenizer (links), our template, and this generation config."""
    model_dir = root / "model"
    model_dir.mkdir()
    for path in source.iterdir():
        if path.name != "generation_config.json":
            (model_dir / path.name).symlink_to(path)
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config))
    return model_dir


@pytest.fixture(scope="module")
def server(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("tools")
    generation_config = {"eos_token_id": 2, "top_k": 1, "max_new_tokens": MAX_NEW_TOKENS}
    model_dir = link_checkpoint(smollm2_model_dir, root, generation_config)
    # A turn's hits are exact once the last turn's blocks are written; however long that takes
    # on a loaded machine, the next turn waits for it (the default gives up after 5 s).
    with start_server(model_dir, root, "--persist-wait-s", "120") as running:
        yield running


def test_a_tool_call_comes_back_as_tool_calls(server: Server) -> None:
    # No temperature, top_k or max_tokens: the checkpoint's (greedy, 40) apply.
    out = server.client.chat.completions.create(
        model=MODEL, messages=[*few_shot(as_json=True), question("Paris")], tools=TOOLS
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')


def test_a_streamed_tool_call_adds_up_to_the_same(server: Server) -> None:
    chunks = list(
        server.client.chat.completions.create(
            model=MODEL,
            messages=[*few_shot(as_json=True), question("Tokyo")],
            tools=TOOLS,
            tool_choice="auto",
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks]
    assert not any(d.content for d in deltas)  # all of it was the call
    call_deltas = [call for d in deltas for call in d.tool_calls or ()]
    head, arguments = call_deltas
    assert (head.index, head.type, head.function.name, head.function.arguments) == (
        0,
        "function",
        "get_weather",
        "",
    )
    assert head.id.startswith("call_")
    assert (arguments.index, arguments.id) == (0, None)
    assert arguments.function.arguments == '{"city": "Tokyo"}'
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_with_tool_choice_none_the_call_is_text(server: Server) -> None:
    out = server.client.chat.completions.create(
        model=MODEL,
        messages=[*few_shot(as_json=True), question("Paris")],
        tools=TOOLS,
        tool_choice="none",
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )


def test_a_call_that_is_not_json_stays_text(server: Server) -> None:
    messages = [*few_shot(as_json=False), question("Madrid")]
    out = server.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "<tool_call>\nget_weather(city='Madrid')\n</tool_call>"
    streamed = server.client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == choice.message.content


def test_an_agents_turn_two_finds_turn_one_prompt_and_answer_in_the_store(
    server: Server,
) -> None:
    messages = [*few_shot(as_json=True), question("Berlin")]
    first = server.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    (call,) = first.choices[0].message.tool_calls
    # The assistant message as agent frameworks send it back, and the tool's result.
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"},
    ]
    second = server.client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=1
    )
    # Turn 1's prompt and answer have KV, but its last token (<|im_end|>): every full block
    # of them is found, so turn 2 renders them token for token.
    num_turn_one_tokens = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    expected = num_turn_one_tokens // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
    assert expected > first.usage.prompt_tokens  # the answer's KV counts, not just the prompt
    assert second.usage.prompt_tokens_details.cached_tokens == expected


def test_max_tokens_left_out_is_the_checkpoints_max_new_tokens(server: Server) -> None:
    out = server.client.chat.completions.create(
        model=MODEL, messages=[question("Oslo")], extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == MAX_NEW_TOKENS


def _serve_exit(model_dir: Path, root: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "dualpath.cli", "serve", "--model", str(model_dir)]
    argv += ["--kv-store", str(root / "kv"), "--engine-log-dir", str(root / "logs")]
    env = dict(os.environ, DUALPATH_HOME=str(root / "home"))
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def test_sampling_we_do_not_implement_keeps_serve_from_starting(
    smollm2_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = link_checkpoint(smollm2_model_dir, tmp_path, {"repetition_penalty": 1.1})
    result = _serve_exit(model_dir, tmp_path)
    assert result.returncode == 2
    assert "repetition_penalty=1.1" in result.stderr
    assert "--generation-config none" in result.stderr


def test_generation_config_none_serves_with_our_defaults(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = link_checkpoint(tiny_model_dir, tmp_path, {"repetition_penalty": 1.1})
    with start_server(model_dir, tmp_path, "--generation-config", "none") as running:
        out = running.client.chat.completions.create(
            model=MODEL, messages=[question("Oslo")], max_tokens=2
        )
        assert out.usage.completion_tokens >= 1

"""The router renders chat prompts itself once they match its vLLM servers'
(dualpath/vllm/router/local_prompts.py): our app in front of fake vLLM servers
(tests/server/fake_vllm.py) whose DE refuses a placed prompt other than the one it renders, as
our connector does."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from dualpath.protocol import DECODE, PREFILL
from dualpath.server.app import build_app
from dualpath.server.chat import ChatRenderer
from dualpath.server.config import ServerConfig
from dualpath.server.context import ServingContext
from dualpath.vllm.router.local_prompts import LocalPrompts
from tests.server.fake_vllm import (
    HANG_GUARD_S,
    MODEL,
    VOCAB_SIZE,
    FakeCluster,
    FakeVLLM,
    Journal,
    chat_token_ids,
    serving,
    text_token_ids,
)

# The fake servers' rendering (``fake_vllm.chat_token_ids``) as a chat template.
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if tools %}<tools>{{ tools | length }}{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@dataclass
class Fleet:
    http: httpx.Client
    cluster: FakeCluster
    journal: Journal
    local_prompts: LocalPrompts


def front_door(template: str) -> Iterator[Fleet]:
    journal = Journal()
    prefill = FakeVLLM("pe", PREFILL, journal)
    decode = FakeVLLM("de", DECODE, journal)
    with serving(prefill.app) as pe_url, serving(decode.app) as de_url:
        cluster = FakeCluster(pe_url, [de_url])
        cluster.reset(decode_ids=(1,))
        decode.cluster = cluster
        config = ServerConfig(served_model_name=MODEL, generation_config="none")
        tokenizer = SimpleNamespace(vocab_size=VOCAB_SIZE, encode=text_token_ids)
        context = ServingContext(config, cluster, tokenizer, chat=ChatRenderer(template))
        ready = threading.Event()
        app = build_app(context, on_fatal=lambda: None, on_ready=ready.set)
        local_prompts = app.state.vllm_servers.local_prompts
        with serving(app) as url, httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
            assert ready.wait(HANG_GUARD_S), "the app never became ready"
            yield Fleet(http, cluster, journal, local_prompts)


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]} | fields


def ask(fleet: Fleet, body: dict[str, Any]) -> dict[str, Any]:
    response = fleet.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def tokenized(fleet: Fleet) -> int:
    return sum(path == "/tokenize" for path, _ in fleet.journal.of("pe") + fleet.journal.of("de"))


def metric(fleet: Fleet, name: str) -> float:
    metrics = fleet.http.get("/metrics").text
    [value] = re.findall(rf"^{re.escape(name)} (\S+)$", metrics, re.M)
    return float(value)


@pytest.fixture
def matching() -> Iterator[Fleet]:
    yield from front_door(TEMPLATE)


def test_prompts_are_rendered_here_once_one_matched_a_servers(matching: Fleet):
    first = ask(matching, chat("Hi there", max_tokens=4))
    assert tokenized(matching) == 1  # checked against a server's /tokenize
    assert matching.local_prompts.is_trusted
    second = ask(matching, chat("Hi there, again", max_tokens=4))
    third = ask(matching, chat("Tools?", max_tokens=4, tools=[_TOOL]))
    assert tokenized(matching) == 1  # none asked since
    for rendered_by, count in (("server", 1), ("router", 2)):
        name = f'dualpath_forwarded_prompts_total{{rendered_by="{rendered_by}"}}'
        assert metric(matching, name) == count
    placed = [ids for _, ids, _ in matching.cluster.submitted]
    assert placed == [
        chat_token_ids(chat("Hi there")),
        chat_token_ids(chat("Hi there, again")),
        chat_token_ids(chat("Tools?", tools=[_TOOL])),
    ]
    for answer in (first, second, third):
        assert answer["choices"][0]["finish_reason"] == "length"


def test_a_body_only_a_server_renders_is_asked_of_one(matching: Fleet):
    ask(matching, chat("Hi there", max_tokens=2))
    for fields in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"continue_final_message": False, "add_generation_prompt": True},
    ):
        ask(matching, chat("Hi there", max_tokens=2, **fields))
    content_parts = [{"type": "text", "text": "Hi"}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content_parts}]}
    matching.http.post("/v1/chat/completions", json=body | {"max_tokens": 2})
    assert tokenized(matching) == 4


@pytest.fixture
def differing() -> Iterator[Fleet]:
    yield from front_door("<|im_start|>" + TEMPLATE)


def test_rendering_that_differs_from_a_servers_is_refused_at_the_check(differing: Fleet):
    ask(differing, chat("Hi there", max_tokens=2))
    assert differing.local_prompts.state == "refused"
    ask(differing, chat("Hi there, again", max_tokens=2))
    assert tokenized(differing) == 2  # every prompt asked of a server
    placed = [ids for _, ids, _ in differing.cluster.submitted]
    assert placed == [chat_token_ids(chat("Hi there")), chat_token_ids(chat("Hi there, again"))]


@pytest.mark.parametrize("is_stream", [False, True])
def test_a_prompt_the_decode_server_refuses_is_answered_by_it_alone(
    matching: Fleet, is_stream: bool
):
    ask(matching, chat("Hi there", max_tokens=2))  # trusted from now on
    # The servers render a tool list the router's template does not know of: the router
    # places what it rendered, the DE's connector refuses it.
    body = chat("Hi there", max_tokens=4, tools=[_TOOL], stream=is_stream)
    matching.local_prompts._chat = ChatRenderer(TEMPLATE.replace("<tools>", "<t>"))
    matching.cluster.num_cached_tokens = 64
    cached_before = metric(matching, "dualpath_cached_prompt_tokens_total")
    if is_stream:
        with matching.http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            text = "".join(response.iter_text())
        assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text
    else:
        assert ask(matching, body)["choices"][0]["finish_reason"] == "length"
    assert matching.local_prompts.state == "refused"
    # The refused placement's hits count for nothing.
    assert metric(matching, "dualpath_cached_prompt_tokens_total") == cached_before
    assert metric(matching, "dualpath_forwarded_prompts_refused_total") == 1
    ask(matching, chat("And now?", max_tokens=2))
    assert tokenized(matching) == 2  # the next prompt was asked of a server
    assert matching.cluster.submitted[-1][1] == chat_token_ids(chat("And now?"))


_TOOL = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}

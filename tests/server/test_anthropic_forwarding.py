"""/v1/messages in forwarding mode (dualpath/server/anthropic_forwarding.py): our app on a real
port in front of fake vLLM servers (one PE, two DEs) and a fake cluster that places requests on
them (tests/server/fake_vllm.py), driven by the official `anthropic` client. The message goes
to the DE as the chat request it amounts to; the chat answer comes back as a message."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import anthropic
import pytest

from dualpath.protocol import DECODE, PREFILL
from dualpath.server.app import build_app
from dualpath.server.config import ServerConfig
from dualpath.server.context import ServingContext
from tests.server.fake_vllm import (
    HANG_GUARD_S,
    MODEL,
    SERVER_MODEL,
    VOCAB_SIZE,
    FakeCluster,
    FakeVLLM,
    Journal,
    chat_token_ids,
    closed_port_url,
    next_token,
    serving,
    token_text,
)

QUESTION = {"role": "user", "content": "Hi there"}


@dataclass
class Fleet:
    client: anthropic.Anthropic  # to our server
    cluster: FakeCluster
    journal: Journal
    decodes: list[FakeVLLM]  # engines 1 and 2


@pytest.fixture(scope="module")
def servers() -> Iterator[Fleet]:
    journal = Journal()
    prefill = FakeVLLM("pe", PREFILL, journal)
    decodes = [FakeVLLM("de1", DECODE, journal), FakeVLLM("de2", DECODE, journal)]
    with (
        serving(prefill.app) as pe_url,
        serving(decodes[0].app) as de1_url,
        serving(decodes[1].app) as de2_url,
    ):
        cluster = FakeCluster(pe_url, [de1_url, de2_url, closed_port_url()])
        config = ServerConfig(served_model_name=MODEL, generation_config="none")
        tokenizer = SimpleNamespace(vocab_size=VOCAB_SIZE)  # forwarding never tokenizes here
        context = ServingContext(config, cluster, tokenizer, chat=None)
        ready = threading.Event()
        app = build_app(context, on_fatal=lambda: None, on_ready=ready.set)
        with serving(app) as url:
            assert ready.wait(HANG_GUARD_S), "the app never became ready"
            client = anthropic.Anthropic(
                base_url=url, api_key="unused", max_retries=0, timeout=HANG_GUARD_S
            )
            yield Fleet(client, cluster, journal, decodes)


@pytest.fixture
def fleet(servers: Fleet) -> Fleet:
    servers.cluster.reset()
    servers.journal.clear()
    for server in servers.decodes:
        server.reset()
    return servers


def output_text(prompt: list[int], num_tokens: int) -> str:
    ids: list[int] = []
    for _ in range(num_tokens):
        ids.append(next_token(prompt + ids))
    return "".join(token_text(t) for t in ids)


def chat_messages() -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, QUESTION]


def test_a_message_goes_to_its_decode_server_as_a_chat_request(fleet: Fleet):
    out = fleet.client.messages.create(
        model=MODEL, max_tokens=4, system="Be brief.", messages=[QUESTION], stop_sequences=["!"]
    )

    [(request_id, prompt, params)] = fleet.cluster.submitted
    assert prompt == chat_token_ids({"messages": chat_messages()}) and params.max_tokens == 4
    [(path, decode_body)] = fleet.journal.of("de1")
    assert path == "/v1/chat/completions"
    assert decode_body == {
        "model": SERVER_MODEL,
        "messages": chat_messages(),
        "max_tokens": 4,
        "stream": False,
        "stop": ["!"],
        "kv_transfer_params": {"dualpath_request_id": request_id},
    }
    assert out.id.startswith("msg_") and out.model == MODEL
    assert [(b.type, b.text) for b in out.content] == [("text", output_text(prompt, 4))]
    assert out.stop_reason == "max_tokens"  # the fake's finish: "length"
    assert (out.usage.input_tokens, out.usage.output_tokens) == (len(prompt), 4)


def test_a_streamed_message_comes_back_as_anthropic_events(fleet: Fleet):
    raw = list(
        fleet.client.messages.create(model=MODEL, max_tokens=5, messages=[QUESTION], stream=True)
    )

    [(_, prompt, _)] = fleet.cluster.submitted
    [(_, decode_body)] = fleet.journal.of("de1")
    assert decode_body["stream_options"] == {"include_usage": True}
    assert raw[0].type == "message_start"
    assert raw[0].message.usage.input_tokens == len(prompt)  # from the DE's prompt_token_ids
    assert [e.type for e in raw[1:]] == [
        "content_block_start",
        *["content_block_delta"] * 5,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(e.delta.text for e in raw[2:7]) == output_text(prompt, 5)
    assert (raw[-2].delta.stop_reason, raw[-2].usage.output_tokens) == ("max_tokens", 5)


def test_a_stream_whose_decode_server_drops_goes_on_elsewhere_undisturbed(fleet: Fleet):
    request = {"model": MODEL, "max_tokens": 8, "messages": [QUESTION]}
    fleet.decodes[0].drop_after = 4  # events; the connection breaks without [DONE]
    fleet.decodes[0].is_healthy = False  # and its /health fails: the server died
    with fleet.client.messages.stream(**request) as stream:
        going_on = stream.get_final_message()

    assert [engine_id for engine_id, _ in fleet.cluster.unreachable] == [1]
    (_, prompt, _), (_, going_on_prompt, params) = fleet.cluster.submitted
    assert len(going_on_prompt) > len(prompt) and params.max_tokens < 8
    [(path, _)] = fleet.journal.of("de2")
    assert path == "/v1/completions"  # the prompt and the tokens sent, as token ids
    with fleet.client.messages.stream(**request) as stream:  # on engine 2, engine 1 being out
        undisturbed = stream.get_final_message()
    assert going_on.content == undisturbed.content
    assert going_on.content[0].text == output_text(prompt, 8)
    assert going_on.usage.output_tokens == undisturbed.usage.output_tokens == 8


def test_refusals_and_failures_come_in_anthropics_shape(fleet: Fleet):
    with pytest.raises(anthropic.NotFoundError) as not_found:  # the servers' /tokenize says so
        fleet.client.messages.create(model="other", max_tokens=4, messages=[QUESTION])
    assert not_found.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model `other` does not exist."},
    }
    fleet.cluster.unforwarded = ["failed"]
    with pytest.raises(anthropic.InternalServerError) as failed:
        fleet.client.messages.create(model=MODEL, max_tokens=4, messages=[QUESTION], stream=True)
    assert failed.value.body["error"]["type"] == "api_error"
    assert failed.value.body["error"]["message"].startswith("generation failed: ")
    assert fleet.journal.of("de1") == []


def test_tokens_are_counted_by_a_vllm_server(fleet: Fleet):
    counted = fleet.client.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[QUESTION]
    )

    assert counted.input_tokens == len(chat_token_ids({"messages": chat_messages()}))
    assert fleet.cluster.submitted == []

"""Forwarding to vLLM server engines (dualpath/vllm/router/forwarding.py, forwarded_call.py): our
app on a real port in front of fake vLLM servers (one PE, two DEs) and a fake cluster that
places requests on them (tests/server/fake_vllm.py), driven over HTTP."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from dualpath.protocol import DECODE, PREFILL
from dualpath.server.app import build_app
from dualpath.server.config import ServerConfig
from dualpath.server.context import ServingContext
from tests.server.fake_vllm import (
    CREATED,
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
    text_token_ids,
    token_text,
)


@dataclass
class Fleet:
    http: httpx.Client  # to our server
    cluster: FakeCluster
    journal: Journal
    prefill: FakeVLLM  # engine 0
    decodes: list[FakeVLLM]  # engines 1 and 2 (engine 3's URL refuses connections)


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
        # Forwarding never tokenizes here: the tokenizer is asked its vocabulary size only.
        tokenizer = SimpleNamespace(vocab_size=VOCAB_SIZE)
        context = ServingContext(config, cluster, tokenizer, chat=None)
        ready = threading.Event()
        app = build_app(context, on_fatal=lambda: None, on_ready=ready.set)
        with serving(app) as url, httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
            assert ready.wait(HANG_GUARD_S), "the app never became ready"
            yield Fleet(http, cluster, journal, prefill, decodes)


@pytest.fixture
def fleet(servers: Fleet) -> Fleet:
    servers.cluster.reset()
    servers.journal.clear()
    for server in (servers.prefill, *servers.decodes):
        server.reset()
    return servers


def chat_request(**fields: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]}
    return "/v1/chat/completions", body | fields


def completion_request(**fields: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": MODEL, "prompt": "def fib(n):"} | fields


def stream_events(fleet: Fleet, path: str, body: dict[str, Any]) -> list[str]:
    """The data of every SSE event the client gets."""
    with fleet.http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data:")]


def chunks(events: list[str]) -> list[dict[str, Any]]:
    assert events[-1] == "[DONE]", events[-1]
    return [json.loads(event) for event in events[:-1]]


def without_token_ids(chunk: dict[str, Any]) -> dict[str, Any]:
    """A chunk as vLLM sends a client that did not ask for token ids."""
    chunk = json.loads(json.dumps(chunk))
    if "prompt_token_ids" in chunk:
        chunk["prompt_token_ids"] = None
    for choice in chunk["choices"]:
        for name in ("token_ids", "prompt_token_ids"):
            if name in choice:
                choice[name] = None
    return chunk


def without_id(chunk: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in chunk.items() if k not in ("id", "created")}


def sent_token_ids(events: list[str]) -> list[int]:
    """The token ids in a fake server's stream events."""
    ids = []
    for event in events:
        data = event.removeprefix("data: ").strip()
        if data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                ids += choice.get("token_ids") or []
    return ids


def output(prompt: list[int], num_tokens: int) -> list[int]:
    ids: list[int] = []
    for _ in range(num_tokens):
        ids.append(next_token(prompt + ids))
    return ids


# --- forwarding ----------------------------------------------------------------------------


def test_a_stream_goes_to_its_decode_server_first_and_comes_back_as_it_was_sent(fleet: Fleet):
    path, body = chat_request(stream=True, max_tokens=5, stream_options={"include_usage": True})
    events = stream_events(fleet, path, body)

    [(request_id, prompt, params)] = fleet.cluster.submitted
    assert prompt == chat_token_ids(body) and params.max_tokens == 5
    assert [(server, path) for server, path, _ in fleet.journal.entries] == [
        ("pe", "/tokenize"),
        ("de1", "/v1/chat/completions"),
        ("pe", "/v1/completions"),  # only once the DE has its body
    ]
    kv_transfer_params = {"dualpath_request_id": request_id}
    [(_, decode_body)] = fleet.journal.of("de1")
    assert decode_body == body | {
        "model": SERVER_MODEL,  # the router's name for it is the server's
        "kv_transfer_params": kv_transfer_params,
        "return_token_ids": True,
    }
    [_, (_, prefill_body)] = fleet.journal.of("pe")
    assert prefill_body == {
        "model": SERVER_MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": kv_transfer_params,
    }
    [sent] = fleet.decodes[0].sent
    assert chunks(events) == [without_token_ids(c) for c in chunks([e[6:-2] for e in sent])]
    assert sent_token_ids(sent) == output(prompt, 5)
    assert fleet.cluster.cancelled == []  # finished: the scheduler ends it as its DE reports


def test_a_whole_answer_comes_back_as_is_from_a_prompt_that_vllm_tokenized(fleet: Fleet):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    path, body = chat_request(
        tools=tools,
        tool_choice="auto",
        chat_template_kwargs={"enable_thinking": False},
        max_completion_tokens=4,
    )
    response = fleet.http.post(path, json=body)  # the DE answers once its PE prefilled

    assert response.status_code == 200, response.text
    [(request_id, prompt, params)] = fleet.cluster.submitted
    assert prompt == chat_token_ids(body) and params.max_tokens == 4
    [(_, tokenize_body)] = [(p, b) for p, b in fleet.journal.of("pe") if p == "/tokenize"]
    assert tokenize_body == {
        "model": SERVER_MODEL,
        "messages": body["messages"],
        "tools": tools,
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
    }
    [(_, decode_body)] = fleet.journal.of("de1")
    assert decode_body == body | {
        "model": SERVER_MODEL,
        "kv_transfer_params": {"dualpath_request_id": request_id},
    }
    answer = response.json()
    assert answer["id"] == f"chatcmpl-{request_id}" and answer["created"] == CREATED
    text = "".join(token_text(t) for t in output(prompt, 4))
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_a_prompt_of_token_ids_is_not_tokenized_and_a_dualpath_prefill_engine_gets_nothing(
    fleet: Fleet,
):
    fleet.cluster.prefill_url = ""  # the PE is a `dualpath engine`: the Assignment suffices
    fleet.journal.has_prefill_server = False
    path, body = completion_request(prompt=[[5, 6, 7]], max_tokens=3, stream=True)
    events = stream_events(fleet, path, body)

    assert [(s, p) for s, p, _ in fleet.journal.entries] == [("de1", "/v1/completions")]
    [(_, prompt, _)] = fleet.cluster.submitted
    assert prompt == [5, 6, 7]
    assert "".join(c["choices"][0]["text"] for c in chunks(events)) == "".join(
        token_text(t) for t in output([5, 6, 7], 3)
    )


def test_a_decode_server_refusal_passes_through_unchanged(fleet: Fleet):
    path, body = chat_request(stream=True, temperature=-1)
    response = fleet.http.post(path, json=body)

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "temperature must be non-negative",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    [(request_id, _, _)] = fleet.cluster.submitted
    assert fleet.cluster.cancelled == [request_id]
    assert [p for p, _ in fleet.journal.of("pe")] == ["/tokenize"]  # no prefill for it


@pytest.mark.parametrize("body", [{"n": 2}, {"prompt": ["one", "two"]}])
def test_what_is_not_one_sequence_is_refused(fleet: Fleet, body: dict[str, Any]):
    path, body = completion_request(**body)
    response = fleet.http.post(path, json=body)

    assert response.status_code == 400
    assert response.json()["error"]["param"] in ("n", "prompt")
    assert fleet.cluster.submitted == [] and fleet.journal.entries == []


# --- placing again -------------------------------------------------------------------------


@pytest.mark.parametrize("make_request", [chat_request, completion_request])
def test_a_stream_whose_decode_server_drops_goes_on_elsewhere_undisturbed(
    fleet: Fleet, make_request
):
    path, body = make_request(
        stream=True, max_tokens=8, temperature=0.5, seed=3, stream_options={"include_usage": True}
    )
    fleet.decodes[0].drop_after = 4  # events; the connection breaks without [DONE]
    fleet.decodes[0].is_healthy = False  # and its /health fails: the server died
    events = stream_events(fleet, path, body)

    cluster = fleet.cluster
    assert [engine_id for engine_id, _ in cluster.unreachable] == [1]
    (first_id, prompt, _), (second_id, going_on_prompt, params) = cluster.submitted
    sent = sent_token_ids(fleet.decodes[0].sent[0])
    assert len(sent) in (3, 4)  # a chat stream's first event has no token
    assert going_on_prompt == prompt + sent and params.max_tokens == 8 - len(sent)
    assert cluster.cancelled == [first_id]
    [(going_on_path, going_on_body)] = fleet.journal.of("de2")
    assert going_on_path == "/v1/completions"
    assert going_on_body == {
        "temperature": 0.5,
        "seed": 3,
        "model": SERVER_MODEL,
        "prompt": going_on_prompt,
        "max_tokens": 8 - len(sent),
        "stream": True,
        "return_token_ids": True,
        "kv_transfer_params": {"dualpath_request_id": second_id},
    }
    prefills = [b["prompt"] for p, b in fleet.journal.of("pe") if p == "/v1/completions"]
    assert prefills == [prompt, going_on_prompt]

    undisturbed = stream_events(fleet, path, body)  # on engine 2, engine 1 being out
    assert len({c["id"] for c in chunks(events)}) == 1
    assert [without_id(c) for c in chunks(events)] == [without_id(c) for c in chunks(undisturbed)]
    assert chunks(events)[-1]["usage"]["completion_tokens"] == 8


def test_a_stream_cut_from_a_live_decode_server_goes_on_without_declaring_it_dead(fleet: Fleet):
    path, body = completion_request(stream=True, max_tokens=8, temperature=0)
    fleet.decodes[0].drop_after = 4  # the connection breaks; the server's /health answers 200
    events = stream_events(fleet, path, body)

    cluster = fleet.cluster
    assert cluster.unreachable == []  # alive: not reported, so not declared dead
    (first_id, prompt, _), (second_id, going_on_prompt, params) = cluster.submitted
    sent = sent_token_ids(fleet.decodes[0].sent[0])
    assert going_on_prompt == prompt + sent and params.max_tokens == 8 - len(sent)
    assert cluster.cancelled == [first_id]  # the lost placement is the scheduler's to end
    going_on = [b for p, b in fleet.journal.of("de1") if p == "/v1/completions"][-1]
    assert going_on["kv_transfer_params"] == {"dualpath_request_id": second_id}
    undisturbed = stream_events(fleet, path, body)
    assert [without_id(c) for c in chunks(events)] == [without_id(c) for c in chunks(undisturbed)]


def test_a_prefill_request_cut_from_a_live_prefill_server_is_placed_again(fleet: Fleet):
    # The PE's vLLM never took the request, so its DE would wait for the PE's KV for ever.
    path, body = completion_request(stream=True, max_tokens=8, temperature=0)
    fleet.prefill.drop_next_prefill = True  # its /health answers 200: alive
    events = stream_events(fleet, path, body)

    cluster = fleet.cluster
    assert cluster.unreachable == []  # not reported, so not declared dead
    (first_id, prompt, _), (second_id, again_prompt, _) = cluster.submitted
    fleet.journal.prefilled(first_id).set()  # the lost placement's DE stops waiting for it
    assert again_prompt == prompt and cluster.cancelled == [first_id]
    prefills = [b for p, b in fleet.journal.of("pe") if p == "/v1/completions"]
    assert [b["kv_transfer_params"]["dualpath_request_id"] for b in prefills] == [
        first_id,
        second_id,
    ]
    undisturbed = stream_events(fleet, path, body)
    assert [without_id(c) for c in chunks(events)] == [without_id(c) for c in chunks(undisturbed)]


def test_a_prefill_server_that_is_gone_is_reported_and_the_request_placed_again(fleet: Fleet):
    path, body = completion_request(max_tokens=4)
    fleet.prefill.drop_next_prefill = True
    fleet.prefill.is_healthy = False  # /health 503: its engine is dead
    response = fleet.http.post(path, json=body)

    assert response.status_code == 200, response.text
    fleet.journal.prefilled(fleet.cluster.submitted[0][0]).set()  # as above
    assert [engine_id for engine_id, _ in fleet.cluster.unreachable] == [0]
    assert "the prefill request failed" in fleet.cluster.unreachable[0][1]
    assert len(fleet.cluster.submitted) == 2


def test_a_prefill_servers_refusal_fails_the_call_with_its_answer(fleet: Fleet):
    path, body = completion_request(max_tokens=4)
    fleet.prefill.refuse_next_prefill = 400
    response = fleet.http.post(path, json=body)

    assert response.status_code == 500, response.text
    fleet.journal.prefilled(fleet.cluster.submitted[0][0]).set()  # its DE stops waiting
    message = response.json()["error"]["message"]
    assert "its prefill engine's server answered 400" in message, message
    assert "the prefill server refuses" in message
    assert fleet.cluster.unreachable == [] and len(fleet.cluster.submitted) == 1


def test_a_placement_lost_mid_stream_goes_on_and_its_stream_is_closed(fleet: Fleet):
    path, body = chat_request(stream=True, max_tokens=6)
    fleet.decodes[0].hold_after = 3  # events; then the stream waits, open
    with fleet.http.stream("POST", path, json=body) as response:
        lines = (line[6:] for line in response.iter_lines() if line.startswith("data:"))
        events = [next(lines) for _ in range(3)]
        fleet.cluster.lose_engine(1)  # the scheduler: DE 1 is lost
        events += list(lines)

    assert fleet.decodes[0].closed.wait(HANG_GUARD_S)
    assert fleet.cluster.unreachable == []  # no connection failed
    (first_id, _, _), (_, _, params) = fleet.cluster.submitted
    assert fleet.cluster.cancelled == [first_id] and params.max_tokens == 4
    undisturbed = stream_events(fleet, path, body)
    assert [without_id(c) for c in chunks(events)] == [without_id(c) for c in chunks(undisturbed)]


def test_a_placement_lost_before_its_forward_is_placed_again(fleet: Fleet):
    fleet.cluster.unforwarded = ["lost"]
    path, body = completion_request(max_tokens=3)
    response = fleet.http.post(path, json=body)

    assert response.status_code == 200, response.text
    (_, first_prompt, _), (second_id, second_prompt, _) = fleet.cluster.submitted
    assert first_prompt == second_prompt == text_token_ids(body["prompt"])
    [(_, decode_body)] = fleet.journal.of("de1")
    assert decode_body["kv_transfer_params"] == {"dualpath_request_id": second_id}
    assert response.json()["choices"][0]["text"] == "".join(
        token_text(t) for t in output(second_prompt, 3)
    )


@pytest.mark.parametrize(
    ("unforwarded", "status"), [(["lost"] * 3, 503), (["unavailable"], 503), (["failed"], 500)]
)
def test_a_placement_that_fails_or_is_lost_three_times_is_an_error(
    fleet: Fleet, unforwarded: list[str], status: int
):
    fleet.cluster.unforwarded = list(unforwarded)
    path, body = chat_request(stream=True)
    response = fleet.http.post(path, json=body)

    assert response.status_code == status
    assert response.json()["error"]["message"].startswith("generation failed: ")
    assert len(fleet.cluster.submitted) == len(unforwarded)
    assert [p for p, _ in fleet.journal.of("de1")] == []


def test_a_stream_lost_after_its_finish_ends_as_it_would_have(fleet: Fleet):
    path, body = chat_request(stream=True, max_tokens=3, stream_options={"include_usage": True})
    fleet.decodes[0].drop_after = 4  # the role and every token: only the usage and [DONE] lost
    events = stream_events(fleet, path, body)

    assert fleet.cluster.unreachable == []  # the server lives: a lost connection, no death
    assert len(fleet.cluster.submitted) == 1  # nothing left to generate
    undisturbed = stream_events(fleet, path, body)
    assert [without_id(c) for c in chunks(events)] == [without_id(c) for c in chunks(undisturbed)]


def test_a_decode_server_that_refuses_connections_is_reported_and_replaced(fleet: Fleet):
    fleet.cluster.reset(decode_ids=(3, 1))  # engine 3's URL refuses connections
    path, body = completion_request(max_tokens=2)
    response = fleet.http.post(path, json=body)

    assert response.status_code == 200, response.text
    assert [engine_id for engine_id, _ in fleet.cluster.unreachable] == [3]
    assert len(fleet.cluster.submitted) == 2 and len(fleet.journal.of("de1")) == 1


def test_a_client_that_goes_away_cancels_its_request_and_closes_the_decode_stream(fleet: Fleet):
    path, body = chat_request(stream=True, max_tokens=6)
    fleet.decodes[0].hold_after = 2
    with fleet.http.stream("POST", path, json=body) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data:"))
        next(lines), next(lines)

    assert fleet.cluster.has_cancelled.wait(HANG_GUARD_S)
    assert fleet.decodes[0].closed.wait(HANG_GUARD_S)
    [(request_id, _, _)] = fleet.cluster.submitted
    assert fleet.cluster.cancelled == [request_id]


# --- tenants: cache_salt -------------------------------------------------------------------


def test_a_salted_call_is_placed_under_its_salt_and_every_server_gets_the_salt(fleet: Fleet):
    """The scheduler looks the prompt up under the body's salt; the DE gets the body with it,
    the PE's prefill and a continuation elsewhere carry it too (vLLM's prefix cache and our
    connector key by it; a served PE refuses a request salted otherwise than placed)."""
    path, body = chat_request(stream=True, max_tokens=8, temperature=0, cache_salt="tenant-a")
    fleet.decodes[0].drop_after = 4  # goes on elsewhere: placed again, salted again
    stream_events(fleet, path, body)

    assert [scope.cache_salt for scope in fleet.cluster.scopes] == ["tenant-a", "tenant-a"]
    # The body, then the continuation (a token-id completion); each after its PE's prefill.
    decode_paths = [p for p, _ in fleet.journal.of("de1")]
    assert decode_paths == ["/v1/chat/completions", "/v1/completions"]
    prefills = [b for p, b in fleet.journal.of("pe") if p == "/v1/completions"]
    assert len(prefills) == 2
    for sent in [b for _, b in fleet.journal.of("de1")] + prefills:
        assert sent["cache_salt"] == "tenant-a", sent


def test_an_unsalted_call_sends_no_salt(fleet: Fleet):
    path, body = completion_request(max_tokens=2)
    assert fleet.http.post(path, json=body).status_code == 200

    assert [scope.cache_salt for scope in fleet.cluster.scopes] == [None]
    sent = [b for _, p, b in fleet.journal.entries if p == "/v1/completions"]
    assert len(sent) == 2 and all("cache_salt" not in b for b in sent)


@pytest.mark.parametrize("cache_salt", ["", "a/b", "x" * 129, 7])
def test_a_bad_cache_salt_is_refused_by_name_before_anything_is_placed(
    fleet: Fleet, cache_salt: object
):
    path, body = completion_request(max_tokens=2, cache_salt=cache_salt)
    response = fleet.http.post(path, json=body)

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"
    assert fleet.cluster.submitted == []


# --- the rest of the API -------------------------------------------------------------------


def test_health_models_and_metrics_answer_in_forwarding_mode(fleet: Fleet):
    path, body = completion_request(max_tokens=2)
    assert fleet.http.post(path, json=body).status_code == 200

    assert fleet.http.get("/health").json()["status"] == "ok"
    # The router's name; requests naming it reach the servers under theirs (SERVER_MODEL).
    assert [m["id"] for m in fleet.http.get("/v1/models").json()["data"]] == [MODEL]
    metrics = fleet.http.get("/metrics").text
    assert 'dualpath_generations_total{finish_reason="length"}' in metrics
    assert "dualpath_requests_running 0.0" in metrics  # every earlier test's call ended
    assert "dualpath_requests_waiting 0.0" in metrics

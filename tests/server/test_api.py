"""`dualpath serve` end to end: a real server process (uvicorn on a real port, the scheduler, one
prefill and two decode engine processes over NIXL, a store on disk), driven by the official
`openai` client and raw HTTP (httpx). One server for the module; the last test stops it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dualpath.kv.block_file import is_temp_name
from dualpath.server.vllm_metrics import VLLM_SERIES
from tests.server.serving import (
    MODEL,
    Server,
    auth,
    child_pids,
    engine_pids,
    http_count,
    is_running,
    metric_values,
    paused,
    random_ids,
    start_server,
)

pytest.importorskip("nixl_cu12")

MAX_WAITING = 4
MAX_REQUEST_BYTES = 200_000
LONG_PROMPT_TOKENS = 2000
PREFILL_ENGINE_ID = 0  # 1P2D: engine 0 is the PE
# Tests pause an engine (SIGSTOP) for a moment to hold requests back; the scheduler must not
# declare it dead meanwhile, however slow the machine.
HEARTBEAT_TIMEOUT_S = 120
# A turn's hits count once the last turn's blocks are written; however long that takes on a
# loaded machine, the next turn waits for it (the default gives up after 5 s).
PERSIST_WAIT_S = 120
# For what must happen (a metric reaching its value, engines going idle): waits end as soon
# as it has, so this only bounds a real hang.
BUDGET_S = 60


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve")
    with start_server(
        tiny_model_dir,
        root,
        "--max-waiting-requests", str(MAX_WAITING),
        "--max-request-bytes", str(MAX_REQUEST_BYTES),
        "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
        "--persist-wait-s", str(PERSIST_WAIT_S),
    ) as started:  # fmt: skip
        yield started


# --- operations -----------------------------------------------------------------------------


def test_health_is_503_until_the_engines_are_up(server: Server) -> None:
    assert server.health_statuses_before_ready, "never saw /health before the engines joined"
    assert set(server.health_statuses_before_ready) == {503}
    body = httpx.get(f"{server.url}/health").json()
    assert body["status"] == "ok" and body["num_live_engines"] == 3


def test_models_version_tokenize_detokenize(server: Server) -> None:
    assert [m.id for m in server.client.models.list()] == [MODEL]
    assert httpx.get(f"{server.url}/version").json()["version"]
    tokens = server.http.post("/tokenize", json={"prompt": "def fib(n):"}).json()["tokens"]
    text = server.http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "def fib(n):"


# --- completions ----------------------------------------------------------------------------


def test_streamed_and_whole_completions_agree_token_for_token(server: Server) -> None:
    kwargs = dict(model=MODEL, prompt="def fib(n):", max_tokens=12, temperature=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    whole = server.client.completions.create(**kwargs, extra_body=extra)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 12
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(choice.prompt_token_ids)
    text, token_ids, usage = "", [], None
    stream = server.client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=extra
    )
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            token_ids += chunk.choices[0].token_ids
        else:
            usage = chunk.usage
    assert (text, token_ids) == (choice.text, choice.token_ids)
    assert usage.completion_tokens == 12
    # The tokens are the ones generated: the text is exactly their decoding.
    decoded = server.http.post("/detokenize", json={"tokens": token_ids}).json()["prompt"]
    assert decoded == text


def test_token_id_prompts_and_exact_lengths(server: Server) -> None:
    prompt = random_ids(150, seed=1)
    out = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == 150 and out.usage.completion_tokens == 7
    out = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, extra_body={"min_tokens": 5}
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_stop_string_cuts_where_the_engine_stopped(server: Server) -> None:
    kwargs = dict(model=MODEL, prompt="$ pytest -q\n", temperature=0)
    full = server.client.completions.create(
        **kwargs, max_tokens=24, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].text
    stop = next(
        text[i : i + 2]
        for i in range(4, len(text) - 2)
        if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
    )
    expected = text[: text.find(stop)]
    cut = server.client.completions.create(**kwargs, max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == expected
    streamed = "".join(
        c.choices[0].text
        for c in server.client.completions.create(**kwargs, max_tokens=24, stop=stop, stream=True)
    )
    assert streamed == expected


def test_n_choices_are_seeded_and_reproducible(server: Server) -> None:
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=6, temperature=1.0, n=2, seed=11)
    extra = {"ignore_eos": True, "return_token_ids": True}
    first = server.client.completions.create(**kwargs, extra_body=extra)
    again = server.client.completions.create(**kwargs, extra_body=extra)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    assert first.usage.completion_tokens == 12


def test_each_requests_log_line_gives_its_first_tokens_stages(server: Server) -> None:
    """The server's per-request log line ends with the scheduler's stages of its first token:
    placement / decode_ready / prefill, each in seconds, which lie within its TTFT."""
    response = server.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "stages", "max_tokens": 2}
    )
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    deadline_s = time.monotonic() + 30  # logged as the request closes: a hang guard
    summary = f"request_id={request_id} generations="  # not its access line
    while not (lines := [x for x in server.log.splitlines() if summary in x]):
        assert time.monotonic() < deadline_s, server.log[-2000:]
        time.sleep(0.05)
    fields = dict(item.split("=", 1) for item in lines[-1].split() if "=" in item)
    stages_s = [float(v) for v in fields["first_token_stages_s"].split("/")]
    assert len(stages_s) == 3 and all(s >= 0 for s in stages_s), lines[-1]
    assert sum(stages_s) <= float(fields["ttft_s"]) + 1e-3, lines[-1]  # logged to 0.1 ms


def test_logprobs_of_the_first_token(server: Server) -> None:
    out = server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    (entry,) = out.choices[0].logprobs.content
    assert len(entry.top_logprobs) == 3
    assert entry.token == out.choices[0].message.content
    assert entry.logprob == entry.top_logprobs[0].logprob <= 0  # greedy: the best token
    out = server.client.completions.create(
        model=MODEL, prompt="hi", max_tokens=1, temperature=0, logprobs=2
    )
    assert len(out.choices[0].logprobs.top_logprobs[0]) == 2


def test_logprobs_of_every_token(server: Server) -> None:
    out = server.client.completions.create(
        model=MODEL, prompt="hi", max_tokens=4, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len(out.choices[0].logprobs.token_logprobs) == 4


# --- chat -------------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


def test_agent_conversation_with_tools_reuses_turn_one_kv(server: Server) -> None:
    messages = [
        {"role": "system", "content": "You are a coding agent. " * 30},
        {"role": "user", "content": "The tests fail in test_cache.py. Find the bug."},
    ]
    first = server.client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert first.usage.prompt_tokens > 128
    messages += [
        {
            "role": "assistant",
            "content": first.choices[0].message.content,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "run", "arguments": '{"cmd": "pytest -q"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "FAILED test_evict_order"},
    ]
    second = server.client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 64 == 0
    assert cached <= first.usage.prompt_tokens  # turn 1's prompt blocks, found in the store


def test_streamed_chat_with_usage(server: Server) -> None:
    chunks = list(
        server.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"
    assert sum(len(c.choices[0].token_ids) for c in chunks if c.choices) == 5
    assert chunks[-1].usage.completion_tokens == 5


# --- refusals ---------------------------------------------------------------------------------


def test_api_key_is_required_on_the_api_but_not_on_operations(server: Server) -> None:
    for headers in ({}, auth("wrong")):
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": "x"},
            headers=headers,
        )
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/metrics").status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
        ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unrecognized request argument"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
        ({"prompt": [1, 2, 5000]}, 400, "prompt", "outside the vocabulary"),
        ({"prompt": []}, 400, "prompt", "empty"),
        ({"prompt": "x", "n": 100}, 400, "n", "generations per request"),
        ({"prompt": "x", "echo": True}, 400, "echo", "not supported"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
        ({"prompt": "x", "max_tokens": 20000}, 400, "max_tokens", "maximum context length"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "must not exceed"),
        ({"prompt": "x", "stop": [""]}, 400, "stop", "non-empty"),
    ],
)
def test_bad_completion_requests_get_openai_errors(
    server: Server, body: dict, status: int, param: str, message: str
) -> None:
    response = server.http.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"]


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "forcing a tool call is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "only text content parts",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "Input should"),
    ],
)
def test_bad_chat_requests_get_openai_errors(
    server: Server, extra: dict, param: str, message: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    response = server.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(**body)


def test_malformed_and_oversized_bodies(server: Server) -> None:
    response = server.http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = server.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x" * MAX_REQUEST_BYTES}
    )
    assert (
        response.status_code == 413 and "exceeds the limit" in response.json()["error"]["message"]
    )


def test_a_full_waiting_queue_answers_429_and_counts_it(server: Server) -> None:
    before = metric_values(server)
    # Alone too big for the queue: refused at once.
    with pytest.raises(openai.RateLimitError, match="waiting queue is full"):
        server.client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=MAX_WAITING + 1)
    # Requests arriving while the prefill engine is paused: none can get a first token, so
    # the first MAX_WAITING wait and the rest find the queue full, however fast the machine.
    # (Streamed, so that the statuses come at admission.)
    with paused(engine_pids(server)[PREFILL_ENGINE_ID]):
        statuses = asyncio.run(open_streams_together(server, num_requests=2 * MAX_WAITING))
    assert sorted(statuses) == [200] * MAX_WAITING + [429] * MAX_WAITING, statuses
    after = metric_values(server)
    num_429 = 1 + statuses.count(429)
    route = "/v1/completions"
    assert http_count(after, route, 429) - http_count(before, route, 429) == num_429
    rejected = ("dualpath_requests_rejected_total", (("reason", "queue_full"),))
    assert after[rejected] - before.get(rejected, 0.0) == num_429
    # The streams were closed: the admitted requests were cancelled and left the queue.
    wait_for_metric(server, ("dualpath_requests_waiting", ()), 0)


async def open_streams_together(server: Server, num_requests: int) -> list[int]:
    """Open the streams at once, read their statuses, then close them all."""
    async with (
        httpx.AsyncClient(base_url=server.url, headers=auth(), timeout=30) as client,
        contextlib.AsyncExitStack() as open_responses,
    ):

        async def open_stream(seed: int) -> int:
            body = {
                "model": MODEL,
                "prompt": random_ids(LONG_PROMPT_TOKENS, seed=seed),
                "max_tokens": 1,
                "stream": True,
            }
            request = client.build_request("POST", "/v1/completions", json=body)
            response = await client.send(request, stream=True)
            open_responses.push_async_callback(response.aclose)
            return response.status_code

        return list(await asyncio.gather(*(open_stream(100 + i) for i in range(num_requests))))


def wait_for_metric(server: Server, key: tuple, value: float, timeout_s: float = BUDGET_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        values = metric_values(server)
        if values.get(key, 0.0) == value or time.monotonic() > deadline:
            assert values.get(key, 0.0) == value, (key, values.get(key))
            return values
        time.sleep(0.1)


# --- cancellation, metrics, shutdown --------------------------------------------------------


def test_a_client_that_disconnects_cancels_its_request(server: Server) -> None:
    before = metric_values(server)
    body = {
        "model": MODEL,
        "prompt": random_ids(100, seed=7),
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    num_blocks_before = num_stored_blocks(server)
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    # Non-streaming too: the client gives up while the prefill engine is paused, so the
    # request cannot have finished first, however fast the machine.
    with paused(engine_pids(server)[PREFILL_ENGINE_ID]), pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json={**body, "stream": False}, timeout=0.5)
    cancelled = ("dualpath_generations_total", (("finish_reason", "cancelled"),))
    wait_for_metric(server, cancelled, before.get(cancelled, 0.0) + 2)
    wait_for_metric(server, ("dualpath_requests_running", ()), 0)
    wait_for_metric(server, ("dualpath_requests_waiting", ()), 0)
    # The engines stopped decoding it: once they are idle, the store does not hold the 63
    # blocks of 4000 output tokens (an engine decoding on would stay busy until it did).
    wait_until_engines_are_idle(server)
    assert num_stored_blocks(server) - num_blocks_before < 32


def num_stored_blocks(server: Server) -> int:
    return len(list((server.root / "kv").rglob("*.kvb")))


def wait_until_engines_are_idle(server: Server) -> None:
    """Until no engine's busy time grows between two scrapes 1 s apart (engines report it
    every 0.25 s when idle)."""
    deadline_s = time.monotonic() + BUDGET_S

    def busy_s() -> dict:
        values = metric_values(server)
        return {k: v for k, v in values.items() if k[0] == "dualpath_engine_busy_seconds_total"}

    last = busy_s()
    while True:
        time.sleep(1.0)
        now = busy_s()
        if now == last:
            return
        assert time.monotonic() < deadline_s, f"engines still busy: {now}"
        last = now


def test_metrics_count_requests_and_tokens(server: Server) -> None:
    before = metric_values(server)
    for _ in range(3):
        server.client.completions.create(
            model=MODEL, prompt="count me", max_tokens=3, extra_body={"ignore_eos": True}
        )
    after = metric_values(server)
    route = "/v1/completions"
    assert http_count(after, route, 200) - http_count(before, route, 200) == 3
    tokens = ("dualpath_generation_tokens_total", ())
    assert after[tokens] - before[tokens] == 9
    ttft = ("dualpath_time_to_first_token_seconds_count", ())
    assert after[ttft] - before[ttft] == 3
    assert after[("dualpath_engines_live", ())] == 3
    snic = [k for k in after if k[0] == "dualpath_link_bytes_total" and "snic" in str(k[1])]
    assert snic, "no per-link byte counters"
    # Control messages (reports, tokens) are inference-class traffic on each engine's CNIC.
    inference = [
        value
        for (name, labels), value in after.items()
        if name == "dualpath_link_bytes_total"
        and ("traffic_class", "inference") in labels
        and dict(labels)["link"].endswith(".cnic")
    ]
    assert inference and min(inference) > 0
    occupancy = [k for k in after if k[0] == "dualpath_kv_buffer_used_ratio"]
    assert len(occupancy) == 3 and all(0 <= after[k] <= 1 for k in occupancy)
    busy = {k: v for k, v in after.items() if k[0] == "dualpath_engine_busy_seconds_total"}
    assert len(busy) == 3 and max(busy.values()) > 0


def test_request_series_under_vllms_names_are_ours(server: Server) -> None:
    before = metric_values(server)
    out = server.client.completions.create(
        model=MODEL, prompt="count me", max_tokens=3, extra_body={"ignore_eos": True}
    )
    text = httpx.get(f"{server.url}/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    after = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families.values()
        for s in family.samples
    }
    # Every series of VLLM_SERIES, as vLLM types and labels it, for the served model.
    for series in VLLM_SERIES:
        family = families[series.name]
        assert family.type == series.kind, series.name
        label_names = {"model_name", "engine"} | ({series.label} if series.label else set())
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == label_names, sample
            assert (sample.labels["model_name"], sample.labels["engine"]) == (MODEL, "0")
    vllm = (("engine", "0"), ("model_name", MODEL))

    def finished(reason: str) -> tuple:
        return tuple(sorted((*vllm, ("finished_reason", reason))))

    # The same numbers as ours, at one scrape.
    for ours, theirs in (
        ("dualpath_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("dualpath_prompt_tokens_total", "vllm:prefix_cache_queries_total"),
        ("dualpath_prompt_tokens_total", "vllm:request_prompt_tokens_sum"),
        ("dualpath_cached_prompt_tokens_total", "vllm:prefix_cache_hits_total"),
        ("dualpath_cached_prompt_tokens_total", "vllm:prompt_tokens_cached_total"),
        ("dualpath_generation_tokens_total", "vllm:generation_tokens_total"),
        ("dualpath_generation_tokens_total", "vllm:request_generation_tokens_sum"),
        ("dualpath_requests_waiting", "vllm:num_requests_waiting"),
        ("dualpath_requests_running", "vllm:num_requests_running"),
        ("dualpath_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("dualpath_time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum"),
        ("dualpath_inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
        ("dualpath_time_per_output_token_seconds_count",
         "vllm:request_time_per_output_token_seconds_count"),
        ("dualpath_e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum"),
    ):  # fmt: skip
        assert after[(ours, ())] == after[(theirs, vllm)], theirs
    for (name, labels), value in after.items():
        if name == "dualpath_generations_total":
            reason = dict(labels)["finish_reason"]
            vllm_reason = "abort" if reason == "cancelled" else reason  # vLLM's word for it
            assert after[("vllm:request_success_total", finished(vllm_reason))] == value, reason

    # The request counted once, its usage in the token series.
    def grown(name: str, labels: tuple = vllm) -> float:
        return after[(name, labels)] - before[(name, labels)]

    assert grown("vllm:request_success_total", finished("length")) == 1
    assert grown("vllm:time_to_first_token_seconds_count") == 1
    assert grown("vllm:e2e_request_latency_seconds_count") == 1
    assert grown("vllm:request_time_per_output_token_seconds_count") == 1
    assert grown("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert grown("vllm:generation_tokens_total") == out.usage.completion_tokens == 3
    assert grown("vllm:prefix_cache_hits_total") == out.usage.prompt_tokens_details.cached_tokens


def test_sigterm_ends_requests_stops_every_child_and_exits_0(server: Server) -> None:
    children = child_pids(server.process.pid)
    assert len(children) == 3, children
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines)
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["error"]["message"] == (
        "the server is shutting down"
    )
    assert server.process.wait(timeout=30) == 0, server.log[-3000:]
    deadline = time.monotonic() + BUDGET_S  # ends once they are gone
    while any(is_running(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if is_running(p)]
    # The store is consistent: every write finished (no temporary files left).
    assert not [p for p in (server.root / "kv").rglob(".*") if is_temp_name(p.name)]

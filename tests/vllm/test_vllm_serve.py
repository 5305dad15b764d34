"""DualPath inside vLLM servers the way users deploy it: three vLLM OpenAI servers (1 PE, 2 DEs,
the embedded checkpoint, ``python -m vllm.entrypoints.openai.api_server`` with
``--kv-transfer-config "$(dualpath vllm-config ...)"``) behind ``dualpath serve
--external-engines --nodes 1P2D`` (``dualpath.vllm.bench.served_cluster``), one deployment for the
module, its tests in order on what the earlier ones left in its store:

- the router started first, then the servers one at a time, each once the one before has
  joined: until all have, /health is 503 naming the roles missing and a chat is a 503 with
  Retry-After; then the France question, sent with the model id the router's /v1/models
  lists (the servers answer only to the checkpoint's path), is answered;
- token-id prompts of 300-4,000 tokens give plain vLLM's greedy tokens (its own ``LLM``, no
  connector) cold and warm with ``--read-path pe``: every hit block read on the PE side
  (``dualpath_read_path_bytes_total{side="prefill"}``), none on the DE side; the first of them
  under a ``cache_salt``: nothing read, then its own blocks, and plain vLLM's tokens;
- every server and the front door started again on the same store with ``--read-path de``:
  the same tokens, every hit read on the DE side (pulled layer by layer by the PE), none on the
  PE side;
- a chat whose tool call vLLM's server makes comes back through the front door as the server
  answers it directly: the servers run vLLM's ``hermes`` tool-call parser
  (``--enable-auto-tool-choice --tool-call-parser hermes``) with the checkpoint's own chat
  template; a named ``tool_choice`` makes vLLM constrain the output to a ``<tool_call>`` of that
  tool, which its parser turns into ``tool_calls``;
- a DE's stream cut mid-answer by a TCP proxy between the router and the DE's server (both DEs
  are reached through one), the server alive: no engine declared dead
  (``dualpath_engine_deaths_total`` unchanged), the stream ends with plain vLLM's tokens;
- a DE's server SIGKILLed (every process of it) while 4 streams decode: every stream ends with
  plain vLLM's tokens and no error (the front door places the lost requests again with the
  tokens already sent).

A first difference from plain vLLM is accepted only at a near tie of its top two tokens
(``near_ties``). The kill waits until the victim is seen holding requests; every wait is a
hang guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from dualpath.model.tokenizer import Tokenizer
from dualpath.server.chat import ChatRenderer
from dualpath.vllm.bench.served_cluster import SERVED_MODEL_NAME, ServedCluster, ServedShape
from dualpath.vllm.router.local_prompts import LocalPrompts
from tests.faults.strike import read_metrics
from tests.server.serving import free_port
from tests.vllm.reference import PlainVllm, near_ties
from tests.vllm.tcp_proxy import TcpProxy

pytestmark = pytest.mark.vllm

BLOCK = 64
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, float32: layers x K,V x heads x dims
PROMPT_LENGTHS = (300, 1700, 4000)
MAX_TOKENS = 8
NUM_STREAMS = 4
STREAM_TOKENS = 256  # every stream still decoding when the last one starts, and after the strike
DECODE_IDS = (1, 2)  # 1P2D: engine 0 is the PE; the victim is the DE holding the most streams
HANG_GUARD_S = 600
READ_SERIES = "dualpath_read_path_bytes_total"
TOOL_PARSER = "hermes"
FRANCE = {
    "model": SERVED_MODEL_NAME,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "temperature": 0,
}
SHAPE = ServedShape(
    nodes="1P2D",
    read_path="pe",
    vllm_args=("--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER),
)


CUT_STREAM_TOKENS = 128


@pytest.fixture(scope="module")
def proxies() -> Iterator[dict[int, TcpProxy]]:
    """A TCP proxy in front of each DE's server: the router reaches them through it."""
    with contextlib.ExitStack() as stack:
        yield {e: stack.enter_context(TcpProxy(free_port())) for e in DECODE_IDS}


@pytest.fixture(scope="module")
def cluster(
    smollm2_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    proxies: dict[int, TcpProxy],
) -> Iterator[ServedCluster]:
    served = ServedCluster(smollm2_model_dir, tmp_path_factory.mktemp("served"), SHAPE)
    for engine_id, proxy in proxies.items():
        engine = served.engines[engine_id]
        engine.port, engine.advertised_url = proxy.target[1], proxy.url
    try:
        _start_router_then_servers_one_at_a_time(served)
        yield served
    finally:
        served.stop()


def _start_router_then_servers_one_at_a_time(served: ServedCluster) -> None:
    """The router first; each server once the one before has joined, /health and a chat
    checked before each."""
    served.start_front_door()
    url = _until_answering(served)
    missing_before = [{"prefill": 1, "decode": 2}, {"decode": 2}, {"decode": 1}]
    for engine, missing in zip(served.engines, missing_before, strict=True):
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503, health.text
        assert health.json()["missing_engines_by_role"] == missing, health.json()
        chat = httpx.post(f"{url}/v1/chat/completions", json=FRANCE, timeout=30)
        assert chat.status_code == 503 and chat.headers["retry-after"], chat.text
        for role, n in missing.items():
            assert f"{n} {role} engine" in chat.json()["error"]["message"], chat.text
        engine.launch()
        engine.wait_ready(served.start_timeout_s)
        num_joined = served.engines.index(engine) + 1
        deadline = time.monotonic() + HANG_GUARD_S
        while served.joined() < num_joined:
            assert time.monotonic() < deadline, f"{engine.name} never joined"
            time.sleep(0.2)
    served.wait_for_engines()


def _until_answering(served: ServedCluster) -> str:
    """The router's URL once its HTTP answers (its /health is 503 until engines join)."""
    assert served.front is not None
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{served.front.url}/health", timeout=2.0)
            return served.front.url
        assert served.front._process.poll() is None, served.front.log_tail()
        assert time.monotonic() < deadline, "the router never answered"
        time.sleep(0.2)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(100, 40_000, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(plain_vllm: PlainVllm) -> list[dict]:
    return plain_vllm.generate([(prompt, MAX_TOKENS) for prompt in _prompts()])


def _full_blocks_bytes() -> int:
    """The KV of every whole block of each prompt but its last token's: a warm hit."""
    return sum((n - 1) // BLOCK * BLOCK for n in PROMPT_LENGTHS) * KV_BYTES_PER_TOKEN


def _read_bytes(url: str) -> dict[str, float]:
    sides = {"prefill": 0.0, "decode": 0.0}
    for (name, labels), value in read_metrics(url).items():
        if name == READ_SERIES:
            sides[dict(labels)["side"]] += value
    return sides


def _replay(
    url: str,
    references: list[dict],
    label: str,
    *,
    num_prompts: int = len(PROMPT_LENGTHS),
    cache_salt: str | None = None,
) -> int:
    """Near ties met; every prompt's tokens (of the first ``num_prompts``, salted with
    ``cache_salt`` if given) checked against plain vLLM's."""
    num_ties = 0
    pairs = list(zip(_prompts(), references, strict=True))[:num_prompts]
    for prompt, reference in pairs:
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        body = salt | {
            "model": SERVED_MODEL_NAME,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S)
        assert answer.status_code == 200, answer.text
        tokens = answer.json()["choices"][0]["token_ids"]
        num_ties += near_ties(reference, tokens, f"{label} {len(prompt)}")
    return num_ties


def test_the_france_question_is_answered_with_the_routers_model_id(cluster: ServedCluster) -> None:
    before = read_metrics(cluster.url)
    [model] = [m["id"] for m in httpx.get(f"{cluster.url}/v1/models").json()["data"]]
    body = FRANCE | {"model": model}
    answer = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["choices"][0]["message"]["content"]
    # The agents' APIs, forwarded to the vLLM servers as the chat request they amount to.
    messages = httpx.post(f"{cluster.url}/v1/messages", json=body, timeout=HANG_GUARD_S)
    assert messages.status_code == 200, messages.text
    assert "Paris" in messages.json()["content"][0]["text"]
    responses_body = {
        "model": model,
        "input": body["messages"],
        "max_output_tokens": body["max_tokens"],
        "temperature": 0,
    }
    response = httpx.post(f"{cluster.url}/v1/responses", json=responses_body, timeout=HANG_GUARD_S)
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["output"][0]["content"][0]["text"]
    # The router renders the prompts itself once one matched a server's /tokenize, and no DE
    # refused one (each checks the prompt placed against the one its server renders).
    after = read_metrics(cluster.url)
    rendered_here = ("dualpath_forwarded_prompts_total", (("rendered_by", "router"),))
    refused = ("dualpath_forwarded_prompts_refused_total", ())
    assert after[rendered_here] - before.get(rendered_here, 0.0) >= 2, after
    assert after[refused] == 0.0


def test_the_router_renders_chat_prompts_as_the_servers_do(cluster: ServedCluster) -> None:
    """Conversations as agents send them (a system prompt, tools, a tool call and its result,
    an empty and a missing content), rendered by the router's ``LocalPrompts`` and by a
    server's /tokenize: the same ids."""
    model_dir = Path(cluster.model_dir)
    prompts = LocalPrompts(
        ChatRenderer.for_checkpoint(model_dir), Tokenizer(model_dir / "tokenizer.json")
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    tool = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "Now read a.py \u00e9\u4e2d"},
        ],
    ]
    url = cluster.engines[1].url
    for messages in conversations:
        for extra in ({}, {"tools": [tool]}, {"add_generation_prompt": False}):
            body = {"model": str(model_dir), "messages": messages} | extra
            answer = httpx.post(f"{url}/tokenize", json=body, timeout=HANG_GUARD_S)
            assert answer.status_code == 200, answer.text
            assert prompts.render(body) == answer.json()["tokens"], (messages, extra)


def test_prompts_give_plain_vllms_tokens_cold_then_warm_read_by_the_pe(
    cluster: ServedCluster, references: list[dict]
) -> None:
    before = _read_bytes(cluster.url)
    ties = _replay(cluster.url, references, "cold")
    ties += _replay(cluster.url, references, "warm")
    read = {side: _read_bytes(cluster.url)[side] - before[side] for side in before}
    assert read == {"prefill": _full_blocks_bytes(), "decode": 0.0}, read
    # Each engine's busy time is its vLLM's forwards (the benchmarks calibrate on the PE's).
    busy = {"prefill": 0.0, "decode": 0.0}
    for (name, labels), value in read_metrics(cluster.url).items():
        if name == "dualpath_engine_busy_seconds_total":
            busy[dict(labels)["role"]] += value
    assert busy["prefill"] > 0 and busy["decode"] > 0, busy
    print(f"near ties: {ties} of {2 * len(PROMPT_LENGTHS)}; busy {busy}")


def test_a_cache_salt_finds_only_its_own_blocks_through_the_router(
    cluster: ServedCluster, references: list[dict]
) -> None:
    """The 300-token prompt, stored unsalted by now, under a salt: nothing read (the router's
    lookup is salted), plain vLLM's tokens (the served PE and DE take the salted request:
    their connectors refuse one salted otherwise than placed); then its own blocks, read."""
    before = _read_bytes(cluster.url)
    ties = _replay(cluster.url, references, "salted cold", num_prompts=1, cache_salt="tenant-b")
    assert _read_bytes(cluster.url) == before
    ties += _replay(cluster.url, references, "salted warm", num_prompts=1, cache_salt="tenant-b")
    read = {side: _read_bytes(cluster.url)[side] - before[side] for side in before}
    hit_bytes = (PROMPT_LENGTHS[0] - 1) // BLOCK * BLOCK * KV_BYTES_PER_TOKEN
    assert read == {"prefill": hit_bytes, "decode": 0.0}, read
    print(f"near ties: {ties} of 2")


def test_after_every_server_restarts_hits_are_read_by_the_de(
    cluster: ServedCluster, references: list[dict]
) -> None:
    cluster.stop()
    cluster.shape = dataclasses.replace(SHAPE, read_path="de")
    cluster.start()
    before = _read_bytes(cluster.url)
    ties = _replay(cluster.url, references, "restarted")
    read = {side: _read_bytes(cluster.url)[side] - before[side] for side in before}
    assert read == {"prefill": 0.0, "decode": _full_blocks_bytes()}, read
    print(f"near ties: {ties} of {len(PROMPT_LENGTHS)}")


def test_a_tool_call_comes_back_as_the_server_makes_it(cluster: ServedCluster) -> None:
    body = {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "What is the weather in Paris today?"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "The weather in a city",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 96,
        "temperature": 0,
    }
    through = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)
    direct_url = cluster.engines[1].url  # a DE's server, asked directly (vLLM alone serves it)
    direct_body = body | {"model": str(cluster.model_dir)}  # the name the server answers to
    direct = httpx.post(f"{direct_url}/v1/chat/completions", json=direct_body, timeout=HANG_GUARD_S)
    assert through.status_code == direct.status_code == 200, (through.text, direct.text)
    ours, theirs = through.json()["choices"][0], direct.json()["choices"][0]
    calls = [_call(c) for c in ours["message"]["tool_calls"]]
    assert calls and calls == [_call(c) for c in theirs["message"]["tool_calls"]]
    assert calls[0]["name"] == "get_weather"
    json.loads(calls[0]["arguments"])  # the model's arguments, as the parser found them
    assert ours["finish_reason"] == theirs["finish_reason"]


def _call(call: dict) -> dict:
    """A tool call but its id (vLLM draws one per answer)."""
    return {"type": call["type"], **call["function"]}


def test_a_decode_stream_cut_while_its_server_lives_goes_on_without_a_death(
    cluster: ServedCluster, plain_vllm: PlainVllm, proxies: dict[int, TcpProxy]
) -> None:
    prompt = np.random.default_rng(5).integers(100, 40_000, 300).tolist()
    [reference] = plain_vllm.generate([(prompt, CUT_STREAM_TOKENS)])
    before = read_metrics(cluster.url)
    num_sent = [0]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_stream, cluster.url, prompt, CUT_STREAM_TOKENS, num_sent, 0)
        deadline = time.monotonic() + HANG_GUARD_S
        while num_sent[0] < 4:  # tokens came: the DE's stream is open through its proxy
            assert not future.done(), f"the stream ended first: {future.result()}"
            assert time.monotonic() < deadline, "no token came"
            time.sleep(0.01)
        num_cut = sum(proxy.cut() for proxy in proxies.values())
        tokens, finish = future.result(timeout=HANG_GUARD_S)
    assert num_cut >= 1
    near_ties(reference, tokens, "the cut stream")
    assert finish == "length"
    after = read_metrics(cluster.url)
    deaths = [_sum(m, "dualpath_engine_deaths_total") for m in (before, after)]
    assert deaths[0] == deaths[1], f"an engine was declared dead: {deaths}"
    replaced = [_sum(m, "dualpath_forwarded_replacements_total") for m in (before, after)]
    assert replaced[1] > replaced[0], replaced  # the cut stream went on from a new placement
    print(f"connections cut: {num_cut}; stream's tokens before the cut: >= 4")


def _sum(samples: dict, name: str) -> float:
    return sum(value for (n, _), value in samples.items() if n == name)


def _stream(
    url: str, prompt: list[int], max_tokens: int, num_sent: list[int], index: int
) -> tuple[list[int], str | None]:
    """A completion streamed through the router: its token ids and finish reason;
    ``num_sent[index]`` follows how many came."""
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    finish = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG_GUARD_S) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            tokens += choice.get("token_ids") or []
            num_sent[index] = len(tokens)
            finish = choice.get("finish_reason") or finish
    return tokens, finish


def test_a_decode_server_killed_while_streams_decode(
    cluster: ServedCluster, plain_vllm: PlainVllm
) -> None:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40_000, 200 + 100 * i).tolist() for i in range(NUM_STREAMS)]
    references = plain_vllm.generate([(prompt, STREAM_TOKENS) for prompt in prompts])

    num_sent = [0] * NUM_STREAMS
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [
            pool.submit(_stream, cluster.url, prompt, STREAM_TOKENS, num_sent, i)
            for i, prompt in enumerate(prompts)
        ]
        victim = _wait_until_decoding(cluster.url, futures, num_sent)
        cluster.kill_engine(victim)
        results = [future.result(timeout=HANG_GUARD_S) for future in futures]
    for (tokens, finish), reference, prompt in zip(results, references, prompts, strict=True):
        near_ties(reference, tokens, f"stream of {len(prompt)}")
        assert finish == "length"
    samples = read_metrics(cluster.url)
    replaced = samples.get(("dualpath_forwarded_replacements_total", ()), 0.0)
    assert replaced >= 1  # the victim held streams: they went on elsewhere
    print(f"streams placed again: {replaced:.0f}")


def _wait_until_decoding(url: str, futures: list, num_sent: list[int]) -> int:
    """Until every stream has had a token; then the DE that holds the most requests (the
    scheduler may have placed every stream on one of them). Hang guard only."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        ended = [(i, f) for i, f in enumerate(futures) if f.done()]
        if ended:
            index, future = ended[0]
            outcome = future.exception() or f"{len(future.result()[0])} tokens"
            raise AssertionError(
                f"stream {index} ended before the strike ({outcome!r}); tokens sent to each "
                f"stream: {num_sent}"
            )
        if not all(num_sent):
            time.sleep(0.01)
            continue
        held = dict.fromkeys(DECODE_IDS, 0.0)
        for (name, labels), value in read_metrics(url).items():
            engine = dict(labels).get("engine")
            if name == "dualpath_engine_requests" and engine in {str(e) for e in DECODE_IDS}:
                held[int(engine)] = value
        victim = max(held, key=held.__getitem__)
        if held[victim] > 0:
            return victim
        time.sleep(0.05)
    raise TimeoutError("no decode engine was seen holding a request")

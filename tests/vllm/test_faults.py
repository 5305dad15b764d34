"""A vLLM decode engine SIGKILLed while 8 streams decode (`dualpath serve --engine vllm` 1P2D,
the embedded checkpoint): every stream goes on elsewhere and ends with plain vLLM's greedy
tokens (the near-tie rule of ``reference.near_ties``), and the engine is started again and
rejoins. Twice: with every hit read by the PE, and with every hit read by the DEs
(`--read-path de`, on a store an earlier server filled with the prompts, so the killed engine
holds hit KV that the PE pulls from it for requests still waiting for their prefill).

The kill strikes once the engine decodes and holds requests, seen on /metrics
(``tests/faults/strike.py``: it is sure to hit one, on any machine); the waits are hang guards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.faults.strike import Kill, engine_sample, strike_while_holding
from tests.server.serving import MODEL, Server, auth, engine_pids, metric_values, start_server
from tests.vllm.reference import near_ties, plain_vllm

pytestmark = pytest.mark.vllm

CONTEXT = 1024
NUM_STREAMS = 8
STREAM_TOKENS = 96  # long enough that the lost engine's streams have tokens left to go on
VICTIM_ID = 2  # 1P2D: engine 0 is the PE, 1 and 2 the DEs
HANG_GUARD_S = 600


def _prompts() -> list[list[int]]:
    return [[(seed * 7919 + i * 104729) % 30_000 + 100 for i in range(300 + 40 * seed)]
            for seed in range(NUM_STREAMS)]  # fmt: skip


@pytest.fixture(scope="module")
def references(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    requests = [(prompt, STREAM_TOKENS) for prompt in _prompts()]
    return plain_vllm(smollm2_model_dir, CONTEXT, requests, tmp_path_factory.mktemp("reference"))


@pytest.fixture(params=["pe", "de"])
def read_path(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def server(read_path: str, smollm2_model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    args = ("--engine", "vllm", "--read-path", read_path, "--nodes", "1P2D")
    args += ("--max-model-len", str(CONTEXT))
    if read_path == "de":  # the prompts in the store; the next server's engines start empty
        with start_server(smollm2_model_dir, tmp_path, *args) as first:
            client = first.client.with_options(timeout=HANG_GUARD_S)
            for prompt in _prompts():
                client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    with start_server(smollm2_model_dir, tmp_path, *args) as s:
        yield s


def _side_read_bytes(server: Server, side: str) -> float:
    return metric_values(server).get(("dualpath_read_path_bytes_total", (("side", side),)), 0.0)


def _stream(server: Server, prompt: list[int]) -> dict:
    body = {
        "model": MODEL, "prompt": prompt, "max_tokens": STREAM_TOKENS, "ignore_eos": True,
        "temperature": 0, "stream": True, "return_token_ids": True,
    }  # fmt: skip
    result: dict = {"token_ids": [], "error": None}
    url = f"{server.url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers=auth(), timeout=HANG_GUARD_S) as response:
        result["status"] = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                result["error"] = event["error"]["message"]
            else:
                result["token_ids"] += event["choices"][0]["token_ids"]
    return result


def _num_live_engines(server: Server) -> int:
    return server.health().json()["num_live_engines"]


def test_a_killed_vllm_decode_engines_streams_go_on_and_it_comes_back(
    read_path: str, server: Server, references: list[dict]
) -> None:
    pid_before = engine_pids(server)[VICTIM_ID]

    def is_decoding(samples) -> bool:  # its requests have tokens to go on from
        if read_path == "de" and not samples.get(
            ("dualpath_read_path_bytes_total", (("side", "decode"),))
        ):
            return False  # and it has read hit KV on the DE side
        return engine_sample(samples, "dualpath_engine_busy_seconds_total", VICTIM_ID) > 0

    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(_stream, server, prompt) for prompt in _prompts()]
        struck = strike_while_holding(
            server.url,
            VICTIM_ID,
            Kill(lambda: engine_pids(server)[VICTIM_ID]),
            is_ready=is_decoding,
            should_stop=lambda: all(f.done() for f in futures),
        )
        assert struck, f"every stream ended before engine {VICTIM_ID} held one"
        killed_s = time.monotonic()
        streams = [f.result() for f in futures]
    print(f"\nvLLM DE killed: the streams ended {time.monotonic() - killed_s:.1f} s after")
    assert [(s["status"], s["error"]) for s in streams] == [(200, None)] * NUM_STREAMS
    num_ties = sum(
        near_ties(reference, stream["token_ids"], f"stream {i}")
        for i, (stream, reference) in enumerate(zip(streams, references, strict=True))
    )
    metrics = metric_values(server)
    replaced = metrics[("dualpath_scheduler_replaced_requests_total", ())]
    assert replaced >= 1, "the kill hit no stream"
    if read_path == "de":  # every hit was read on the DE side
        assert _side_read_bytes(server, "decode") > 0 and _side_read_bytes(server, "prefill") == 0
    print(f"{replaced:.0f} stream(s) placed again; {num_ties} near-tie difference(s)")
    # Started again under the same id, it rejoins: /health counts 3 live engines.
    deadline_s = time.monotonic() + HANG_GUARD_S
    while _num_live_engines(server) != 3 or engine_pids(server).get(VICTIM_ID) == pid_before:
        assert time.monotonic() < deadline_s, server.health().text
        time.sleep(0.5)
    out = server.client.with_options(timeout=HANG_GUARD_S).completions.create(
        model=MODEL, prompt=_prompts()[0], max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    first = {key: value[:4] for key, value in references[0].items()}
    near_ties(first, out.choices[0].token_ids, "after the restart")

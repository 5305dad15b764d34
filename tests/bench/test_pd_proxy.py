"""The P/D proxy that fronts vLLM's own disaggregation in ``bench vs-vllm``, against two fake
vLLM instances over real HTTP: the prefill gets a one-token, non-streamed request asking to
keep the KV for a remote decode; the decode gets the client's request with the prefill's
``kv_transfer_params``, and its stream reaches the client unchanged; decoders are taken in turn;
an upstream error reaches the client with its status."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dualpath.vllm.bench.pd_proxy import REMOTE_DECODE_PARAMS, make_app
from tests.server.serving import free_port


class Running:
    """An ASGI app served by uvicorn in a thread of this process."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Running:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def fake_prefill(seen: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        if body["prompt"] == "bad":
            return JSONResponse({"error": {"message": "prompt refused"}}, status_code=400)
        return JSONResponse(
            {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_block_ids": [7]}}
        )

    @app.get("/health")
    async def health() -> dict:
        return {}

    return app


def fake_decode(name: str, seen: list[tuple[str, dict]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append((name, body))
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": f"{name} answer"}]})

        async def events():
            for token in range(body["max_tokens"]):
                yield f"data: {json.dumps({'choices': [{'token_ids': [token]}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> dict:
        return {}

    return app


@pytest.fixture
def cluster() -> Iterator[tuple[str, list, list]]:
    prefill_seen: list[dict] = []
    decode_seen: list[tuple[str, dict]] = []
    with (
        Running(fake_prefill(prefill_seen)) as prefill,
        Running(fake_decode("d0", decode_seen)) as d0,
        Running(fake_decode("d1", decode_seen)) as d1,
        Running(make_app(prefill.url, [d0.url, d1.url])) as proxy,
    ):
        yield proxy.url, prefill_seen, decode_seen


def test_a_streamed_request_is_prefilled_then_decoded_with_the_kv_params(cluster) -> None:
    url, prefill_seen, decode_seen = cluster
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 4,
        "min_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    tokens = [
        json.loads(line[5:])["choices"][0]["token_ids"][0] for line in lines if "[DONE]" not in line
    ]
    assert tokens == [0, 1, 2, 3] and lines[-1] == "data: [DONE]"
    (prefilled,) = prefill_seen
    assert prefilled["max_tokens"] == 1 and prefilled["min_tokens"] == 1
    assert prefilled["stream"] is False and "stream_options" not in prefilled
    assert prefilled["kv_transfer_params"] == REMOTE_DECODE_PARAMS
    ((name, decoded),) = decode_seen
    assert decoded == {**body, "kv_transfer_params": {"remote_block_ids": [7]}}


def test_decoders_are_taken_in_turn_and_errors_pass_through(cluster) -> None:
    url, prefill_seen, decode_seen = cluster
    for _ in range(3):
        answer = httpx.post(
            f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
        )
        assert answer.status_code == 200
    assert [name for name, _ in decode_seen] == ["d0", "d1", "d0"]
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "bad", "max_tokens": 2})
    assert refused.status_code == 400 and "prompt refused" in refused.text
    assert len(decode_seen) == 3  # a refused prefill never reaches a decoder
    assert httpx.get(f"{url}/health").status_code == 200

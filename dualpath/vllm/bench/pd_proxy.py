"""The small proxy that fronts vLLM's own prefill/decode disaggregation, as vLLM's docs describe
it: the baseline ``dualpath bench vs-vllm`` sets beside ``dualpath serve --engine vllm``.

    python -m dualpath.vllm.bench.pd_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --decode http://127.0.0.1:8201 --port 8000

Each ``POST /v1/completions`` (or ``/v1/chat/completions``) goes first to the prefill instance
as a one-token, non-streamed request whose ``kv_transfer_params`` ask it to keep the prompt's KV
for a remote decode (vLLM's ``NixlConnector``: ``do_remote_decode``); the ``kv_transfer_params``
it answers with (where the KV lies) go with the client's own request to a decode instance, which
pulls the KV and answers the client, streamed or not. Decode instances are taken in turn. The
proxy holds no state between requests and never looks inside the answers.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dualpath.cluster_options import add_listen_arguments

# What the prefill instance is asked to do with the prompt's KV (vLLM's NixlConnector fields).
REMOTE_DECODE_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict) -> dict:
    """The client's request as the prefill instance gets it: one token, not streamed."""
    body = dict(body)
    body["kv_transfer_params"] = REMOTE_DECODE_PARAMS
    body["stream"] = False
    body["max_tokens"] = 1
    body.pop("stream_options", None)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if "min_tokens" in body:
        body["min_tokens"] = min(int(body["min_tokens"]), 1)
    return body


def make_app(prefill_url: str, decode_urls: list[str], *, timeout_s: float = 3600.0) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=httpx.Limits())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="vLLM P/D proxy", lifespan=lifespan)
    decoders = itertools.cycle(decode_urls)

    async def forward(path: str, request: Request) -> Response:
        body = await request.json()
        prefilled = await client.post(f"{prefill_url}{path}", json=prefill_body(body))
        if prefilled.status_code != 200:
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        params = prefilled.json().get("kv_transfer_params")
        if params is None:
            return JSONResponse(
                {
                    "error": {
                        "message": "the prefill instance returned no kv_transfer_params "
                        "(is it serving with a kv connector?)",
                        "type": "proxy_error",
                    }
                },
                status_code=502,
            )
        decode_body = {**body, "kv_transfer_params": params}
        decode_url = f"{next(decoders)}{path}"
        if not body.get("stream"):
            answer = await client.post(decode_url, json=decode_body)
            return Response(answer.content, answer.status_code, media_type="application/json")
        upstream = client.build_request("POST", decode_url, json=decode_body)
        response = await client.send(upstream, stream=True)
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            return Response(content, response.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill_url, *decode_urls):
            answer = await client.get(f"{url}/health")
            if answer.status_code != 200:
                return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        answer = await client.get(f"{decode_urls[0]}/v1/models")
        return Response(answer.content, answer.status_code, media_type="application/json")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dualpath.vllm.bench.pd_proxy",
        description="Front one vLLM prefill instance and N decode instances (NixlConnector) "
        "as one OpenAI-compatible server.",
    )
    parser.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    parser.add_argument(
        "--decode", action="append", required=True, help="a decode instance's base URL (repeat)"
    )
    add_listen_arguments(parser)
    args = parser.parse_args(argv)
    app = make_app(args.prefill.rstrip("/"), [url.rstrip("/") for url in args.decode])
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

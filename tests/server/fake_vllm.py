"""Fakes for the forwarding tests (test_forwarding.py): vLLM OpenAI servers on real ports, and
the cluster interface the front door uses in forwarding mode.

``FakeVLLM`` answers like a vLLM 0.32 server (its stream chunks' shapes included) with
deterministic tokens: each token is a function of the whole sequence before it, so a request
that goes on from a prompt plus the tokens sent continues exactly as the undisturbed one would.
Every server records what it received in one shared ``Journal`` (the order across servers),
and can be told to drop its next stream's connection, or hold it open, after k events. A
decode server waits for its PE's request (the same ``dualpath_request_id``) before it answers,
as a real DE waits for the KV.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from dualpath.cluster.coordinator import ClusterSnapshot
from dualpath.protocol import DECODE, PREFILL, Forward, RequestEvent
from dualpath.types import NO_SCOPE, RequestScope, SamplingParams

MODEL = "tiny"  # the front door's served model name
SERVER_MODEL = "/checkpoints/tiny"  # what the servers answer to (vLLM's default: the path)
MAX_MODEL_LEN = 256
VOCAB_SIZE = 512
CREATED = 1_700_000_000
HANG_GUARD_S = 10.0  # only a bug waits this long


def next_token(sequence: list[int]) -> int:
    return (sum(sequence) * 31 + len(sequence)) % 500 + 3


def token_text(token_id: int) -> str:
    return f" t{token_id}"


def text_token_ids(text: str) -> list[int]:
    return [ord(c) % 90 + 3 for c in text]


def chat_token_ids(body: dict[str, Any]) -> list[int]:
    text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
    if body.get("tools"):
        text += f"<tools>{len(body['tools'])}"
    if body.get("add_generation_prompt", True):
        text += "<assistant>"
    return text_token_ids(text)


class Journal:
    """What every fake server received, in order, across servers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: list[tuple[str, str, dict[str, Any]]] = []  # (server, path, body)
        self._prefilled: dict[int, threading.Event] = {}
        self.has_prefill_server = True  # False: decode servers wait for no PE request

    def record(self, server: str, path: str, body: dict[str, Any]) -> None:
        with self._lock:
            self.entries.append((server, path, body))

    def prefilled(self, request_id: int) -> threading.Event:
        with self._lock:
            return self._prefilled.setdefault(request_id, threading.Event())

    def of(self, server: str) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            return [(path, body) for name, path, body in self.entries if name == server]

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self._prefilled.clear()
            self.has_prefill_server = True


class FakeVLLM:
    """One vLLM OpenAI server with our connector, prefill or decode."""

    def __init__(self, name: str, role: str, journal: Journal) -> None:
        self.name = name
        self.role = role
        self.journal = journal
        self.url = ""  # set once serving
        # A DE's connector: told every chat prompt it renders, it refuses one not placed.
        self.cluster: FakeCluster | None = None
        self.app = self._build_app()
        self.reset()

    def reset(self) -> None:
        self.is_healthy = True  # GET /health answers 200 (else 503: its engine is dead)
        self.drop_after: int | None = None  # the next stream's connection drops after k events
        # A prefill server: the next request's connection drops before vLLM takes it (its
        # connector never sees it); or it is refused with this status.
        self.drop_next_prefill = False
        self.refuse_next_prefill: int | None = None
        self.hold_after: int | None = None  # the next stream stops after k events, open
        self.closed = threading.Event()  # a held stream was closed by the other side
        self.sent: list[list[str]] = []  # each stream's events, as sent

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse({}, status_code=200 if self.is_healthy else 503)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": SERVER_MODEL}]})

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONResponse:
            body = await request.json()
            self.journal.record(self.name, "/tokenize", body)
            if body.get("model") not in (None, SERVER_MODEL):
                return _model_not_found(body["model"])
            ids = chat_token_ids(body) if "messages" in body else text_token_ids(body["prompt"])
            return JSONResponse({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await self._generate(request, is_chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Any:
            return await self._generate(request, is_chat=True)

        return app

    async def _generate(self, request: Request, *, is_chat: bool) -> Any:
        body = await request.json()
        self.journal.record(self.name, request.url.path, body)
        request_id = (body.get("kv_transfer_params") or {}).get("dualpath_request_id")
        if body.get("model") not in (None, SERVER_MODEL):
            return _model_not_found(body["model"])
        if self.role == PREFILL:
            if self.drop_next_prefill:
                self.drop_next_prefill = False
                return StreamingResponse(_dropped(f"{self.name} drops the prefill request"))
            if self.refuse_next_prefill is not None:
                status, self.refuse_next_prefill = self.refuse_next_prefill, None
                return JSONResponse(_vllm_error("the prefill server refuses"), status_code=status)
            self.journal.prefilled(request_id).set()
        if (body.get("temperature") or 0) < 0:
            return JSONResponse(_vllm_error("temperature must be non-negative"), status_code=400)
        if is_chat:
            prompt = chat_token_ids(body)
            if self.role == DECODE and request_id is not None and self.cluster is not None:
                self.cluster.check_prompt(request_id, prompt)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
            max_tokens = max_tokens or MAX_MODEL_LEN - len(prompt)
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list) and isinstance(prompt[0], list | str):
                prompt = prompt[0]  # a list of one prompt
            prompt = prompt if isinstance(prompt, list) else text_token_ids(prompt)
            max_tokens = body.get("max_tokens") or 16
        output = []
        for _ in range(max_tokens):
            output.append(next_token(prompt + output))
        reply = _Reply(body, is_chat, f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id}")
        if body.get("stream"):
            events = reply.events(prompt, output)
            return StreamingResponse(
                self._stream(events, request_id), media_type="text/event-stream"
            )
        await self._wait_for_prefill(request_id)
        return JSONResponse(reply.whole(prompt, output))

    async def _wait_for_prefill(self, request_id: int | None) -> None:
        if self.role == DECODE and request_id is not None and self.journal.has_prefill_server:
            is_set = await asyncio.to_thread(self.journal.prefilled(request_id).wait, HANG_GUARD_S)
            assert is_set, f"{self.name}: no prefill request for placement {request_id}"

    async def _stream(self, events: list[str], request_id: int | None) -> Any:
        drop_after, self.drop_after = self.drop_after, None
        hold_after, self.hold_after = self.hold_after, None
        sent: list[str] = []
        self.sent.append(sent)
        await self._wait_for_prefill(request_id)
        for i, event in enumerate(events):
            if i == drop_after:
                raise ConnectionAbortedError(f"{self.name} drops the stream after {i} events")
            if i == hold_after:
                try:
                    await asyncio.Event().wait()  # until the client goes away
                finally:
                    self.closed.set()
            sent.append(event)
            yield event


async def _dropped(why: str) -> Any:
    """A body that breaks the connection before its first byte."""
    raise ConnectionAbortedError(why)
    yield b""  # a generator: uvicorn sends the headers, then the body fails


class _Reply:
    """A vLLM 0.32 answer: ``model_dump_json(exclude_unset=True)`` shapes."""

    def __init__(self, body: dict[str, Any], is_chat: bool, reply_id: str) -> None:
        self.body = body
        self.is_chat = is_chat
        self.id = reply_id
        self.has_token_ids = body.get("return_token_ids") is True

    def _chunk(self, **fields: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        return {"id": self.id, "object": kind, "created": CREATED, "model": MODEL, **fields}

    def events(self, prompt: list[int], output: list[int]) -> list[str]:
        chunks = []
        if self.is_chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            role.update(logprobs=None, finish_reason=None)
            prompt_ids = prompt if self.has_token_ids else None
            chunks.append(self._chunk(choices=[role], prompt_token_ids=prompt_ids))
        for i, token_id in enumerate(output):
            finish_reason = "length" if i == len(output) - 1 else None
            token_ids = [token_id] if self.has_token_ids else None
            if self.is_chat:
                choice = {"index": 0, "delta": {"content": token_text(token_id)}, "logprobs": None}
                choice["finish_reason"] = finish_reason
                if finish_reason is not None:
                    choice["stop_reason"] = None
            else:
                choice = {"index": 0, "text": token_text(token_id), "logprobs": None}
                choice.update(finish_reason=finish_reason, stop_reason=None)
                choice["prompt_token_ids"] = prompt if i == 0 and self.has_token_ids else None
            choice["token_ids"] = token_ids
            chunks.append(self._chunk(choices=[choice]))
        options = self.body.get("stream_options") or {}
        if options.get("include_usage"):
            chunks.append(self._chunk(choices=[], usage=_usage(prompt, output)))
        return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]

    def whole(self, prompt: list[int], output: list[int]) -> dict[str, Any]:
        text = "".join(token_text(t) for t in output)
        if self.is_chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice["finish_reason"] = "length"
        kind = "chat.completion" if self.is_chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": CREATED,
            "model": MODEL,
            "choices": [choice],
            "usage": _usage(prompt, output),
        }


def _usage(prompt: list[int], output: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(output),
        "total_tokens": len(prompt) + len(output),
    }


def _vllm_error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}


def _model_not_found(model: str) -> JSONResponse:
    """vLLM 0.32's answer to a model it does not serve."""
    message = f"The model `{model}` does not exist."
    error = {"message": message, "type": "NotFoundError", "param": "model", "code": 404}
    return JSONResponse({"error": error}, status_code=404)


class FakeCluster:
    """``LocalCluster`` as the front door uses it in forwarding mode: ``submit`` (whose first
    event says where to forward), ``cancel``, ``report_unreachable``, ``snapshot``; and the
    attributes ``ServingContext`` reads once. Engine 0 is the PE; decode engines from 1."""

    max_model_len = MAX_MODEL_LEN
    model_dir = Path("unused")  # read only for --generation-config auto
    model_config = SimpleNamespace(vocab_size=VOCAB_SIZE, eos_token_ids=(2,))
    cluster = SimpleNamespace(
        traffic=SimpleNamespace(snic_bandwidth_gbps=0.0, cnic_bandwidth_gbps=0.0)
    )
    coordinator = SimpleNamespace(store=None)

    def __init__(self, prefill_url: str, decode_urls: list[str]) -> None:
        self.engine_id_to_url = {0: prefill_url} | {i: u for i, u in enumerate(decode_urls, 1)}
        self.engine_id_to_role = {e: PREFILL if e == 0 else DECODE for e in self.engine_id_to_url}
        self._lock = threading.Lock()
        self.reset()

    def reset(self, decode_ids: tuple[int, ...] = (1, 2)) -> None:
        with self._lock:
            self.decode_ids = decode_ids  # placement order
            # How the next placements end before they are forwarded: "lost" (with an engine),
            # "unavailable" (no engine of a role), "failed"; forwarded once it is empty.
            self.unforwarded: list[str] = []
            self.prefill_url = self.engine_id_to_url[0]  # "": the PE is a dualpath engine
            self.submitted: list[tuple[int, list[int], SamplingParams]] = []
            self.scopes: list[RequestScope] = []  # each submission's, in order
            self.cancelled: list[int] = []
            self.unreachable: list[tuple[int, str]] = []
            self._placements: dict[int, tuple[int, Any]] = {}  # id -> (DE, on_event)
            self.has_cancelled = threading.Event()
            self.num_cached_tokens = 0  # each placement's store hits, as its event says

    def start(self, timeout_s: float) -> FakeCluster:
        return self

    def close(self) -> None:
        pass

    def snapshot(self) -> ClusterSnapshot:
        with self._lock:
            dead = {e for e, _ in self.unreachable}
            urls = {e: u for e, u in self.engine_id_to_url.items() if u and e not in dead}
            return ClusterSnapshot(
                time_s=time.monotonic(),
                num_live_engines=len(self.engine_id_to_url) - len(dead),
                num_expected_engines=len(self.engine_id_to_url),
                num_waiting_prefill=0,
                num_waiting_decode=0,
                num_assigned=len(self.submitted),
                engine_urls=urls,
            )

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        on_event,
        scope: RequestScope = NO_SCOPE,
    ) -> int:
        with self._lock:
            request_id = 100 + len(self.submitted)
            self.submitted.append((request_id, list(prompt_token_ids), params))
            self.scopes.append(scope)
            dead = {e for e, _ in self.unreachable}
            decode_id = next(e for e in self.decode_ids if e not in dead)
            if self.unforwarded:
                event = _failed(request_id, self.unforwarded.pop(0))
            else:
                self._placements[request_id] = (decode_id, on_event)
                forward = Forward(
                    request_id, 0, decode_id, self.prefill_url, self.engine_id_to_url[decode_id]
                )
                event = RequestEvent(request_id, (), None, self.num_cached_tokens, forward=forward)
        on_event(event)
        return request_id

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self.cancelled.append(request_id)
            self._placements.pop(request_id, None)
        self.has_cancelled.set()

    def check_prompt(self, request_id: int, prompt: list[int]) -> None:
        """A DE's connector: a placement whose prompt is not the one its server rendered is
        refused (its vLLM serves the request alone)."""
        with self._lock:
            placed = next((ids for r, ids, _ in self.submitted if r == request_id), None)
            placement = self._placements.get(request_id)
            if placed == prompt or placement is None:
                return
            del self._placements[request_id]
        why = f"request {request_id}'s prompt at this vLLM server is not the one it was placed with"
        placement[1](RequestEvent(request_id, (), "error", 0, error=why, is_prompt_refused=True))

    def report_unreachable(self, engine_id: int, why: str) -> None:
        with self._lock:
            self.unreachable.append((engine_id, why))
        self.lose_engine(engine_id)

    def lose_engine(self, engine_id: int) -> None:
        """The scheduler declares the engine dead: its placements fail as lost."""
        with self._lock:
            lost = [(r, f) for r, (e, f) in self._placements.items() if e == engine_id]
            for request_id, _ in lost:
                del self._placements[request_id]
        for request_id, on_event in lost:
            on_event(_lost(request_id, f"engine {engine_id} died"))


def _lost(request_id: int, why: str) -> RequestEvent:
    return RequestEvent(request_id, (), "error", 0, error=why, is_engine_lost=True)


def _failed(request_id: int, how: str) -> RequestEvent:
    if how == "lost":
        return _lost(request_id, "engine 1 died before the prefill")
    is_unavailable = how == "unavailable"
    why = "no prefill engine is alive" if is_unavailable else "the prefill raised"
    return RequestEvent(request_id, (), "error", 0, error=why, is_unavailable=is_unavailable)


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` on uvicorn in a thread; its URL. The socket listens before the thread starts,
    so a request may come at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True  # its lifespan ends; open streams are waited for
        thread.join(HANG_GUARD_S)
        server.force_exit = True
        thread.join(HANG_GUARD_S)
        sock.close()


def closed_port_url() -> str:
    """A URL nothing listens on: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

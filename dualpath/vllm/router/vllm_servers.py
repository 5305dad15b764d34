"""The front door's HTTP client to vLLM server engines (``forwarding.py`` uses it): their
/tokenize (unless the router renders a chat prompt itself: ``local_prompts.py``), the PE's
one-token prefill, and the POST whose answer is relayed.

    async with VLLMServers(cluster, served_model_name=name) as servers:  # the lifespan
        prompt = await servers.prompt_token_ids(body, is_chat=True)  # .token_ids
        async with servers.post(f"{decode_url}/v1/chat/completions", body) as response: ...

One ``httpx.AsyncClient`` (one connection pool) per server serves every forwarded request to
it (``_client_for``). A connection that fails is ``httpx.TransportError``. That alone is no
death (a proxy or a load balancer may cut one stream of a live server): the caller asks the
server's /health (``is_alive``) and reports the engine unreachable to the scheduler
(``LocalCluster.report_unreachable``, which declares it dead at once) only when that fails
too.

The servers answer to their own model names (``--served-model-name``, by default the
checkpoint's path), the router to its own (``dualpath serve --served-model-name``, by default
the checkpoint directory's name, as /v1/models lists it): a request naming the router's
model goes to a server under the server's name (``model_for``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple, Protocol

import httpx
from fastapi.responses import Response

from dualpath.cluster.coordinator import ClusterSnapshot
from dualpath.protocol import Forward
from dualpath.server.errors import APIError
from dualpath.vllm.router.local_prompts import LocalPrompts

logger = logging.getLogger(__name__)

# A vLLM server that does not accept a connection this fast is taken for unreachable (reported
# to the scheduler, the request placed elsewhere). Reads have no timeout: a stream lasts as long
# as its generation, and a prefill may queue behind others.
CONNECT_TIMEOUT_S = 5.0
# A live server answers GET /health this fast (its API process's event loop does, whatever
# its engine computes); no answer in time reads as unreachable.
HEALTH_TIMEOUT_S = 10.0
# What vLLM's /tokenize takes of a chat body, to render the prompt exactly as the DE will.
_CHAT_TOKENIZE_FIELDS = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
)


class Prompt(NamedTuple):
    """A forwarded request's prompt: its token ids, and who made them of the body: "client"
    (a completion's ids), "router" (``local_prompts``: a DE may still refuse them) or
    "server" (a vLLM server's /tokenize)."""

    token_ids: list[int]
    rendered_by: str

    @property
    def is_rendered_here(self) -> bool:
        return self.rendered_by == "router"


class ServedCluster(Protocol):
    """What the front door needs of the cluster to reach its vLLM servers (``LocalCluster``)."""

    def snapshot(self) -> ClusterSnapshot: ...

    def report_unreachable(self, engine_id: int, why: str) -> None: ...


class UpstreamAnswer(Exception):
    """A vLLM server's answer that the client gets as is (a refusal): status and body."""

    def __init__(self, status: int, content: bytes, media_type: str | None) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.content = content
        self.media_type = media_type

    def response(self) -> Response:
        return Response(self.content, status_code=self.status, media_type=self.media_type)


class VLLMServers:
    """The connection pool to the cluster's vLLM servers, open for the app's life."""

    def __init__(
        self,
        cluster: ServedCluster,
        *,
        served_model_name: str,
        local_prompts: LocalPrompts | None = None,
    ) -> None:
        """``local_prompts``: chat prompts rendered here once trusted (``local_prompts.py``);
        None: every prompt is asked of a server's /tokenize."""
        self.cluster = cluster
        self.served_model_name = served_model_name  # the router's, as /v1/models lists it
        self.local_prompts = local_prompts
        self._is_open = False
        # One connection pool per server (its origin), made on first use. httpcore's pool
        # scans every connection it holds on each request it takes or ends, and for each idle
        # one counts the idle ones again: one pool for the whole fleet made that quadratic
        # in every stream in flight (a profiled front door spent 38% of its active CPU there).
        self._clients: dict[str, httpx.AsyncClient] = {}
        # Each server's model names (its /v1/models' ids), asked once per URL.
        self._url_to_model_ids: dict[str, tuple[str, ...]] = {}

    async def __aenter__(self) -> VLLMServers:
        self._is_open = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._is_open = False
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()

    @asynccontextmanager
    async def post(
        self, url: str, body: dict[str, Any], *, on_body_sent: Callable[[], None] | None = None
    ) -> AsyncIterator[httpx.Response]:
        """POST ``body`` as JSON; yields the response once its headers came, its body unread,
        and closes it on exit. ``on_body_sent`` runs once the body's last byte is written to
        the connection. ``httpx.TransportError`` when the connection fails."""
        client = self._client_for(url)
        data = json.dumps(body).encode()

        async def content() -> AsyncIterator[bytes]:
            yield data
            if on_body_sent is not None:  # the transport asks for more once it wrote `data`
                on_body_sent()

        request = client.build_request(
            "POST",
            url,
            content=content(),
            headers={"content-type": "application/json", "content-length": str(len(data))},
        )
        response = await client.send(request, stream=True)
        try:
            yield response
        finally:
            await response.aclose()

    async def is_alive(self, url: str) -> bool:
        """Whether the server at ``url`` answers ``GET /health`` with 200 (vLLM's server does
        while its engine lives) within ``HEALTH_TIMEOUT_S``."""
        client = self._client_for(url)
        try:
            response = await client.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            logger.warning("GET %s/health failed: %r", url, exc)
            return False
        return response.status_code == 200

    async def model_for(self, url: str, model: Any) -> Any:
        """The model name to send the server at ``url`` for the client's ``model``: the
        server's own (its first /v1/models id) when the client named the router's model and
        the server does not answer to that name; else the client's, unchanged (vLLM judges
        it)."""
        if model != self.served_model_name:
            return model
        model_ids = self._url_to_model_ids.get(url)
        if model_ids is None:
            model_ids = await self._model_ids(url)
        if not model_ids or model in model_ids:
            return model
        return model_ids[0]

    async def _model_ids(self, url: str) -> tuple[str, ...]:
        """The server's model ids, kept once read; () when it does not answer (the request
        that follows meets the same failure and handles it)."""
        try:
            response = await self._client_for(url).get(f"{url}/v1/models")
            model_ids = tuple(str(m["id"]) for m in response.json()["data"])
        except (httpx.HTTPError, ValueError, LookupError, TypeError) as exc:
            logger.warning("GET %s/v1/models failed: %r", url, exc)
            return ()
        self._url_to_model_ids[url] = model_ids
        return model_ids

    def _client_for(self, url: str) -> httpx.AsyncClient:
        """The connection pool to the server of ``url`` (any URL on it)."""
        if not self._is_open:  # a route ran outside the app's lifespan: a caller bug
            raise RuntimeError("VLLMServers is used outside its `async with`")
        origin = str(httpx.URL(url).copy_with(path="/", query=None, fragment=None))
        client = self._clients.get(origin)
        if client is None:
            client = self._clients[origin] = _new_client()
        return client

    async def prompt_token_ids(
        self, body: dict[str, Any], *, is_chat: bool, ask_server: bool = False
    ) -> Prompt:
        """The prompt's token ids as the vLLM servers see it: a completion's token ids as
        given, a chat's rendered here once that is trusted (``local_prompts``, never with
        ``ask_server``), else a server's /tokenize's, asked of the first live engine that
        answers. ``UpstreamAnswer`` when vLLM refuses the prompt, ``APIError`` 503 when no vLLM
        server answers."""
        prompt = _one_prompt(body.get("prompt"))
        if not is_chat and is_token_ids(prompt):
            return Prompt(list(prompt), "client")
        rendered = None
        if is_chat and self.local_prompts is not None and not ask_server:
            rendered = self.local_prompts.render(body)
            if rendered is not None and self.local_prompts.is_trusted:
                return Prompt(rendered, "router")
        token_ids = await self._tokenize(_tokenize_request(body, prompt, is_chat=is_chat))
        if rendered is not None:
            self.local_prompts.check(rendered, token_ids)
        return Prompt(token_ids, "server")

    async def _tokenize(self, request: dict[str, Any]) -> list[int]:
        model = request.get("model")
        for engine_id, url in sorted(self.cluster.snapshot().engine_urls.items()):
            request["model"] = await self.model_for(url, model)
            try:
                async with self.post(f"{url}/tokenize", request) as response:
                    content = await response.aread()
            except httpx.TransportError as exc:
                await self.on_broken(engine_id, url, f"POST {url}/tokenize: {exc!r}")
                continue
            if response.status_code != 200:
                raise UpstreamAnswer(
                    response.status_code, content, response.headers.get("content-type")
                )
            return list(json.loads(content)["tokens"])
        raise APIError(503, "no vLLM server engine is reachable to tokenize the prompt")

    async def on_broken(self, engine_id: int, url: str, why: str) -> bool:
        """A connection to engine ``engine_id``'s server at ``url`` failed: whether the server
        still lives (its /health answers). If not, the scheduler is told it is unreachable and
        declares it dead; if it does, nothing is declared (the caller places its request
        again)."""
        if await self.is_alive(url):
            logger.warning("engine %d: %s; its server answers /health: not lost", engine_id, why)
            return True
        self.cluster.report_unreachable(engine_id, f"its server at {url}: {why}")
        return False

    async def prefill(
        self,
        forward: Forward,
        model: Any,
        prompt_token_ids: list[int],
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Have the placement's PE (a vLLM server) prefill the prompt, salted as the client's
        request; its one-token answer is dropped. ``httpx.TransportError`` when the connection
        fails, ``UpstreamAnswer`` when the server refuses: the PE's vLLM may never have seen
        the request, so nothing else would end the placement (its DE would wait for the PE's
        KV for ever); the caller does (``forwarded_placements``)."""
        url = f"{forward.prefill_url}/v1/completions"
        body = {
            "model": await self.model_for(forward.prefill_url, model),
            "prompt": prompt_token_ids,
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "kv_transfer_params": kv_transfer_params(forward),
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        try:
            async with self.post(url, body) as response:
                content = await response.aread()
        except httpx.TransportError as exc:
            logger.warning("placement %d: POST %s failed: %r", forward.request_id, url, exc)
            raise
        if response.status_code != 200:
            logger.warning(
                "placement %d: POST %s answered %d: %s",
                forward.request_id,
                url,
                response.status_code,
                content[:500].decode(errors="replace"),
            )
            raise UpstreamAnswer(
                response.status_code, content, response.headers.get("content-type")
            )


def _new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
        # A stream holds its connection for its whole generation: no pool limit, or one
        # stream too many would wait for a free connection.
        # Few idle ones: the pool counts its idle connections again for each idle one, on
        # every request it takes or ends (a new local connection costs less).
        # An idle connection is dropped before the server's keep-alive timeout (uvicorn's
        # 5 s), so a request never goes out on one the server is closing: that would read
        # as the engine's failure.
        limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=8, keepalive_expiry=2.0
        ),
        # Engine URLs are the cluster's own: a proxy set for the outside world must not sit
        # between the front door and its engines.
        trust_env=False,
    )


def kv_transfer_params(forward: Forward) -> dict[str, Any]:
    """What tells our connector in a vLLM server which placement a request is."""
    return {"dualpath_request_id": forward.request_id}


def is_token_ids(value: Any) -> bool:
    """A prompt given as token ids (a non-empty list of ints)."""
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _one_prompt(prompt: Any) -> Any:
    """A completion's one prompt: a list of one string or of one token-id list unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and not is_token_ids(prompt):
        return prompt[0]
    return prompt


def _tokenize_request(body: dict[str, Any], prompt: Any, *, is_chat: bool) -> dict[str, Any]:
    request = {"model": body.get("model")}
    if not is_chat:
        request["prompt"] = prompt
        if "add_special_tokens" in body:
            request["add_special_tokens"] = body["add_special_tokens"]
        return request
    request.update({name: body[name] for name in _CHAT_TOKENIZE_FIELDS if name in body})
    request["add_generation_prompt"] = body.get("add_generation_prompt", True)
    return request

"""The front door's HTTP client to vLLM server engines (``forwarding.py`` uses it): their
/tokenize, the PE's one-token prefill, and the POST whose answer is relayed.

    async with VLLMServers(cluster) as servers:       # the app's lifespan
        prompt_token_ids = await servers.prompt_token_ids(body, is_chat=True)
        async with servers.post(f"{decode_url}/v1/chat/completions", body) as response: ...

One ``httpx.AsyncClient`` (one connection pool) serves every forwarded request. A connection
that fails is ``httpx.TransportError``; the caller reports the engine unreachable to the
scheduler (``LocalCluster.report_unreachable``), which declares it dead at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import httpx
from fastapi.responses import Response

from dualpath.cluster.coordinator import ClusterSnapshot
from dualpath.protocol import Forward
from dualpath.server.errors import APIError

logger = logging.getLogger(__name__)

# A vLLM server that does not accept a connection this fast is taken for unreachable (reported
# to the scheduler, the request placed elsewhere). Reads have no timeout: a stream lasts as long
# as its generation, and a prefill may queue behind others.
CONNECT_TIMEOUT_S = 5.0
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

    def __init__(self, cluster: ServedCluster) -> None:
        self.cluster = cluster
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> VLLMServers:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            # A stream holds its connection for its whole generation: no pool limit, or one
            # stream too many would wait for a free connection.
            # An idle connection is dropped before the server's keep-alive timeout (uvicorn's
            # 5 s), so a request never goes out on one the server is closing: that would read
            # as the engine's failure.
            limits=httpx.Limits(
                max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0
            ),
            # Engine URLs are the cluster's own: a proxy set for the outside world must not sit
            # between the front door and its engines.
            trust_env=False,
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @asynccontextmanager
    async def post(
        self, url: str, body: dict[str, Any], *, on_body_sent: Callable[[], None] | None = None
    ) -> AsyncIterator[httpx.Response]:
        """POST ``body`` as JSON; yields the response once its headers came, its body unread,
        and closes it on exit. ``on_body_sent`` runs once the body's last byte is written to
        the connection. ``httpx.TransportError`` when the connection fails."""
        if self._client is None:  # a route ran outside the app's lifespan: a caller bug
            raise RuntimeError("VLLMServers is used outside its `async with`")
        data = json.dumps(body).encode()

        async def content() -> AsyncIterator[bytes]:
            yield data
            if on_body_sent is not None:  # the transport asks for more once it wrote `data`
                on_body_sent()

        request = self._client.build_request(
            "POST",
            url,
            content=content(),
            headers={"content-type": "application/json", "content-length": str(len(data))},
        )
        response = await self._client.send(request, stream=True)
        try:
            yield response
        finally:
            await response.aclose()

    async def prompt_token_ids(self, body: dict[str, Any], *, is_chat: bool) -> list[int]:
        """The prompt's token ids as the vLLM servers see it: a completion's token ids as
        given, else their /tokenize's, asked of the first live engine that answers.
        ``UpstreamAnswer`` when vLLM refuses the prompt, ``APIError`` 503 when no vLLM server
        answers."""
        prompt = _one_prompt(body.get("prompt"))
        if not is_chat and is_token_ids(prompt):
            return list(prompt)
        request = _tokenize_request(body, prompt, is_chat=is_chat)
        for engine_id, url in sorted(self.cluster.snapshot().engine_urls.items()):
            try:
                async with self.post(f"{url}/tokenize", request) as response:
                    content = await response.aread()
            except httpx.TransportError as exc:
                self.cluster.report_unreachable(engine_id, f"POST {url}/tokenize: {exc!r}")
                continue
            if response.status_code != 200:
                raise UpstreamAnswer(
                    response.status_code, content, response.headers.get("content-type")
                )
            return list(json.loads(content)["tokens"])
        raise APIError(503, "no vLLM server engine is reachable to tokenize the prompt")

    async def prefill(self, forward: Forward, model: Any, prompt_token_ids: list[int]) -> None:
        """Have the placement's PE (a vLLM server) prefill the prompt; its one-token answer is
        dropped. A failure is only logged: the scheduler hears of it from the connectors and
        fails the placement through its events."""
        url = f"{forward.prefill_url}/v1/completions"
        body = {
            "model": model,
            "prompt": prompt_token_ids,
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "kv_transfer_params": kv_transfer_params(forward),
        }
        try:
            async with self.post(url, body) as response:
                content = await response.aread()
        except httpx.TransportError as exc:
            logger.warning("placement %d: POST %s failed: %r", forward.request_id, url, exc)
            return
        if response.status_code != 200:
            logger.warning(
                "placement %d: POST %s answered %d: %s",
                forward.request_id,
                url,
                response.status_code,
                content[:500].decode(errors="replace"),
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

"""One API call forwarded to vLLM servers (``forwarding.py``): what its client gets, and the
going-on elsewhere when a placement is lost.

    call = ForwardedCall(context, servers, request, body, prompt, params, is_chat=True)
    response = await call.respond()  # the DE's answer or refusal, our JSON error, or SSE

A placement is lost when its DE's connection fails or its stream ends before ``[DONE]`` (the
DE is reported unreachable to the scheduler), or when the scheduler says so
(``RequestEvent.is_engine_lost``). The call is then placed again (``forwarded_placements.py``,
at most ``MAX_PLACEMENTS`` in all):

- the client has no chunk yet (a non-streamed call, or a stream with nothing relayed): the
  same body again, from scratch;
- mid-stream: the prompt and the tokens sent so far, as a token-id prompt to the new DE's
  /v1/completions with the tokens left to generate; its chunks are rewritten into the
  client's format with the first stream's ``id``, ``created`` and ``model``
  (``forwarded_stream.py``), so the client reads one undisturbed stream. That continued
  text is content: the first DE's tool-call and reasoning parsers do not run on it, a stop
  string spanning the two parts is not seen, and logprobs are not asked of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from dualpath.protocol import Forward
from dualpath.server.context import ServingContext
from dualpath.server.errors import APIError, error_body
from dualpath.server.metrics import GenerationTimes
from dualpath.server.responses import sse
from dualpath.types import NO_SCOPE, RequestScope, SamplingParams
from dualpath.vllm.router.forwarded_placements import ClientGone, Item, Kind, Placements
from dualpath.vllm.router.forwarded_stream import ClientStream
from dualpath.vllm.router.vllm_servers import (
    Prompt,
    UpstreamAnswer,
    VLLMServers,
    kv_transfer_params,
)

logger = logging.getLogger(__name__)


class ForwardedCall:
    """One forwarded API call; see the module docstring."""

    def __init__(
        self,
        context: ServingContext,
        servers: VLLMServers,
        request: Request,
        body: dict[str, Any],
        prompt: Prompt,
        params: SamplingParams,
        *,
        is_chat: bool,
        scope: RequestScope = NO_SCOPE,
    ) -> None:
        """``scope``: the body's cache salt and session (``server.scope.request_scope``)."""
        self.context = context
        self.servers = servers
        self.request = request
        self.body = body
        self.prompt_token_ids = prompt.token_ids
        self._is_prompt_rendered_here = prompt.is_rendered_here
        self.params = params
        self.is_stream = body.get("stream") is True
        self.path = "/v1/chat/completions" if is_chat else "/v1/completions"
        self.arrival_s: float = request.state.arrival_s
        self.placements = Placements(context.cluster, servers, model=body.get("model"), scope=scope)
        self._stream = ClientStream(
            body, len(prompt.token_ids), is_chat=is_chat, on_tokens=self._on_tokens
        )
        self._watch: asyncio.Task | None = None  # the client's disconnect, until streaming
        self._outcome: str | None = None  # a finish reason, "error", "refused"; None: cancelled
        self._is_admitted = False
        self._is_running = False  # output came: out of the waiting queue, counted as running
        self._is_closed = False
        self._first_token_s: float | None = None
        self._second_token_s: float | None = None
        self._last_token_s: float | None = None
        self._num_output_tokens = 0

    # --- the response -------------------------------------------------------------------------

    async def respond(self) -> Response:
        """The client's response: the DE's JSON answer or refusal as is, our JSON error, or
        the SSE stream. ``APIError`` 429 when the waiting queue is full."""
        if not self.context.try_admit(1):
            raise APIError(429, "the waiting queue is full; retry later", code="queue_full")
        self._is_admitted = True
        self.context.generations.add(self)
        self._watch = asyncio.ensure_future(self._watch_disconnect())
        try:
            response = await (self._open_stream() if self.is_stream else self._answer())
        except ClientGone:
            response = Response(status_code=499)
        except APIError as exc:
            self._outcome = "error" if exc.status >= 500 else "refused"
            await self.aclose()
            raise
        except BaseException:
            await self.aclose()
            raise
        if not isinstance(response, _ForwardedStream):
            await self.aclose()
        return response

    async def _answer(self) -> Response:
        """A non-streamed call: its DE's answer. The client has nothing yet, so a lost
        placement is placed again from scratch."""
        while True:
            self._send_body(await self._place())
            item = await self.placements.from_decode()
            if item is not None:
                return self._answered(item)
            self.context.metrics.forwarded_replacements.inc()

    async def _open_stream(self) -> Response:
        """Place the call until a DE accepts its stream (the SSE response relays it from then
        on) or refuses it (its answer as is)."""
        while True:
            self._send_body(await self._place())
            item = await self.placements.from_decode()
            if item is None:  # lost: placed again
                self.context.metrics.forwarded_replacements.inc()
                continue
            if item.kind is not Kind.OPENED:
                return self._answered(item)
            break
        self._watch.cancel()  # the SSE response watches the client from now on
        await asyncio.gather(self._watch, return_exceptions=True)
        self._watch = None
        return _ForwardedStream(self._relay(), self)

    async def _place(self) -> Forward:
        """A new placement of the call's prompt, a server's once rendering here is refused."""
        local_prompts = self.servers.local_prompts
        if local_prompts is not None and not local_prompts.is_trusted:
            await self._ask_server_for_prompt()
        return await self.placements.place(self.prompt_token_ids, self.params)

    async def _ask_server_for_prompt(self) -> None:
        """The prompt as a server's /tokenize gives it, if it was rendered here."""
        if not self._is_prompt_rendered_here:
            return
        try:
            prompt = await self.servers.prompt_token_ids(self.body, is_chat=True, ask_server=True)
        except UpstreamAnswer as answer:
            raise APIError(
                500,
                f"a vLLM server refused to tokenize the prompt: "
                f"{answer.content[:300].decode(errors='replace')}",
            ) from answer
        self.prompt_token_ids = prompt.token_ids
        self._is_prompt_rendered_here = False

    def _send_body(self, forward: Forward) -> None:
        """The client's body to the placement's DE, with its ``kv_transfer_params``."""
        body = dict(self.body, kv_transfer_params=kv_transfer_params(forward))
        if self.is_stream:
            body["return_token_ids"] = True  # which tokens the client got: where to go on
        self.placements.send_to_decode(forward, self.path, body)

    def _answered(self, item: Item) -> Response:
        answer: UpstreamAnswer = item.value
        assert item.kind is Kind.ANSWER, f"expected the DE's answer, got {item.kind}"
        if answer.status != 200:  # refused (a 4xx passes through unchanged)
            self._outcome = "refused" if answer.status < 500 else "error"
            return answer.response()
        with contextlib.suppress(ValueError, LookupError, TypeError):  # counted if readable
            answered = json.loads(answer.content)
            self._num_output_tokens = answered["usage"]["completion_tokens"]
            self._outcome = answered["choices"][0]["finish_reason"]
        self._outcome = self._outcome or "stop"
        self._on_first_output()
        return answer.response()

    async def _relay(self) -> AsyncIterator[str]:
        """The client's SSE events: the DE's as they come, a lost placement gone on from
        elsewhere, and our error event (then [DONE]) when the call fails."""
        stream = self._stream
        try:
            while not stream.is_done:
                item = await self.placements.from_decode()
                if item is None or item.kind is Kind.END:
                    if item is not None:
                        await self.placements.on_broken("its stream ended before [DONE]")
                    events = await self._go_on()
                elif item.kind is Kind.LINE:
                    events = stream.relay(item.value)
                elif item.kind is Kind.ANSWER:
                    answer: UpstreamAnswer = item.value
                    raise APIError(
                        500,
                        f"the decode engine placed to go on with the stream answered "
                        f"{answer.status}: {answer.content[:300].decode(errors='replace')}",
                    )
                else:
                    events = []  # OPENED: a continuation's lines follow
                for event in events:
                    yield event
            # A stream that ends without a finish reason carried vLLM's error event.
            self._outcome = stream.finish_reason or "error"
        except APIError as exc:
            self._outcome = "error"
            yield sse(error_body(exc.status, exc.message, param=exc.param, code=exc.code))
            yield sse("[DONE]")
        except ClientGone:
            return

    async def _go_on(self) -> list[str]:
        """After the placement was lost mid-stream: the events that end the stream when
        nothing is left to generate, else none, once a new placement goes on."""
        stream = self._stream
        if stream.finish_reason is not None:  # only the end of the stream was lost
            return stream.end()
        self.context.metrics.forwarded_replacements.inc()
        if not stream.has_chunk:  # the client has nothing yet: the same request again
            self._send_body(await self._place())
            return []
        if not stream.has_exact_token_ids:
            raise APIError(
                500,
                "the decode engine was lost, and its stream did not say which tokens it sent "
                "(hidden reasoning?): the stream cannot go on elsewhere",
            )
        num_sent = len(stream.token_ids)
        num_left = self.params.max_tokens - num_sent
        if num_left <= 0:  # every token was sent; only the finish was lost
            return stream.finish("length")
        await self._ask_server_for_prompt()  # the new DE gets ids: they must be its server's
        prompt_token_ids = self.prompt_token_ids + stream.token_ids
        min_tokens = max(0, self.params.min_tokens - num_sent)
        params = dataclasses.replace(self.params, max_tokens=num_left, min_tokens=min_tokens)
        forward = await self.placements.place(prompt_token_ids, params)
        body = stream.continue_from_sent(prompt_token_ids, num_left, kv_transfer_params(forward))
        self.placements.send_to_decode(forward, "/v1/completions", body)
        return []

    # --- the client, metrics and the end ------------------------------------------------------

    def abort(self, reason: str) -> None:
        """End the call now (server shutdown): the client gets a 503 (an error event in a
        stream)."""
        self.placements.abort(reason)

    async def _watch_disconnect(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.placements.on_client_gone()

    def _on_tokens(self, token_ids: list[int]) -> None:
        now_s = time.monotonic()
        if self._first_token_s is None:
            self._first_token_s = now_s
            self._on_first_output()
        elif self._second_token_s is None:
            self._second_token_s = now_s
        if self._last_token_s is not None:
            self.context.metrics.inter_token_latency.observe(now_s - self._last_token_s)
        self._last_token_s = now_s
        self._num_output_tokens += len(token_ids)

    def _on_first_output(self) -> None:
        self._is_running = True
        self.context.release_waiting(1)
        self.context.metrics.running.inc()

    async def aclose(self) -> None:
        """End the call: cancel its placement unless its DE finished it, close its HTTP
        requests, give back its waiting place, count it. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        self._count()
        self.context.generations.discard(self)
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self.placements.close(is_finished=self._outcome not in (None, "error", "refused"))

    def _count(self) -> None:
        context, metrics = self.context, self.context.metrics
        metrics.forwarded_prompts_refused.inc(self.placements.num_refused_prompts)
        if self._is_running:
            metrics.running.dec()
        elif self._is_admitted:
            context.release_waiting(1)
        if self._outcome is None:
            metrics.generations.labels("cancelled").inc()
        elif self._outcome != "refused":
            times = GenerationTimes(
                arrival_s=self.arrival_s,
                first_token_s=self._first_token_s,
                second_token_s=self._second_token_s,
                finish_s=time.monotonic(),
                num_output_tokens=self._num_output_tokens,
            )
            metrics.on_generation_finished(
                self._outcome,
                times,
                num_prompt_tokens=len(self.prompt_token_ids),
                num_cached_tokens=self.placements.num_cached_tokens,
                num_replaced_hit_tokens=self.placements.num_replaced_hit_tokens,
                is_session=self.placements.scope.session_id is not None,
            )
        logger.info(
            "request_id=%s forwarded placements=%d prompt_tokens=%d completion_tokens=%d "
            "finish_reason=%s e2e_s=%.4f",
            self.request.state.request_id,
            self.placements.num_placements,
            len(self.prompt_token_ids),
            self._num_output_tokens,
            self._outcome or "cancelled",
            time.monotonic() - self.arrival_s,
        )


class _ForwardedStream(StreamingResponse):
    """A forwarded call's SSE response; it closes the call however the response ends."""

    def __init__(self, content: AsyncIterator[str], call: ForwardedCall) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._call = call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._call.aclose()

"""A forwarded call's placements (``forwarded_call.py``), one at a time: each submitted to the
scheduler, its request sent to its DE (then its prompt to its PE), and everything about it read
back as one sequence of items.

    placements = Placements(cluster, servers, model=body.get("model"))
    forward = await placements.place(prompt_token_ids, params)  # until one is forwarded
    placements.send_to_decode(forward, "/v1/chat/completions", body)
    item = await placements.from_decode()  # ANSWER, or OPENED, LINEs, END; None: lost (a
                                           # connection to its DE or its PE failed)
    await placements.close(is_finished=True)

Items come through one asyncio queue, read on the event loop: the scheduler's events
(``loop.call_soon_threadsafe`` from its thread), the DE's answer and SSE lines (a pump task per
placement), and the call's own (the client went away, the server stops). Items of an earlier
placement are dropped. A DE that refuses its placement's prompt (its server rendered another
from the body: ``local_prompts.py``) serves the request alone: its items go on coming, and the
placement's hits count for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from dualpath.errors import ClusterUnavailable
from dualpath.protocol import Forward, RequestEvent
from dualpath.server.errors import APIError
from dualpath.types import NO_SCOPE, RequestScope, SamplingParams
from dualpath.vllm.router.vllm_servers import ServedCluster, UpstreamAnswer, VLLMServers

logger = logging.getLogger(__name__)

MAX_PLACEMENTS = 3  # as many as the scheduler makes of a request it places itself


class Kind(enum.Enum):
    EVENT = "event"  # a RequestEvent of the placement
    OPENED = "opened"  # its DE accepted a stream (200): LINEs follow
    LINE = "line"  # one line of the DE's stream
    END = "end"  # the DE's stream closed
    ANSWER = "answer"  # the DE's whole answer (UpstreamAnswer): not a stream, or refused
    # A connection to the placement's DE or PE failed (httpx.TransportError): (engine id, its
    # server's URL, why). The placement is lost either way.
    BROKEN = "broken"
    FAILED = "failed"  # forwarding raised something else: a bug, the call fails
    GONE = "gone"  # the client disconnected
    ABORTED = "aborted"  # the server is stopping


@dataclass(frozen=True, slots=True)
class Item:
    placement: int  # which placement it is about; 0: the call's, whichever is current
    kind: Kind
    value: Any = None


class ClientGone(Exception):
    """The client disconnected: nobody reads what the call would answer."""


class PlacingCluster(ServedCluster, Protocol):
    """What placements need of the cluster (``LocalCluster``)."""

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        on_event: Callable[[RequestEvent], None],
        scope: RequestScope = NO_SCOPE,
    ) -> int: ...

    def cancel(self, request_id: int) -> None: ...


class Placements:
    """A forwarded call's placements; see the module docstring. Event-loop only, apart from
    the submission's worker thread and the scheduler's callbacks."""

    def __init__(
        self,
        cluster: PlacingCluster,
        servers: VLLMServers,
        *,
        model: Any,
        scope: RequestScope = NO_SCOPE,
    ) -> None:
        self.cluster = cluster
        self.servers = servers
        self.model = model  # the client's, for the PE's request
        # Every placement's: the scheduler's store lookup, and the PE's request, are salted
        # as the client's body that goes to the DE is.
        self.scope = scope
        self.num_placements = 0
        self.num_cached_tokens = 0  # the first placement's store hits, at assignment
        self.num_replaced_hit_tokens = 0  # the later placements' (each reads its hits again)
        self._num_placement_hit_tokens = 0  # the current placement's
        self.num_refused_prompts = 0  # placements whose DE refused the prompt placed
        self.forward: Forward | None = None
        self._prompt_token_ids: list[int] = []  # the placement's prompt
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []  # the placement's DE pump and PE prefill
        # Serialises submissions (a worker thread) against close(): nothing is submitted
        # after it, and it cancels what was submitted before.
        self._lock = threading.Lock()
        self._cluster_request_id: int | None = None
        self._is_closed = False

    async def place(self, prompt_token_ids: list[int], params: SamplingParams) -> Forward:
        """Drop the current placement and make a new one until one gets its ``Forward``.
        ``APIError`` when the scheduler refuses or fails it, or after ``MAX_PLACEMENTS``;
        ``ClientGone``."""
        while True:
            await self._end_placement()
            if self.num_placements == MAX_PLACEMENTS:
                raise APIError(
                    503,
                    f"generation failed: its engines were lost {MAX_PLACEMENTS} times. Retry "
                    "the request once /health reports the engines back.",
                )
            self.num_placements += 1
            await self._submit(prompt_token_ids, params)
            item = await self._next()
            assert item.kind is Kind.EVENT, f"a placement starts with its event, not {item}"
            event = item.value
            if event.forward is not None:
                self.forward = event.forward
                self._prompt_token_ids = prompt_token_ids
                self._num_placement_hit_tokens = event.num_cached_tokens
                if self.num_placements == 1:
                    self.num_cached_tokens = event.num_cached_tokens
                else:
                    self.num_replaced_hit_tokens += event.num_cached_tokens
                return event.forward
            if not _is_lost(event):
                raise APIError(500, f"placement ended before it was forwarded: {event}")

    async def _submit(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        loop = asyncio.get_running_loop()
        placement = self.num_placements

        def on_event(event: RequestEvent) -> None:  # on the scheduler's loop thread
            # Here, not where the call reads the event: a call already closed drops it, and
            # the router must stop rendering prompts all the same.
            if event.is_prompt_refused and self.servers.local_prompts is not None:
                self.servers.local_prompts.refuse(event.error or "a DE refused its prompt")
            item = Item(placement, Kind.EVENT, event)
            with contextlib.suppress(RuntimeError):  # the event loop is closed: server gone
                loop.call_soon_threadsafe(self._queue.put_nowait, item)

        def submit() -> None:  # a worker thread: submission looks the prompt up in the store
            with self._lock:
                if not self._is_closed:
                    self._cluster_request_id = self.cluster.submit(
                        prompt_token_ids, params, on_event=on_event, scope=self.scope
                    )

        try:
            await asyncio.to_thread(submit)
        except ClusterUnavailable as exc:
            raise APIError(503, str(exc)) from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def _end_placement(self) -> None:
        """The scheduler cancels the current placement; its HTTP requests are closed."""
        with self._lock:
            request_id, self._cluster_request_id = self._cluster_request_id, None
        if request_id is not None:
            self.cluster.cancel(request_id)
        tasks, self._tasks = self._tasks, []
        await _cancel_all(tasks)

    def send_to_decode(self, forward: Forward, path: str, body: dict[str, Any]) -> None:
        """POST ``body`` to the placement's DE at ``path``, then its prompt to its PE once the
        DE has its request: when a stream's headers come (vLLM accepted it; a refused request
        costs the PE nothing), or when a whole answer's body is written (that answer waits
        for the PE's KV)."""
        prompt_token_ids = self._prompt_token_ids
        placement = self.num_placements

        async def prefill_on_pe() -> None:
            try:
                await self.servers.prefill(
                    forward, self.model, prompt_token_ids, cache_salt=self.scope.cache_salt
                )
            except httpx.TransportError as exc:
                why = f"the prefill request failed: {exc!r}"
                broken = (forward.prefill_engine_id, forward.prefill_url, why)
                self._queue.put_nowait(Item(placement, Kind.BROKEN, broken))
            except UpstreamAnswer as answer:
                text = answer.content[:300].decode(errors="replace")
                failure = RuntimeError(
                    f"its prefill engine's server answered {answer.status}: {text}"
                )
                self._queue.put_nowait(Item(placement, Kind.FAILED, failure))

        def prefill() -> None:
            if forward.prefill_url:
                self._tasks.append(asyncio.ensure_future(prefill_on_pe()))

        pump = self._pump(self.num_placements, forward, path, body, prefill)
        self._tasks.append(asyncio.ensure_future(pump))

    async def _pump(
        self,
        placement: int,
        forward: Forward,
        path: str,
        body: dict[str, Any],
        prefill: Callable[[], None],
    ) -> None:
        """The DE's answer to ``body`` into the queue: ANSWER (its whole body: not a stream,
        or refused), or OPENED, its lines and END; BROKEN when the connection fails."""

        def put(kind: Kind, value: Any = None) -> None:
            self._queue.put_nowait(Item(placement, kind, value))

        is_stream = body.get("stream") is True
        decode_url = forward.decode_url
        url = f"{decode_url}{path}"
        try:
            if "model" in body:  # the router's name for the model may not be the server's
                body = dict(body, model=await self.servers.model_for(decode_url, body["model"]))
            async with self.servers.post(
                url, body, on_body_sent=None if is_stream else prefill
            ) as response:
                if response.status_code != 200 or not is_stream:
                    content = await response.aread()
                    media_type = response.headers.get("content-type")
                    put(Kind.ANSWER, UpstreamAnswer(response.status_code, content, media_type))
                    return
                prefill()
                put(Kind.OPENED)
                async for line in response.aiter_lines():
                    put(Kind.LINE, line)
            put(Kind.END)
        except httpx.TransportError as exc:
            put(Kind.BROKEN, (forward.decode_engine_id, decode_url, repr(exc)))
        except Exception as exc:
            logger.exception("forwarding to %s failed", url)
            put(Kind.FAILED, exc)

    async def from_decode(self) -> Item | None:
        """The placement's next item from its DE (ANSWER, OPENED, LINE, END), or None when
        the placement is lost (a failed connection: ``on_broken``). ``APIError`` when it
        failed, ``ClientGone``."""
        while True:
            item = await self._next()
            if item.kind is Kind.BROKEN:
                await self.servers.on_broken(*item.value)
                return None
            if item.kind is Kind.FAILED:
                raise APIError(500, f"forwarding failed: {item.value}")
            if item.kind is not Kind.EVENT:
                return item
            if item.value.is_prompt_refused:
                self._on_prompt_refused()
            elif _is_lost(item.value):
                return None

    def _on_prompt_refused(self) -> None:
        """The DE refused the placement's prompt: its vLLM serves the request alone and its
        answer goes on coming; nothing of the placement's hits was loaded."""
        self.num_refused_prompts += 1
        if self.num_placements == 1:
            self.num_cached_tokens = 0
        else:
            self.num_replaced_hit_tokens -= self._num_placement_hit_tokens
        self._num_placement_hit_tokens = 0

    async def _next(self) -> Item:
        """The next item of the current placement (or the call's)."""
        while True:
            item = await self._queue.get()
            if item.kind is Kind.GONE:
                raise ClientGone
            if item.kind is Kind.ABORTED:
                raise APIError(503, item.value)
            if item.placement == self.num_placements:
                return item

    async def on_broken(self, why: str) -> None:
        """The connection to the placement's DE broke: the placement is lost (the caller
        places the call again, the scheduler cancels this one). The DE is declared dead only
        if its server does not answer /health either: a cut stream of a live server (a
        proxy, a load balancer, a reset) costs one placement, not the engine."""
        forward = self.forward
        assert forward is not None, "only a forwarded placement has a DE connection"
        await self.servers.on_broken(forward.decode_engine_id, forward.decode_url, why)

    def on_client_gone(self) -> None:
        self._queue.put_nowait(Item(0, Kind.GONE))

    def abort(self, reason: str) -> None:
        """What waits for the placement raises ``APIError`` 503 with ``reason``."""
        self._queue.put_nowait(Item(0, Kind.ABORTED, reason))

    async def close(self, *, is_finished: bool) -> None:
        """Cancel the placement unless ``is_finished`` (its DE ended it; the scheduler ends it
        as the DE reports, its KV's persisting included: a cancel would race that), and close
        its HTTP requests. Nothing is submitted after this. Idempotent."""
        with self._lock:
            self._is_closed = True
            request_id, self._cluster_request_id = self._cluster_request_id, None
        if request_id is not None and not is_finished:
            self.cluster.cancel(request_id)
        tasks, self._tasks = self._tasks, []
        await _cancel_all(tasks)


def _is_lost(event: RequestEvent) -> bool:
    """Whether a placement's event says it was lost with an engine; ``APIError`` when it
    failed otherwise. A finish is not news: the DE's HTTP answer is the truth."""
    if event.error is None:
        return False
    if event.is_engine_lost:
        return True
    status = 503 if event.is_unavailable else 500
    raise APIError(status, f"generation failed: {event.error}")


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, Exception):
            logger.error("a forwarding task failed: %r", result)

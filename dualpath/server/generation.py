"""One API call's engine requests: n choices per prompt, events in, text deltas out.

    generation = Generation(context, prompts, params_per_choice, arrival_s=...)
    await generation.start()           # 429 if the waiting queue is full, 400 if refused
    try:
        async for delta in generation.deltas(): ...
    finally:
        generation.close()             # cancels whatever has not finished

Each choice is its own request to the scheduler (choices of one prompt share its cached
prefix). The scheduler's loop thread hands events over with ``loop.call_soon_threadsafe``
into one queue, so everything below runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dualpath.errors import ClusterUnavailable
from dualpath.protocol import RequestEvent
from dualpath.server.context import ServingContext
from dualpath.server.detokenizer import IncrementalDetokenizer
from dualpath.server.errors import APIError
from dualpath.server.metrics import GenerationTimes
from dualpath.types import NO_SCOPE, RequestScope, SamplingParams, TokenLogprob

logger = logging.getLogger(__name__)

_ABORTED = object()  # queue sentinel: abort() was called


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one event added to one choice. ``token_ids`` and ``logprobs`` are aligned with
    each other, not with ``text`` (text may be held back, see ``IncrementalDetokenizer``)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None


@dataclass
class Choice:
    index: int
    prompt_index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    request_id: int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    has_first_event: bool = False
    first_token_s: float | None = None
    second_token_s: float | None = None
    last_token_s: float | None = None  # the latest event that brought tokens
    # The scheduler's stages of its first token (``RequestEvent.first_token_stages_s``).
    first_token_stages_s: tuple[float, ...] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.token_ids

    @property
    def text(self) -> str:
        return self.detokenizer.text


class Generation:
    """The engine requests of one API call; see the module docstring for the protocol."""

    def __init__(
        self,
        context: ServingContext,
        prompts: list[list[int]],
        params: list[list[SamplingParams]],
        *,
        arrival_s: float,
        request_id: str,
        scope: RequestScope = NO_SCOPE,
    ) -> None:
        """``params[i][j]`` is choice j of prompt i (choice index ``i * len(params[i]) + j``);
        ``scope``: the request's cache salt and session (``server.scope.request_scope``)."""
        self.context = context
        self.scope = scope
        self.prompts = prompts
        self.arrival_s = arrival_s
        self.request_id = request_id
        self.choices: list[Choice] = []
        for prompt_index, prompt_params in enumerate(params):
            for choice_params in prompt_params:
                self.choices.append(
                    Choice(
                        len(self.choices),
                        prompt_index,
                        choice_params,
                        IncrementalDetokenizer(
                            context.tokenizer,
                            stop=choice_params.stop,
                            stop_token_ids=_stop_token_ids(
                                choice_params, context.model.eos_token_ids
                            ),
                        ),
                    )
                )
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_unfinished = len(self.choices)
        self._abort_reason: str | None = None
        # Serialises submissions (a worker thread) against close(): nothing is submitted
        # after close, and close cancels everything submitted before it.
        self._submit_lock = threading.Lock()
        self._is_closed = False
        self._is_admitted = False

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take waiting places and submit every choice; ``APIError`` 429/400/503 if not."""
        context = self.context
        if not context.try_admit(len(self.choices)):
            raise APIError(
                429,
                f"the waiting queue is full ({context.config.max_waiting_requests} requests "
                "without a first token); retry later",
                code="queue_full",
            )
        self._is_admitted = True
        context.generations.add(self)
        loop = asyncio.get_running_loop()
        try:
            # Submission looks the prompt up in the store (file I/O, maybe on a DFS): off the
            # event loop. If this task is cancelled meanwhile, close() stops the rest.
            await asyncio.to_thread(self._submit_all, loop)
        except ClusterUnavailable as exc:
            self.close()
            raise APIError(503, str(exc)) from exc
        except ValueError as exc:
            self.close()
            raise APIError(400, str(exc)) from exc
        except BaseException:
            self.close()
            raise

    def _submit_all(self, loop: asyncio.AbstractEventLoop) -> None:
        cluster = self.context.cluster
        for choice in self.choices:
            with self._submit_lock:
                if self._is_closed:
                    return
                choice.request_id = cluster.submit(
                    self.prompts[choice.prompt_index],
                    choice.params,
                    on_event=lambda event, i=choice.index: _hand_over(loop, self._queue, i, event),
                    scope=self.scope,
                )

    def abort(self, reason: str) -> None:
        """End the generation now (server shutdown): ``deltas`` raises a 503 with ``reason``."""
        self._abort_reason = reason
        self._queue.put_nowait(_ABORTED)

    def close(self) -> None:
        """Cancel unfinished choices and give back waiting places. Idempotent."""
        with self._submit_lock:
            if self._is_closed:
                return
            self._is_closed = True
        context = self.context
        for choice in self.choices:
            if choice.finish_reason is not None:
                continue
            if choice.request_id is not None:
                context.cluster.cancel(choice.request_id)
            context.metrics.generations.labels("cancelled").inc()
            if choice.has_first_event:
                context.metrics.running.dec()
            elif self._is_admitted:
                context.release_waiting(1)
        context.generations.discard(self)
        if self._is_admitted:
            self._log_summary()

    def _log_summary(self) -> None:
        usage = self.usage()
        first_token_s = [c.first_token_s for c in self.choices if c.first_token_s is not None]
        stages_s = self.choices[0].first_token_stages_s if self.choices else None
        logger.info(
            "request_id=%s generations=%d prompt_tokens=%d cached_tokens=%d "
            "completion_tokens=%d finish_reasons=%s ttft_s=%s e2e_s=%.4f "
            "first_token_stages_s=%s",
            self.request_id,
            len(self.choices),
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            usage["completion_tokens"],
            ",".join(c.finish_reason or "cancelled" for c in self.choices),
            f"{min(first_token_s) - self.arrival_s:.4f}" if first_token_s else "none",
            time.monotonic() - self.arrival_s,
            "/".join(f"{s:.4f}" for s in stages_s) if stages_s else "none",
        )

    # --- events -> deltas -----------------------------------------------------------------------

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas as their events arrive, ending after the last finishes.

        ``APIError`` 500 when an engine request fails, 503 when the server aborts it or no
        engine it needs is alive.
        """
        while self._num_unfinished:
            item = await self._queue.get()
            if item is _ABORTED:
                raise APIError(503, self._abort_reason or "aborted")
            index, event = item
            delta = self._apply(self.choices[index], event)
            if delta is not None:
                yield delta

    def _apply(self, choice: Choice, event: RequestEvent) -> ChoiceDelta | None:
        now_s = time.monotonic()
        if choice.finish_reason is not None:
            return None  # cannot happen: the cluster sends nothing after the final event
        if not choice.has_first_event:
            choice.has_first_event = True
            self.context.release_waiting(1)
            self.context.metrics.running.inc()
        if event.error is not None:
            self._finish(choice, "error", now_s)
            raise _generation_failed(event, len(choice.token_ids))
        logprobs = _logprobs_of(choice, event)
        num_before = len(choice.token_ids)
        text = choice.detokenizer.push(event.token_ids)
        num_after = len(choice.token_ids)
        if num_before == 0 and num_after >= 1:
            choice.first_token_s = now_s
        if event.first_token_stages_s is not None:
            choice.first_token_stages_s = event.first_token_stages_s
        if num_before <= 1 < num_after:
            choice.second_token_s = now_s
        if num_after > num_before:
            if choice.last_token_s is not None:
                self.context.metrics.inter_token_latency.observe(now_s - choice.last_token_s)
            choice.last_token_s = now_s
        choice.logprobs.extend(logprobs)
        choice.num_cached_tokens = event.num_cached_tokens
        if event.finish_reason is not None:
            text += choice.detokenizer.finish(event.finish_reason)
            self._finish(choice, event.finish_reason, now_s)
        if not (text or event.token_ids or event.finish_reason):
            return None
        return ChoiceDelta(
            choice.index, text, tuple(event.token_ids), tuple(logprobs), event.finish_reason
        )

    def _finish(self, choice: Choice, finish_reason: str, now_s: float) -> None:
        choice.finish_reason = finish_reason
        self._num_unfinished -= 1
        metrics = self.context.metrics
        metrics.running.dec()
        metrics.on_generation_finished(
            finish_reason,
            GenerationTimes(
                arrival_s=self.arrival_s,
                first_token_s=choice.first_token_s,
                second_token_s=choice.second_token_s,
                finish_s=now_s,
                num_output_tokens=len(choice.token_ids),
            ),
            num_prompt_tokens=len(self.prompts[choice.prompt_index]),
            num_cached_tokens=choice.num_cached_tokens,
            is_session=self.scope.session_id is not None,
        )

    # --- totals -----------------------------------------------------------------------------

    def usage(self) -> dict:
        """OpenAI's ``usage``; ``cached_tokens`` counts each prompt once (its best choice)."""
        num_prompt_tokens = sum(map(len, self.prompts))
        num_cached = [0] * len(self.prompts)
        for choice in self.choices:
            num_cached[choice.prompt_index] = max(
                num_cached[choice.prompt_index], choice.num_cached_tokens
            )
        num_completion_tokens = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(num_cached)},
        }


def _generation_failed(event: RequestEvent, num_sent_tokens: int) -> APIError:
    """What a client reads when a generation fails (before its stream opened, or in it): what
    happened, what it already has, and what to do."""
    sent = (
        f"the {num_sent_tokens} token(s) sent before it stand"
        if num_sent_tokens
        else "no token was generated"
    )
    if event.is_unavailable:
        return APIError(
            503,
            f"generation failed: {event.error}. No engine could go on with it; {sent}. Retry "
            "the request once /health reports the engines back.",
        )
    return APIError(
        500,
        f"generation failed: {event.error}. {sent[0].upper()}{sent[1:]}. Retrying the "
        "request may succeed; the server's log says more.",
    )


def _hand_over(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int, event: RequestEvent
) -> None:
    """Runs on the scheduler's loop thread: queue the event for the event loop."""
    with contextlib.suppress(RuntimeError):  # the event loop is closed: the server is gone
        loop.call_soon_threadsafe(queue.put_nowait, (index, event))


def _stop_token_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> set[int]:
    """Tokens that end the request when generated (the engine's rule, ``LLMEngine``)."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return ids


def _logprobs_of(choice: Choice, event: RequestEvent) -> list[TokenLogprob]:
    """The event's log-probabilities, one per token; 500 if asked for and missing."""
    if choice.params.logprobs is None or not event.token_ids:
        return []
    if event.logprobs is None or len(event.logprobs) != len(event.token_ids):
        # Both engines report them when the request asks: the prefill engine for the first
        # token (PrefillDone), the decode engine for the rest (TokenUpdate). A missing or
        # short list is an engine bug; refuse rather than return a gap.
        raise APIError(
            500,
            f"the engine returned {len(event.logprobs or ())} log-probabilities for "
            f"{len(event.token_ids)} generated token(s): an engine bug, please report it",
        )
    return [
        TokenLogprob(token_id, float(value), tuple((int(t), float(v)) for t, v in top))
        for token_id, (value, top) in zip(event.token_ids, event.logprobs, strict=True)
    ]

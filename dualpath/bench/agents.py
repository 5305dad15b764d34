"""Agents replayed against an OpenAI-compatible server: the client side of the benchmarks.

    records = asyncio.run(run_agents(url, model, workload.sessions))

Each agent is one ``workload.Session``: it waits for its arrival offset, then sends its turns one
after the other to ``POST /v1/completions`` with token-id prompts, streaming, and the vLLM extensions
that make a replay exact: ``ignore_eos`` and ``min_tokens`` = ``max_tokens`` = the turn's output
length, ``return_token_ids`` so the next prompt extends this one with the tokens actually
generated (SPEC §7's replay rule), and ``stream_options.include_usage`` for the cached-token
count. Any OpenAI-compatible server that honours these works (ours, or another with ``--url``).

Per turn it records the request's arrival, its first and second token times and its end on
this process's monotonic clock: TTFT, TTST (time to second token), TPOT and JCT follow.

By default an agent sends its next turn as soon as the previous one ends (an RL rollout's
agents, or a user who never pauses). With ``gap_scale`` it replays the trace's timing too:
turn i+1 goes out ``gap_scale x Turn.gap_s`` after turn i was sent (the trace's gap between
the two requests, which held the original model's answer and the tool or user time), at most
``max_gap_s`` after it if given, or when turn i ends if that is later, since turn i+1's prompt
holds turn i's answer. Real sessions pause for hours (``agentic_coding_dev``: a median gap of
12 s, but 10% over a minute and one of 5.4 hours in the first 16 turns), so a cap keeps one
such pause from holding a run. With ``pause_s``, turn i+1 goes out no sooner than ``pause_s``
after turn i *ended*: the agent's tools run on its answer (both rules may hold at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from dualpath.workload import Session, Turn


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One request of one agent; times in seconds on the client's monotonic clock."""

    session: int
    turn: int
    arrival_s: float  # the request was sent
    first_token_s: float | None
    second_token_s: float | None
    finish_s: float
    num_prompt_tokens: int
    num_cached_tokens: int  # usage.prompt_tokens_details.cached_tokens
    num_output_tokens: int
    error: str | None  # None when the turn completed with its exact output length
    # A digest of the generated token ids: runs of one workload compare their tokens.
    output_digest: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def ttst_s(self) -> float | None:
        if self.second_token_s is None or self.first_token_s is None:
            return None
        return self.second_token_s - self.first_token_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


def digest_tokens(token_ids: list[int]) -> str:
    return hashlib.blake2b(repr(token_ids).encode(), digest_size=8).hexdigest()


class AgentClock(Protocol):
    """The agents' time: seconds, and a way to wait for them inside the event loop."""

    def now_s(self) -> float:
        """The current time in seconds; never decreases."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (>= 0) of this clock's time."""
        ...


@dataclass(frozen=True, slots=True)
class MonotonicAgentClock:
    """Real time: ``time.monotonic`` and ``asyncio.sleep`` (tests pass a clock of their own,
    so the gaps between turns are exact there)."""

    def now_s(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class TurnFailed(Exception):
    """A turn ended without its exact output: the agent stops there (its record says why)."""


async def run_agents(
    url: str,
    model: str,
    sessions: Sequence[Session],
    *,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    on_turn: Callable[[TurnRecord], None] | None = None,
    stop_after_s: float | None = None,
    gap_scale: float | None = None,
    max_gap_s: float | None = None,
    pause_s: float | None = None,
    clock: AgentClock | None = None,
) -> list[TurnRecord]:
    """Replay every session, each starting its ``arrival_s`` after the call; every turn's
    record, in completion order. An agent whose turn fails stops (later turns depend on it).
    With ``stop_after_s``, agents still running then are cancelled (their open requests
    disconnect, which cancels them on the server) and the records so far are returned. With
    ``gap_scale``, turns keep the trace's gaps between requests, each at most ``max_gap_s``;
    with ``pause_s``, each turn waits that long after the previous one's answer ended (module
    docstring). The records' times and the gaps are on ``clock`` (default:
    ``MonotonicAgentClock``); only ``stop_after_s`` runs on the event loop's own clock."""
    clock = clock if clock is not None else MonotonicAgentClock()
    if gap_scale is not None and not gap_scale >= 0:
        raise ValueError(f"gap_scale must be >= 0, got {gap_scale}")
    if max_gap_s is not None and not max_gap_s >= 0:
        raise ValueError(f"max_gap_s must be >= 0, got {max_gap_s}")
    if pause_s is not None and not pause_s >= 0:
        raise ValueError(f"pause_s must be >= 0, got {pause_s}")

    def gap_of(turn: Turn) -> float | None:
        """Seconds from the previous request to this one's, at the least; None: no wait."""
        if gap_scale is None:
            return None
        gap_s = gap_scale * turn.gap_s
        return gap_s if max_gap_s is None else min(gap_s, max_gap_s)

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(sessions) or 1)
    records: list[TurnRecord] = []

    def record(turn: TurnRecord) -> None:
        records.append(turn)
        if on_turn is not None:
            on_turn(turn)

    async with httpx.AsyncClient(
        base_url=url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=limits,
    ) as client:
        start_s = clock.now_s()
        agents = asyncio.gather(
            *(
                _run_agent(
                    client,
                    model,
                    index,
                    session,
                    start_s + session.arrival_s,
                    record,
                    gap_of,
                    pause_s or 0.0,
                    clock,
                )
                for index, session in enumerate(sessions)
            )
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(agents, stop_after_s)
    return records


async def _run_agent(
    client: httpx.AsyncClient,
    model: str,
    index: int,
    session: Session,
    start_at_s: float,
    record: Callable[[TurnRecord], None],
    gap_of: Callable[[Turn], float | None],
    pause_s: float,
    clock: AgentClock,
) -> None:
    await clock.sleep(max(0.0, start_at_s - clock.now_s()))
    prompt = session.first_prompt()
    generated: list[int] = []
    sent_s = ended_s = clock.now_s()
    for turn in range(session.num_turns):
        if turn:
            prompt = session.next_prompt(turn, prompt, generated)
            gap_s = gap_of(session.turns[turn])
            send_at_s = ended_s + pause_s
            if gap_s is not None:
                send_at_s = max(send_at_s, sent_s + gap_s)
            await clock.sleep(max(0.0, send_at_s - clock.now_s()))
        num_output_tokens = session.turns[turn].output_tokens
        result = await complete_turn(
            client, model, index, turn, prompt, num_output_tokens, clock=clock
        )
        sent_s, ended_s = result.record.arrival_s, result.record.finish_s
        record(result.record)
        if result.record.error is not None:
            return
        generated = result.token_ids


@dataclass(frozen=True, slots=True)
class _Completion:
    record: TurnRecord
    token_ids: list[int]


async def complete_turn(
    client: httpx.AsyncClient,
    model: str,
    session: int,
    turn: int,
    prompt: list[int],
    num_output_tokens: int,
    *,
    clock: AgentClock | None = None,
) -> _Completion:
    """One streamed completion of exactly ``num_output_tokens`` tokens, timed on ``clock``
    (default: ``MonotonicAgentClock``)."""
    clock = clock if clock is not None else MonotonicAgentClock()
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": num_output_tokens,
        "min_tokens": num_output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    arrival_s = clock.now_s()
    token_times_s: list[float] = []
    token_ids: list[int] = []
    num_cached_tokens = 0
    error = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise TurnFailed(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise TurnFailed(f"server error: {chunk['error']}")
                for choice in chunk.get("choices", ()):
                    new_ids = choice.get("token_ids") or []
                    now_s = clock.now_s()
                    token_times_s.extend([now_s] * len(new_ids))
                    token_ids.extend(new_ids)
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    num_cached_tokens = int(details.get("cached_tokens") or 0)
        if len(token_ids) != num_output_tokens:
            raise TurnFailed(
                f"expected {num_output_tokens} tokens, got {len(token_ids)} (does the server "
                "support ignore_eos, min_tokens and return_token_ids?)"
            )
    except (TurnFailed, httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    record = TurnRecord(
        session=session,
        turn=turn,
        arrival_s=arrival_s,
        first_token_s=token_times_s[0] if token_times_s else None,
        second_token_s=token_times_s[1] if len(token_times_s) > 1 else None,
        finish_s=clock.now_s(),
        num_prompt_tokens=len(prompt),
        num_cached_tokens=num_cached_tokens,
        num_output_tokens=len(token_ids),
        error=error,
        output_digest=digest_tokens(token_ids),
    )
    return _Completion(record, token_ids)

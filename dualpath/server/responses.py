"""Response bodies and stream chunks in OpenAI's shapes (plain dicts, serialised once).

``return_token_ids`` (vLLM's extension) adds ``token_ids`` to every choice and every chunk, and
``prompt_token_ids`` to every non-streamed choice: the exact tokens, so an agent or a benchmark
extends its context without re-tokenising.

A chat request with ``tools`` (and ``tool_choice`` "auto", the default) gets the calls in its
output as ``message.tool_calls`` (``tool_calls.py`` says what a call is), the rest of the text
as ``content`` (null when there is none), and ``finish_reason`` "tool_calls" when the model
stopped after calling. Streamed, each call is two chunks, as OpenAI sends them: its id, type
and name with empty arguments, then its arguments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dualpath.server.detokenizer import Decoder
from dualpath.server.generation import Choice, ChoiceDelta, Generation
from dualpath.server.tool_calls import (
    ParsedToolCall,
    ToolCallParser,
    new_tool_call_id,
    parse_tool_calls,
)
from dualpath.types import TokenLogprob


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """Fields every body and chunk of one response repeats."""

    id: str
    created_unix_s: int
    model: str
    return_token_ids: bool


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def sse_data(piece: str | bytes) -> list[str]:
    """The payloads of the ``data:`` lines in a piece of an SSE stream (what ``sse`` wrote)."""
    text = piece.decode() if isinstance(piece, bytes) else piece
    return [line[len("data:") :].strip() for line in text.splitlines() if line.startswith("data:")]


class StreamedToolCalls:
    """A streamed chat answer's tool calls, gathered from its deltas (OpenAI's
    ``delta.tool_calls``: by ``index``, the id and name once, the arguments in pieces) until
    the caller takes them whole."""

    def __init__(self) -> None:
        self._index_to_call: dict[int, dict[str, Any]] = {}

    def is_new(self, call_delta: dict[str, Any]) -> bool:
        """Whether the delta begins a call (one not gathered yet)."""
        return call_delta.get("index", 0) not in self._index_to_call

    def add(self, call_delta: dict[str, Any]) -> None:
        gathered = self._index_to_call.setdefault(
            call_delta.get("index", 0), {"id": None, "name": "", "arguments": ""}
        )
        function = call_delta.get("function") or {}
        gathered["id"] = call_delta.get("id") or gathered["id"]
        gathered["name"] = function.get("name") or gathered["name"]
        gathered["arguments"] += function.get("arguments") or ""

    def take(self) -> list[dict[str, Any]]:
        """The calls gathered so far, in index order (``id`` None where none came), and none
        gathered from then on."""
        calls = [self._index_to_call[index] for index in sorted(self._index_to_call)]
        self._index_to_call.clear()
        return calls


# --- /v1/completions ------------------------------------------------------------------------


def completion_body(meta: ResponseMeta, generation: Generation, decoder: Decoder) -> dict:
    choices = []
    for choice in generation.choices:
        body: dict[str, Any] = {
            "index": choice.index,
            "text": choice.text,
            "logprobs": _completion_logprobs(choice.logprobs, decoder)
            if choice.params.logprobs is not None
            else None,
            "finish_reason": choice.finish_reason,
        }
        _add_token_ids(body, meta, choice, generation)
        choices.append(body)
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created_unix_s,
        "model": meta.model,
        "choices": choices,
        "usage": generation.usage(),
    }


def completion_chunk(
    meta: ResponseMeta, delta: ChoiceDelta, *, want_logprobs: bool, decoder: Decoder
) -> dict:
    choice: dict[str, Any] = {
        "index": delta.index,
        "text": delta.text,
        "logprobs": _completion_logprobs(delta.logprobs, decoder) if want_logprobs else None,
        "finish_reason": delta.finish_reason,
    }
    if meta.return_token_ids:
        choice["token_ids"] = list(delta.token_ids)
    return _chunk(meta, "text_completion", [choice])


def _completion_logprobs(logprobs: Sequence[TokenLogprob], decoder: Decoder) -> dict:
    tokens = [decoder.decode([lp.token_id]) for lp in logprobs]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            {decoder.decode([token_id]): value for token_id, value in lp.top} for lp in logprobs
        ],
        "text_offset": offsets,
    }


# --- /v1/chat/completions -------------------------------------------------------------------


def chat_body(
    meta: ResponseMeta,
    generation: Generation,
    decoder: Decoder,
    *,
    parses_tool_calls: bool,
) -> dict:
    choices = []
    for choice in generation.choices:
        message, finish_reason = chat_message(
            choice.text, choice.finish_reason, parses_tool_calls=parses_tool_calls
        )
        body: dict[str, Any] = {
            "index": choice.index,
            "message": message,
            "logprobs": _chat_logprobs(choice.logprobs, decoder)
            if choice.params.logprobs is not None
            else None,
            "finish_reason": finish_reason,
        }
        _add_token_ids(body, meta, choice, generation)
        choices.append(body)
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created_unix_s,
        "model": meta.model,
        "choices": choices,
        "usage": generation.usage(),
    }


def chat_message(
    text: str,
    finish_reason: str | None,
    *,
    parses_tool_calls: bool,
    new_call_id: Callable[[], str] = new_tool_call_id,
) -> tuple[dict[str, Any], str | None]:
    """A whole output's message, and its finish reason as the client sees it."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if not parses_tool_calls:
        return message, finish_reason
    content, calls = parse_tool_calls(text)
    if not calls:
        return message, finish_reason
    message["content"] = content or None
    message["tool_calls"] = [_tool_call_body(call, new_call_id()) for call in calls]
    return message, _with_tool_calls(finish_reason)


def chat_role_chunk(meta: ResponseMeta, index: int) -> dict:
    """A choice's first chunk, as OpenAI sends it: the role and empty content."""
    choice = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    if meta.return_token_ids:
        choice["token_ids"] = []
    return _chunk(meta, "chat.completion.chunk", [choice])


def chat_chunks(
    meta: ResponseMeta,
    delta: ChoiceDelta,
    parser: ToolCallParser | None,
    *,
    want_logprobs: bool,
    decoder: Decoder,
    new_call_id: Callable[[], str] = new_tool_call_id,
) -> list[dict]:
    """The chunks one delta of a choice makes (none if it says nothing). ``parser`` is the
    choice's own, fed here, or None when tool calls are not parsed. The delta's token ids and
    log-probabilities go in the first chunk, its finish reason in the last."""
    if parser is None:
        events: list[str | ParsedToolCall] = [delta.text] if delta.text else []
    else:
        events = parser.push(delta.text)
        if delta.finish_reason is not None:
            events += parser.finish()
    message_deltas: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, str):
            message_deltas.append({"content": event})
        else:
            head = {"index": event.index, **_tool_call_body(event, new_call_id())}
            head["function"]["arguments"] = ""
            arguments = {"index": event.index, "function": {"arguments": event.arguments}}
            message_deltas += [{"tool_calls": [head]}, {"tool_calls": [arguments]}]
    has_extras = meta.return_token_ids or want_logprobs
    if not (message_deltas or delta.finish_reason or has_extras):
        return []
    finish_reason = delta.finish_reason
    if parser is not None and parser.num_calls:
        finish_reason = _with_tool_calls(finish_reason)
    message_deltas = message_deltas or [{}]
    chunks = []
    for i, message_delta in enumerate(message_deltas):
        is_first, is_last = i == 0, i == len(message_deltas) - 1
        choice: dict[str, Any] = {
            "index": delta.index,
            "delta": message_delta,
            "logprobs": _chat_logprobs(delta.logprobs, decoder)
            if want_logprobs and is_first
            else None,
            "finish_reason": finish_reason if is_last else None,
        }
        if meta.return_token_ids:
            choice["token_ids"] = list(delta.token_ids) if is_first else []
        chunks.append(_chunk(meta, "chat.completion.chunk", [choice]))
    return chunks


def _tool_call_body(call: ParsedToolCall, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _with_tool_calls(finish_reason: str | None) -> str | None:
    """A generation that stopped after calling tools finished "tool_calls", as OpenAI says;
    one cut short ("length") says so, calls or not."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _chat_logprobs(logprobs: Sequence[TokenLogprob], decoder: Decoder) -> dict:
    def entry(token_id: int, value: float) -> dict[str, Any]:
        token = decoder.decode([token_id])
        return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


# --- shared ---------------------------------------------------------------------------------


def usage_chunk(meta: ResponseMeta, object_name: str, generation: Generation) -> dict:
    return {**_chunk(meta, object_name, []), "usage": generation.usage()}


def _chunk(meta: ResponseMeta, object_name: str, choices: list[dict]) -> dict:
    return {
        "id": meta.id,
        "object": object_name,
        "created": meta.created_unix_s,
        "model": meta.model,
        "choices": choices,
    }


def _add_token_ids(
    body: dict[str, Any], meta: ResponseMeta, choice: Choice, generation: Generation
) -> None:
    if meta.return_token_ids:
        body["token_ids"] = list(choice.token_ids)
        body["prompt_token_ids"] = generation.prompts[choice.prompt_index]

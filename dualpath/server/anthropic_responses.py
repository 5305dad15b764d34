"""Response bodies, stream events and errors in the Anthropic Messages API's shapes (plain
dicts, serialised once).

A generation's output becomes content blocks in output order: text, and, for a request with
``tools`` (``tool_choice`` auto), each tool call the model wrote (``tool_calls.py`` says what
one is) as a ``tool_use`` block with its ``input`` object; no content at all is one empty
text block, as Anthropic answers it. Streamed, a block is ``content_block_start``, its deltas
(``text_delta``; one ``input_json_delta`` with the whole input, sent once the call's closing
tag is in) and ``content_block_stop``, between ``message_start`` and ``message_delta`` +
``message_stop``. Both come from the same ``ToolCallParser`` events, so the streamed blocks
add up to exactly the non-streamed ones (tool_use ids aside: each response draws its own).

``usage`` counts as Anthropic does: ``input_tokens`` are the prompt tokens not read from the
KV store, ``cache_read_input_tokens`` those read from it (together: the prompt), and
``cache_creation_input_tokens`` is 0 (writing to the store costs a client nothing).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

from dualpath.server.generation import Choice, ChoiceDelta, Generation
from dualpath.server.tool_calls import Event, ToolCallParser

# Anthropic's error types by HTTP status (its clients raise the matching exception).
_STATUS_TO_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # starting, shutting down, or no engine of a role alive
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape, for a response or an ``error`` stream event."""
    error_type = _STATUS_TO_ERROR_TYPE.get(
        status, "api_error" if status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": error_type, "message": message}}


def sse_event(data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic sends it: named by its data's ``type``."""
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def new_tool_use_id() -> str:
    """An id in Anthropic's form, unique across requests (clients match results by it)."""
    return f"toolu_{secrets.token_hex(12)}"


def usage(generation: Generation) -> dict[str, int]:
    totals = generation.usage()
    num_cached = totals["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": totals["prompt_tokens"] - num_cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": num_cached,
        "output_tokens": totals["completion_tokens"],
    }


def stop_reason(
    finish_reason: str | None, stop_string: str | None, *, has_tool_use: bool
) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` of a finished output (an OpenAI finish reason,
    and the stop string met, if any): cut at ``max_tokens`` wins (calls or not), then calls
    made, then a stop sequence met, else the model's end of turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_tool_use:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def _choice_stop_reason(choice: Choice, *, has_tool_use: bool) -> tuple[str, str | None]:
    stop_string = choice.detokenizer.stop_string
    return stop_reason(choice.finish_reason, stop_string, has_tool_use=has_tool_use)


def message_body(
    message_id: str,
    model: str,
    generation: Generation,
    *,
    parses_tool_calls: bool,
    new_id: Callable[[], str] = new_tool_use_id,
) -> dict[str, Any]:
    """The whole message of a finished one-choice generation."""
    (choice,) = generation.choices
    events: list[Event] = [choice.text] if choice.text else []
    if parses_tool_calls:
        parser = ToolCallParser()
        events = parser.push(choice.text) + parser.finish()
    content: list[dict[str, Any]] = []
    for event in events:
        if not isinstance(event, str):
            call_input = json.loads(event.arguments)
            content.append(
                {"type": "tool_use", "id": new_id(), "name": event.name, "input": call_input}
            )
        elif content and content[-1]["type"] == "text":
            content[-1]["text"] += event
        else:
            content.append({"type": "text", "text": event})
    has_tool_use = any(block["type"] == "tool_use" for block in content)
    reason, sequence = _choice_stop_reason(choice, has_tool_use=has_tool_use)
    return {
        **_message(message_id, model, generation),
        "content": content or [{"type": "text", "text": ""}],
        "stop_reason": reason,
        "stop_sequence": sequence,
    }


def _message(message_id: str, model: str, generation: Generation) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(generation),
    }


class ContentBlockEvents:
    """The ``content_block_*`` events of a streamed message's blocks, one open at a time, in
    output order; adjacent text goes into one text block."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.open_type: str | None = None  # the type of the block open now, if any
        self.has_tool_use = False

    def text(self, text: str) -> list[str]:
        events = []
        if self.open_type != "text":
            events += self.stop()
            events.append(self._start({"type": "text", "text": ""}))
        events.append(
            self._event("content_block_delta", delta={"type": "text_delta", "text": text})
        )
        return events

    def start_tool_use(self, call_id: str, name: str) -> list[str]:
        """Open a tool_use block; its input follows (``input_json``)."""
        self.has_tool_use = True
        block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        return [*self.stop(), self._start(block)]

    def input_json(self, partial_json: str) -> list[str]:
        assert self.open_type == "tool_use", f"input JSON for a {self.open_type} block"
        delta = {"type": "input_json_delta", "partial_json": partial_json}
        return [self._event("content_block_delta", delta=delta)]

    def stop(self) -> list[str]:
        """Close the open block, if any."""
        if self.open_type is None:
            return []
        self.open_type = None
        return [self._event("content_block_stop")]

    def close(self) -> list[str]:
        """The message's last block events: the open block closed, or, when there was no
        content, one empty text block (as a whole message has)."""
        events = self.stop()
        if self.num_blocks == 0:
            events += [self._start({"type": "text", "text": ""}), *self.stop()]
        return events

    def _start(self, block: dict[str, Any]) -> str:
        self.open_type = block["type"]
        self.num_blocks += 1
        return self._event("content_block_start", content_block=block)

    def _event(self, event_type: str, **fields: Any) -> str:
        return sse_event({"type": event_type, "index": self.num_blocks - 1, **fields})


def message_start_event(message: dict[str, Any]) -> str:
    return sse_event({"type": "message_start", "message": message})


def message_end_events(
    stop_reason: str | None, stop_sequence: str | None, usage: dict[str, int]
) -> list[str]:
    """``message_delta`` (its usage cumulative, as Anthropic's) and ``message_stop``."""
    message_delta = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": usage,
    }
    return [sse_event(message_delta), sse_event({"type": "message_stop"})]


class MessageStream:
    """The SSE events of one streamed one-choice generation: ``push`` each delta as it comes.
    The first opens the message (its usage has the prompt's cached tokens, known once the
    engine reported the prefill); the final one closes it."""

    def __init__(
        self,
        message_id: str,
        model: str,
        generation: Generation,
        *,
        parses_tool_calls: bool,
        new_id: Callable[[], str] = new_tool_use_id,
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.generation = generation
        self._parser = ToolCallParser() if parses_tool_calls else None
        self._new_id = new_id
        self._blocks = ContentBlockEvents()
        self._is_started = False

    def push(self, delta: ChoiceDelta) -> list[str]:
        events = []
        if not self._is_started:
            self._is_started = True
            events.append(
                message_start_event(_message(self.message_id, self.model, self.generation))
            )
        pieces: list[Event] = [delta.text] if delta.text else []
        if self._parser is not None:
            pieces = self._parser.push(delta.text)
            if delta.finish_reason is not None:
                pieces += self._parser.finish()
        blocks = self._blocks
        for piece in pieces:
            if isinstance(piece, str):
                events += blocks.text(piece)
            else:
                events += blocks.start_tool_use(self._new_id(), piece.name)
                events += [*blocks.input_json(piece.arguments), *blocks.stop()]
        if delta.finish_reason is not None:
            (choice,) = self.generation.choices
            reason, sequence = _choice_stop_reason(choice, has_tool_use=blocks.has_tool_use)
            events += blocks.close()
            events += message_end_events(reason, sequence, usage(self.generation))
        return events

"""A Responses API response: its output items, its body, and its stream of events, in OpenAI's
shapes (plain dicts, serialised once).

    output = ResponseOutput()
    events = output.add_text("Hello")            # each call gives the stream events it makes
    events += output.add_call("get_weather", '{"city": "Paris"}')
    events += output.finish(is_incomplete=False)
    output.items                                  # the response's "output"

A response's items come in the order the model wrote them: a ``message`` item for a run of
text, a ``function_call`` item for each tool call (``tool_calls.py`` says what a call is). An
item is finished before the next starts, so each streamed item is ``added`` then ``done``
with nothing of another item between; text after a call is a new message item. A response
with neither text nor calls has one empty message item. The non-streamed body is built by the
same calls on the whole output, so a stream and a body of the same tokens hold the same items.

Streamed events are numbered by ``EventStream`` (``sequence_number``) and written as OpenAI
writes them, ``event: TYPE`` then ``data: JSON``. The last is ``response.completed`` with the
whole response, whatever its status: like vLLM, and unlike OpenAI, whose stream ends with
``response.incomplete`` when ``max_output_tokens`` cut it short; clients that wait for
``response.completed`` (Codex CLI, the SDK's ``responses.stream``) finish either way. A
generation that fails mid-stream ends it with ``response.failed`` (the response so far, its
``error`` saying why).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dualpath.server.tool_calls import new_tool_call_id

Event = dict[str, Any]


def new_item_id(prefix: str) -> str:
    """An id in OpenAI's form (``resp_``, ``msg_``, ``fc_`` + hex), unique across requests."""
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass
class ResponseOutput:
    """The output items of one response, built as its text and calls arrive (module
    docstring). ``new_id`` and ``new_call_id`` make ids (tests pass counters)."""

    new_id: Callable[[str], str] = new_item_id
    new_call_id: Callable[[], str] = new_tool_call_id
    items: list[dict[str, Any]] = field(default_factory=list, init=False)
    # The message item text goes to, if one is open.
    _open_message: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _is_finished: bool = field(default=False, init=False, repr=False)

    def add_text(self, text: str) -> list[Event]:
        if not text:
            return []
        events = [] if self._open_message is not None else self._open_message_item()
        message = self._open_message
        assert message is not None
        message["content"][0]["text"] += text
        return [*events, self._text_event("response.output_text.delta", message, delta=text)]

    def add_call(self, name: str, arguments: str, call_id: str | None = None) -> list[Event]:
        """A whole tool call: its item added, its arguments in one delta, and done."""
        events = self._close_message(status="completed")
        item = {
            "id": self.new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id or self.new_call_id(),
            "name": name,
            "arguments": "",
        }
        self.items.append(item)
        index = len(self.items) - 1
        events.append(_item_event("response.output_item.added", item, index))
        where = {"item_id": item["id"], "output_index": index}
        events.append(
            {"type": "response.function_call_arguments.delta", **where, "delta": arguments}
        )
        item.update(arguments=arguments, status="completed")
        events.append(
            {"type": "response.function_call_arguments.done", **where, "arguments": arguments}
        )
        events.append(_item_event("response.output_item.done", item, index))
        return events

    def finish(self, *, is_incomplete: bool) -> list[Event]:
        """Close the open item (``incomplete`` if the output was cut short). Call once."""
        if self._is_finished:
            raise RuntimeError("finish called twice")
        self._is_finished = True
        events = [] if self.items else self._open_message_item()
        return events + self._close_message(status="incomplete" if is_incomplete else "completed")

    def _open_message_item(self) -> list[Event]:
        item = {
            "id": self.new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.items.append(item)
        self._open_message = item
        events = [_item_event("response.output_item.added", item, len(self.items) - 1)]
        item["content"].append(_text_part(""))
        events.append(self._part_event("response.content_part.added", item))
        return events

    def _close_message(self, *, status: str) -> list[Event]:
        message, self._open_message = self._open_message, None
        if message is None:
            return []
        message["status"] = status
        text = message["content"][0]["text"]
        return [
            self._text_event("response.output_text.done", message, text=text),
            self._part_event("response.content_part.done", message),
            _item_event("response.output_item.done", message, self.items.index(message)),
        ]

    def _text_event(self, kind: str, message: dict[str, Any], **fields: Any) -> Event:
        where = self._where(message)
        return {"type": kind, **where, "content_index": 0, **fields, "logprobs": []}

    def _part_event(self, kind: str, message: dict[str, Any]) -> Event:
        part = dict(message["content"][0])
        return {"type": kind, **self._where(message), "content_index": 0, "part": part}

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _item_event(kind: str, item: dict[str, Any], index: int) -> Event:
    return {"type": kind, "output_index": index, "item": _copy(item)}


def _copy(value: Any) -> Any:
    """``value`` as it is now: later deltas change the builder's items, not an event's."""
    return json.loads(json.dumps(value))


# --- the response object ------------------------------------------------------------------------


def response_usage(num_input_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict:
    """OpenAI's ``usage``; ``cached_tokens``: prompt tokens whose KV came from the store."""
    return {
        "input_tokens": num_input_tokens,
        "input_tokens_details": {"cached_tokens": num_cached_tokens},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_input_tokens + num_output_tokens,
    }


def finished_body(
    body: dict[str, Any],
    output: ResponseOutput,
    usage: dict[str, Any],
    *,
    is_incomplete: bool,
) -> dict[str, Any]:
    """``body`` (a response ``in_progress``: ``responses_routes.Turn.head``) with its
    output, usage and final status."""
    return {
        **body,
        "status": "incomplete" if is_incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if is_incomplete else None,
        "output": _copy(output.items),
        "usage": usage,
    }


def failed_body(body: dict[str, Any], output: ResponseOutput, message: str) -> dict[str, Any]:
    """``body`` failed mid-generation: the output so far and why (``error``)."""
    return {
        **body,
        "status": "failed",
        "error": {"code": "server_error", "message": message},
        "output": _copy(output.items),
    }


# --- the stream ---------------------------------------------------------------------------------


class EventStream:
    """Numbers one response's events and writes them as server-sent events."""

    def __init__(self) -> None:
        self._num_sent = 0

    def sse(self, event: Event) -> str:
        event = {**event, "sequence_number": self._num_sent}
        self._num_sent += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

    def lifecycle(self, kind: str, response: dict[str, Any]) -> str:
        """``response.created``, ``.in_progress``, ``.completed`` or ``.failed``."""
        return self.sse({"type": kind, "response": response})

"""``POST /v1/responses`` in forwarding mode: the request goes to the vLLM servers as the chat
request it amounts to, and their chat answer comes back as a response.

    response = await forward_response(context, servers, request, turn)

The chat body holds the turn's messages (instructions, the stored conversation, the input
items: ``openai_responses.py``, with each call's arguments as JSON text again), its tools,
``tool_choice``, ``max_output_tokens`` as ``max_tokens``, ``temperature``, ``top_p``, and
the scope's ``cache_salt`` and ``session_id``; it is forwarded as a client's chat request is
(``forwarding.forward_json``: placed by our scheduler, relayed from the DE, placed again if
the DE is lost). The answer's ``message`` (or, streamed, its chunks' deltas) becomes output
items: its content a message item, each of its ``tool_calls`` (parsed by the vLLM server's
own tool parser) a function_call item with the call's id as ``call_id``; streamed calls are
gathered whole and sent once the text resumes or the answer ends. Reasoning the server
returns is dropped. A refusal of the vLLM server (a 4xx) reaches the client as it came; the
usage is the server's (``cached_tokens`` only if it reports prompt token details).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dualpath.server.context import ServingContext
from dualpath.server.errors import APIError
from dualpath.server.responses import StreamedToolCalls, sse_data
from dualpath.server.responses_output import (
    Event,
    EventStream,
    ResponseOutput,
    failed_body,
    finished_body,
    response_usage,
)

if TYPE_CHECKING:  # the routes import this module
    from dualpath.server.responses_routes import Turn
    from dualpath.vllm.router.vllm_servers import VLLMServers


async def forward_response(
    context: ServingContext, servers: VLLMServers, request: Request, turn: Turn
) -> Response:
    """The turn forwarded: its response (JSON or SSE), or the vLLM server's refusal."""
    from dualpath.vllm.router.forwarding import forward_json  # imports the server's routes

    head = turn.head(None)
    answer = await forward_json(context, servers, request, chat_body(turn), is_chat=True)
    if isinstance(answer, StreamingResponse):
        answer.body_iterator = _events(answer.body_iterator, turn, head)
        return answer
    if answer.status_code != 200:
        return answer  # a refusal as it came, or 499 (the client went away)
    try:
        completion = json.loads(answer.body)
        (choice,) = completion["choices"]
        message = choice["message"]
        calls = [{**call, "index": i} for i, call in enumerate(message.get("tool_calls") or ())]
        delta = {"content": message.get("content"), "tool_calls": calls}
        chunk = {"choices": [{"delta": delta, "finish_reason": choice.get("finish_reason")}]}
    except (ValueError, LookupError, TypeError) as exc:
        raise APIError(500, f"the vLLM server's answer is not a chat completion: {exc}") from exc
    chat = ChatAnswer()
    output = ResponseOutput()
    chat.on_chunk({**chunk, "usage": completion.get("usage")}, output)
    chat.finish(output)
    response = chat.response(head, output)
    await turn.keep(response, output)
    return JSONResponse(response)


def chat_body(turn: Turn) -> dict[str, Any]:
    """The chat-completions request ``turn`` amounts to."""
    body = turn.body
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": [_chat_message(m) for m in turn.messages],
        "stream": body.stream,
    }
    optional = {
        "tools": body.template_tools(),
        "tool_choice": body.tool_choice,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "cache_salt": turn.scope.cache_salt,
        "session_id": turn.scope.session_id,
    }
    chat.update({name: value for name, value in optional.items() if value is not None})
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    return chat


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """A template message as the chat API takes it: call arguments as JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {
        **message,
        "tool_calls": [
            {
                **call,
                "function": {
                    **call["function"],
                    "arguments": json.dumps(call["function"]["arguments"], ensure_ascii=False),
                },
            }
            for call in calls
        ],
    }


class ChatAnswer:
    """A chat answer's deltas gathered into output items: text at once, calls whole."""

    def __init__(self) -> None:
        self.calls = StreamedToolCalls()  # calls not yet added
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def on_chunk(self, chunk: dict[str, Any], output: ResponseOutput) -> list[Event]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[Event] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._add_calls(output) + output.add_text(delta["content"])
            for call in delta.get("tool_calls") or ():
                self.calls.add(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _add_calls(self, output: ResponseOutput) -> list[Event]:
        events: list[Event] = []
        for call in self.calls.take():
            events += output.add_call(call["name"], call["arguments"], call["id"])
        return events

    def finish(self, output: ResponseOutput) -> list[Event]:
        """The events that end the answer's output: calls still gathered, the last item."""
        events = self._add_calls(output)
        return events + output.finish(is_incomplete=self.is_incomplete)

    @property
    def is_incomplete(self) -> bool:
        return self.finish_reason == "length"

    def response(self, head: dict[str, Any], output: ResponseOutput) -> dict[str, Any]:
        """The finished response (after ``finish``)."""
        return finished_body(head, output, self._usage(), is_incomplete=self.is_incomplete)

    def _usage(self) -> dict[str, Any] | None:
        if self.usage is None:
            return None
        details = self.usage.get("prompt_tokens_details") or {}
        return response_usage(
            self.usage.get("prompt_tokens", 0),
            details.get("cached_tokens") or 0,
            self.usage.get("completion_tokens", 0),
        )


async def _events(
    chunks: AsyncIterator[str | bytes], turn: Turn, head: dict[str, Any]
) -> AsyncIterator[str]:
    """The forwarded chat stream's SSE chunks as the response's events."""
    stream = EventStream()
    output = ResponseOutput()
    chat = ChatAnswer()
    yield stream.lifecycle("response.created", head)
    yield stream.lifecycle("response.in_progress", head)
    error: str | None = None
    async for piece in chunks:
        for data in sse_data(piece):
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:  # the forwarding code's, or vLLM's, error event
                error = str((chunk["error"] or {}).get("message") or chunk["error"])
                continue
            for event in chat.on_chunk(chunk, output):
                yield stream.sse(event)
    if error is None and chat.finish_reason is None:
        error = "the vLLM server's stream ended without a finish"
    if error is not None:
        yield stream.lifecycle("response.failed", failed_body(head, output, error))
        return
    for event in chat.finish(output):
        yield stream.sse(event)
    response = chat.response(head, output)
    try:
        await turn.keep(response, output)
    except APIError as exc:
        yield stream.lifecycle("response.failed", failed_body(head, output, exc.message))
        return
    yield stream.lifecycle("response.completed", response)

"""``POST /v1/messages`` (and its ``/count_tokens``) in forwarding mode: the request goes to
the vLLM servers as the chat request it amounts to, and their chat answer comes back as an
Anthropic message.

    response = await forward_message(context, servers, request, body)

The chat body holds the conversation converted as for our own engines
(``anthropic_protocol.to_chat_messages``: the same prompt either way), the tools,
``tool_choice``, ``max_tokens``, ``stop_sequences`` as ``stop``, ``temperature``, ``top_p``,
``top_k``, ``cache_salt`` and ``session_id``. It is forwarded as a client's chat request is
(``forwarding.forward_json``): its prompt tokenized by a vLLM server's /tokenize, placed by our
scheduler, relayed from the DE, and placed again if the DE is lost, mid-stream too (the stream
goes on from the tokens sent: text from then on is plain text, as for chat streams). Going
through the chat API rather than vLLM's own /v1/messages is what makes that work: the prompt
our scheduler places is exactly the one the DE renders (vLLM's /v1/messages adapts the prompt
to its template in ways /tokenize cannot be asked for), and a chat stream says which tokens it
sent (``return_token_ids``), where an Anthropic stream does not.

The answer's text becomes a text block, each of its ``tool_calls`` (parsed by the vLLM
server's own tool parser) a tool_use block with the call's id; streamed, a call is gathered
whole and sent as one block once the text resumes, another call starts or the answer ends.
Reasoning a server returns is dropped. ``message_start`` counts the prompt (the DE's
``prompt_token_ids``); the cached tokens come in ``message_delta``'s usage, from the server's
(only if it reports prompt token details). A refusal by a vLLM server keeps its status, in
Anthropic's error shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dualpath.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    to_chat_messages,
    to_chat_tools,
)
from dualpath.server.anthropic_responses import (
    ContentBlockEvents,
    error_body,
    message_end_events,
    message_start_event,
    sse_event,
    stop_reason,
)
from dualpath.server.context import ServingContext
from dualpath.server.errors import APIError
from dualpath.server.responses import StreamedToolCalls, sse_data
from dualpath.vllm.router.forwarding import forward_json
from dualpath.vllm.router.vllm_servers import UpstreamAnswer, VLLMServers

# Our own error events' types (``errors.error_body``) by status, to carry the status over.
_OPENAI_TYPE_TO_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
    "rate_limit_error": 429,
    "server_error": 500,
    "service_unavailable_error": 503,
}


async def forward_message(
    context: ServingContext, servers: VLLMServers, request: Request, body: MessagesRequest
) -> Response:
    """The message forwarded: JSON or SSE; ``APIError`` for a refusal (a vLLM server's too)."""
    answer = await forward_json(context, servers, request, chat_body(body), is_chat=True)
    message_id = f"msg_{request.state.request_id}"
    if isinstance(answer, StreamingResponse):
        stream = ForwardedMessageStream(message_id, body.model)
        answer.body_iterator = stream.events(answer.body_iterator)
        return answer
    if answer.status_code == 499:  # the client went away
        return answer
    if answer.status_code != 200:
        raise upstream_error(answer.status_code, answer.body)
    return JSONResponse(message_of_completion(message_id, body.model, answer.body))


async def count_forwarded(servers: VLLMServers, body: CountTokensRequest) -> int:
    """The prompt's length as a vLLM server tokenizes it."""
    chat = {"model": body.model, "messages": to_chat_messages(body)}
    tools = to_chat_tools(body.tools)
    if tools:
        chat["tools"] = tools
    try:
        return len((await servers.prompt_token_ids(chat, is_chat=True)).token_ids)
    except UpstreamAnswer as answer:
        raise upstream_error(answer.status, answer.content) from answer


def chat_body(body: MessagesRequest) -> dict[str, Any]:
    """The chat-completions request ``body`` amounts to."""
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": to_chat_messages(body),
        "max_tokens": body.max_tokens,
        "stream": body.stream,
    }
    tools = to_chat_tools(body.tools)
    optional = {
        "tools": tools,
        "tool_choice": body.tool_choice.type if tools and body.tool_choice else None,
        "stop": list(body.stop_strings()) or None,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "cache_salt": body.cache_salt,
        "session_id": body.session_id,
    }
    chat.update({name: value for name, value in optional.items() if value is not None})
    if body.stream:
        # The usage at the end; the prompt's and each chunk's token ids (message_start
        # counts the prompt with them).
        chat.update(stream_options={"include_usage": True}, return_token_ids=True)
    return chat


def upstream_error(status: int, content: bytes) -> APIError:
    """A refusal in OpenAI's (or vLLM's) error shape as an ``APIError`` of its status."""
    try:
        message = str(json.loads(content)["error"]["message"])
    except (ValueError, LookupError, TypeError):
        message = content[:1000].decode(errors="replace")
    return APIError(status, message)


def message_of_completion(message_id: str, model: str, content: bytes) -> dict[str, Any]:
    """A vLLM server's chat completion as an Anthropic message."""
    try:
        completion = json.loads(content)
        (choice,) = completion["choices"]
        message = choice["message"]
        blocks = [{"type": "text", "text": message["content"]}] if message.get("content") else []
        calls = [
            _tool_use(call["id"], call["function"]["name"], call["function"]["arguments"])
            for call in message.get("tool_calls") or ()
        ]
        usage = _usage(completion["usage"])
    except (ValueError, LookupError, TypeError) as exc:
        raise APIError(500, f"the vLLM server's answer is not a chat completion: {exc}") from exc
    finish_reason = choice.get("finish_reason")
    has_tool_use = bool(calls) or finish_reason == "tool_calls"
    reason, sequence = stop_reason(
        finish_reason, _stop_string(choice.get("stop_reason")), has_tool_use=has_tool_use
    )
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks + calls or [{"type": "text", "text": ""}],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    tool_input = json.loads(arguments or "{}")
    if not isinstance(tool_input, dict):
        raise ValueError(f"tool call {call_id!r}: its arguments are not a JSON object")
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input}


def _usage(usage: dict[str, Any]) -> dict[str, int]:
    details = usage.get("prompt_tokens_details") or {}
    num_cached = details.get("cached_tokens") or 0
    return {
        "input_tokens": usage["prompt_tokens"] - num_cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": num_cached,
        "output_tokens": usage["completion_tokens"],
    }


def _stop_string(vllm_stop_reason: Any) -> str | None:
    """vLLM's ``stop_reason``: the stop string met (a str), a stop token's id, or None."""
    return vllm_stop_reason if isinstance(vllm_stop_reason, str) else None


class ForwardedMessageStream:
    """A forwarded chat stream's SSE pieces (``data: {chunk}`` events, ``[DONE]``, or an
    ``{"error": ...}`` event) as an Anthropic message's events."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._blocks = ContentBlockEvents()
        self._calls = StreamedToolCalls()  # gathered, not sent yet
        self._num_prompt_tokens = 0
        self._num_output_tokens = 0
        self._finish_reason: str | None = None
        self._stop_string: str | None = None
        self._usage: dict[str, int] | None = None
        self._is_started = False
        self._is_done = False

    async def events(self, pieces: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        async for piece in pieces:
            for data in sse_data(piece):
                if not self._is_done:
                    for event in self._on_data(data):
                        yield event
        if not self._is_done:
            yield sse_event(error_body(500, "the vLLM server's stream ended without a finish"))

    def _on_data(self, data: str) -> list[str]:
        if data == "[DONE]":
            self._is_done = True
            return self._finish()
        chunk = json.loads(data)  # ForwardedCall relays only JSON it parsed
        if "error" in chunk:  # the forwarding code's, or vLLM's, error event
            self._is_done = True
            return [sse_event(_error_event(chunk["error"]))]
        events = []
        if not self._is_started:
            self._is_started = True
            self._num_prompt_tokens = len(chunk.get("prompt_token_ids") or ())
            events.append(message_start_event(self._message()))
        if chunk.get("usage"):
            self._usage = _usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            events += self._on_choice(choice)
        return events

    def _on_choice(self, choice: dict[str, Any]) -> list[str]:
        events = []
        self._num_output_tokens += len(choice.get("token_ids") or ())
        delta = choice.get("delta") or {}
        for call in delta.get("tool_calls") or ():
            if self._calls.is_new(call):
                events += self._send_calls()  # a new call: the one before is whole
            self._calls.add(call)
        if delta.get("content"):
            events += self._send_calls() + self._blocks.text(delta["content"])
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
            self._stop_string = _stop_string(choice.get("stop_reason"))
        return events

    def _send_calls(self) -> list[str]:
        events = []
        for call in self._calls.take():
            events += self._blocks.start_tool_use(call["id"] or "", call["name"])
            events += [*self._blocks.input_json(call["arguments"] or "{}"), *self._blocks.stop()]
        return events

    def _finish(self) -> list[str]:
        if not self._is_started:  # cannot happen: vLLM's first chunk comes before [DONE]
            return [sse_event(error_body(500, "the vLLM server's stream had no chunk"))]
        events = self._send_calls() + self._blocks.close()
        has_tool_use = self._blocks.has_tool_use or self._finish_reason == "tool_calls"
        reason, sequence = stop_reason(
            self._finish_reason, self._stop_string, has_tool_use=has_tool_use
        )
        usage = self._usage or self._message()["usage"]
        return events + message_end_events(reason, sequence, usage)

    def _message(self) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self._num_prompt_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": self._num_output_tokens,
            },
        }


def _error_event(error: Any) -> dict[str, Any]:
    """An OpenAI-shaped error event (ours: ``type`` by status; vLLM's: ``code`` the status)
    in Anthropic's shape."""
    if not isinstance(error, dict):
        return error_body(500, str(error))
    status = error.get("code")
    if not isinstance(status, int):
        status = _OPENAI_TYPE_TO_STATUS.get(str(error.get("type")), 500)
    return error_body(status, str(error.get("message") or error))

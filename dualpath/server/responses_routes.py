"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
behind the API key like every /v1 route.

A request's prompt is its chat-template messages (``openai_responses.py``): ``instructions``
as the system message, then the stored conversation of ``previous_response_id`` (if any),
then the request's input items, rendered with its function ``tools``. The generation is a
``Generation`` of one choice under the request's scope (``server.scope``: its ``cache_salt``,
and its session: ``session_id``, a session header, else ``prompt_cache_key``), so a
conversation's turn 2 finds the KV of turn 1's prompt and answer in the store. The output
becomes items (``responses_output.py``); with ``store`` (the default) the response and its
whole conversation are kept (``response_store.py``) before the client gets the end of it.

In forwarding mode (vLLM servers as engines) the request goes to them as the equivalent
chat request (``responses_forwarding.py``).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from dualpath.server.chat import ChatTemplateError
from dualpath.server.context import ServingContext
from dualpath.server.errors import APIError, bad_request
from dualpath.server.generation import Generation
from dualpath.server.openai_responses import (
    ResponsesRequest,
    conversation_of,
    output_conversation,
)
from dualpath.server.protocol import first_set
from dualpath.server.response_store import ResponseStore, StoredResponse
from dualpath.server.responses_forwarding import forward_response
from dualpath.server.responses_output import (
    EventStream,
    ResponseOutput,
    failed_body,
    finished_body,
    new_item_id,
    response_usage,
)
from dualpath.server.routes import (
    GenerationStreamResponse,
    api_key_check,
    check_model,
    encode_text,
    run_to_end,
    serving_check,
)
from dualpath.server.scope import SESSION_HEADERS, request_scope
from dualpath.server.tool_calls import ParsedToolCall, ToolCallParser
from dualpath.types import (
    CACHE_SALT_FORBIDDEN_CHARS,
    MAX_CACHE_SALT_CHARS,
    RequestScope,
    SamplingParams,
)
from dualpath.vllm.router.vllm_servers import VLLMServers

logger = logging.getLogger(__name__)


def _hex_escaped(chars: str) -> str:
    """``chars`` as regex escapes both Python's and ECMAScript's (OpenAPI's) engines read."""
    return "".join(f"\\x{ord(char):02x}" for char in chars)


# A stored response's tenant, for GET and DELETE (which have no body): the query's cache_salt.
CacheSaltQuery = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        pattern=f"^[^{_hex_escaped(CACHE_SALT_FORBIDDEN_CHARS)}]+$",  # check_cache_salt's rule
    ),
]


def build_responses_router(context: ServingContext, servers: VLLMServers) -> APIRouter:
    config = context.config
    store = ResponseStore.open(
        config.responses_dir,
        max_count=config.responses_max_count,
        max_bytes=config.responses_max_bytes,
    )
    router = APIRouter(dependencies=[Depends(api_key_check(config.api_key))])
    serving = [Depends(serving_check(context))]

    @router.post("/v1/responses", dependencies=serving)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        body.check_supported()
        is_forwarding = context.is_forwarding
        if not is_forwarding:  # forwarded, the model is named as the vLLM servers serve it
            check_model(context, body.model)
        scope = _scope(request, body)
        conversation = await _previous_conversation(store, body, scope)
        conversation += conversation_of(body.input_items())
        turn = Turn(store, body, scope, conversation)
        if is_forwarding:
            return await forward_response(context, servers, request, turn)
        return await _generate(context, request, turn)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, cache_salt: CacheSaltQuery = None) -> Any:
        stored = await asyncio.to_thread(_store_call(store.get), response_id, cache_salt)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return stored.body

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, cache_salt: CacheSaltQuery = None) -> Any:
        if not await asyncio.to_thread(_store_call(store.delete), response_id, cache_salt):
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return router


class Turn:
    """One request's conversation and what its response repeats of it (``head``)."""

    def __init__(
        self,
        store: ResponseStore,
        body: ResponsesRequest,
        scope: RequestScope,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.store = store
        self.body = body
        self.scope = scope
        self.conversation = conversation  # without the instructions (not carried over)
        self.id = new_item_id("resp")
        self.created_at = int(time.time())

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The prompt's messages: the instructions, then the conversation."""
        instructions = self.body.instructions
        system = [] if instructions is None else [{"role": "system", "content": instructions}]
        return system + self.conversation

    def head(self, params: SamplingParams | None) -> dict[str, Any]:
        """The response ``in_progress``: OpenAI's fields, the request's echoed. ``params``:
        the sampling used (None: the request's values, forwarded)."""
        body = self.body
        text: dict[str, Any] = {"format": {"type": "text"}}
        if body.text is not None and body.text.verbosity is not None:
            text["verbosity"] = body.text.verbosity
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": body.model,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "store": body.store,
            "temperature": params.temperature if params is not None else body.temperature,
            "text": text,
            "tool_choice": body.tool_choice or "auto",
            "tools": [tool.to_body() for tool in body.tools or ()],
            "top_p": params.top_p if params is not None else body.top_p,
            "truncation": body.truncation or "disabled",
            "usage": None,
            "user": body.user,
        }

    async def keep(self, response: dict[str, Any], output: ResponseOutput) -> None:
        """Store the finished ``response`` and its conversation, if the request asks to."""
        if not self.body.store:
            return
        conversation = self.conversation + output_conversation(output.items)
        stored = StoredResponse(self.id, self.scope.cache_salt, response, conversation)
        await asyncio.to_thread(_store_call(self.store.put), stored)


def feed(
    output: ResponseOutput, parser: ToolCallParser | None, text: str, *, is_last: bool
) -> list[dict[str, Any]]:
    """The events of the next piece of a generation's text (``is_last``: its end follows)."""
    pieces: list[str | ParsedToolCall] = [text] if parser is None else parser.push(text)
    if parser is not None and is_last:
        pieces += parser.finish()
    events = []
    for piece in pieces:
        if isinstance(piece, str):
            events += output.add_text(piece)
        else:
            events += output.add_call(piece.name, piece.arguments)
    return events


# --- generating here ----------------------------------------------------------------------------


async def _generate(context: ServingContext, request: Request, turn: Turn) -> Response:
    body = turn.body
    prompt = _render(context, turn.messages, body.template_tools())
    params = _sampling_params(context, body, prompt)
    context.check_serving()  # again: engines may have been lost while the prompt was read
    generation = Generation(
        context,
        [prompt],
        [[params]],
        arrival_s=request.state.arrival_s,
        request_id=request.state.request_id,
        scope=turn.scope,
    )
    await generation.start()
    head = turn.head(params)
    if body.stream:
        return GenerationStreamResponse(_stream(generation, turn, head), generation)
    if not await run_to_end(request, generation):  # the client went away; nobody reads this
        return Response(status_code=499)
    choice = generation.choices[0]
    output = ResponseOutput()
    parser = ToolCallParser() if body.parses_tool_calls else None
    feed(output, parser, choice.text, is_last=True)
    is_incomplete = choice.finish_reason == "length"
    output.finish(is_incomplete=is_incomplete)
    response = finished_body(head, output, _usage(generation), is_incomplete=is_incomplete)
    await turn.keep(response, output)
    return JSONResponse(response)


async def _stream(generation: Generation, turn: Turn, head: dict[str, Any]) -> AsyncIterator[str]:
    events = EventStream()
    output = ResponseOutput()
    parser = ToolCallParser() if turn.body.parses_tool_calls else None
    yield events.lifecycle("response.created", head)
    yield events.lifecycle("response.in_progress", head)
    try:
        async for delta in generation.deltas():
            for event in feed(output, parser, delta.text, is_last=delta.finish_reason is not None):
                yield events.sse(event)
        is_incomplete = generation.choices[0].finish_reason == "length"
        for event in output.finish(is_incomplete=is_incomplete):
            yield events.sse(event)
        response = finished_body(head, output, _usage(generation), is_incomplete=is_incomplete)
        await turn.keep(response, output)
    except APIError as exc:
        yield events.lifecycle("response.failed", failed_body(head, output, exc.message))
        return
    yield events.lifecycle("response.completed", response)


def _usage(generation: Generation) -> dict[str, Any]:
    usage = generation.usage()
    return response_usage(
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["completion_tokens"],
    )


def _render(
    context: ServingContext, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    try:
        text = context.chat.render(messages, tools=tools, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "input") from exc
    return encode_text(context, text, "input")


def _sampling_params(
    context: ServingContext, body: ResponsesRequest, prompt: list[int]
) -> SamplingParams:
    """The engine's parameters: the request's, else the checkpoint's, else OpenAI's; at most
    ``max_output_tokens``, else (as on /v1/chat/completions) the context left, within the
    checkpoint's ``max_new_tokens``."""
    if not prompt:
        raise bad_request("the prompt is empty: at least one token is needed", "input")
    if len(prompt) > context.max_prompt_tokens:
        raise bad_request(
            f"the prompt has {len(prompt)} tokens; the limit is {context.max_prompt_tokens}",
            "input",
        )
    max_model_len = context.model.max_model_len
    defaults = context.sampling_defaults
    max_tokens = body.max_output_tokens
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt)
        if defaults.max_tokens is not None:
            max_tokens = min(max_tokens, defaults.max_tokens)
    if len(prompt) + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the input, "
            f"{max_tokens} in the output).",
            "max_output_tokens",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=first_set(body.temperature, defaults.temperature, "temperature"),
        top_p=first_set(body.top_p, defaults.top_p, "top_p"),
        top_k=max(first_set(None, defaults.top_k, "top_k"), 0),
    )


# --- scope and the store ------------------------------------------------------------------------


def _scope(request: Request, body: ResponsesRequest) -> RequestScope:
    """The request's scope; ``prompt_cache_key`` names its session when neither the body's
    ``session_id`` nor a session header does."""
    session_id = body.session_id
    if session_id is None and not any(name in request.headers for name in SESSION_HEADERS):
        session_id = body.prompt_cache_key
    return request_scope(request, cache_salt=body.cache_salt, session_id=session_id)


async def _previous_conversation(
    store: ResponseStore, body: ResponsesRequest, scope: RequestScope
) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` continues (none without it); 404 if it is
    not stored under the request's salt."""
    previous_id = body.previous_response_id
    if previous_id is None:
        return []
    stored = await asyncio.to_thread(_store_call(store.get), previous_id, scope.cache_salt)
    if stored is None:
        raise _not_found(previous_id, "previous_response_id")
    return stored.conversation


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        404,
        f"no response with id {response_id!r} is stored here (never stored, store=false, "
        "deleted, evicted, or stored under another cache_salt)",
        param=param,
        code="response_not_found",
    )


def _store_call(method: Any) -> Any:
    """``method`` of the store with its I/O errors as a 500 (the server's log says more)."""

    def call(*args: Any) -> Any:
        try:
            return method(*args)
        except sqlite3.Error as exc:
            logger.error("response store: %s", exc)
            raise APIError(500, f"the response store failed: {exc}") from exc

    return call

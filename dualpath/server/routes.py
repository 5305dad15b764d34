"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, and vLLM's
/tokenize and /detokenize. All of them sit behind the API key when one is set."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dualpath.server.chat import ChatTemplateError
from dualpath.server.context import ServingContext
from dualpath.server.errors import APIError, bad_request, error_body
from dualpath.server.generation import Generation
from dualpath.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    sampling_params,
)
from dualpath.server.responses import (
    ResponseMeta,
    chat_body,
    chat_chunks,
    chat_role_chunk,
    completion_body,
    completion_chunk,
    sse,
    usage_chunk,
)
from dualpath.server.scope import request_scope
from dualpath.server.tool_calls import ToolCallParser

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_SEED_MODULUS = 1 << 63


def serving_check(context: ServingContext) -> Callable[[], None]:
    """A generation route's dependency, run before its body is read: while engines join (or
    none of a role is alive), any request is a 503 to retry, whatever its body."""

    async def check_serving() -> None:  # async: a sync one would hop to a worker thread
        context.check_serving()

    return check_serving


def build_router(context: ServingContext) -> APIRouter:
    router = APIRouter(dependencies=[Depends(api_key_check(context.config.api_key))])

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        model = context.model
        return {
            "object": "list",
            "data": [
                {
                    "id": model.name,
                    "object": "model",
                    "created": context.created_unix_s,
                    "owned_by": "dualpath",
                    "max_model_len": model.max_model_len,
                }
            ],
        }

    serving = [Depends(serving_check(context))]

    @router.post("/v1/completions", dependencies=serving)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        check_model(context, body.model)
        prompts = [_completion_prompt(context, p) for p in _prompt_list(body.prompt)]
        return await _generate(context, request, body, prompts, is_chat=False)

    @router.post("/v1/chat/completions", dependencies=serving)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(context, body.model)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()] or None
        prompt = _chat_prompt(context, body.messages, tools, body.add_generation_prompt)
        return await _generate(context, request, body, [prompt], is_chat=True)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(context, body.model)
        body.check_supported()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            token_ids = encode_text(context, body.prompt, "prompt")
        else:
            token_ids = _chat_prompt(context, body.messages, None, body.add_generation_prompt)
        return {
            "count": len(token_ids),
            "max_model_len": context.model.max_model_len,
            "tokens": token_ids,
        }

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            check_model(context, body.model)
        _check_token_ids(context, body.tokens, "tokens")
        return {"prompt": context.tokenizer.decode(body.tokens)}

    return router


# --- prompts ------------------------------------------------------------------------------------


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # one prompt of token ids
    return list(prompt)  # a batch of strings or of token-id lists


def _completion_prompt(context: ServingContext, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return encode_text(context, prompt, "prompt")
    _check_token_ids(context, prompt, "prompt")
    return list(prompt)


def _chat_prompt(
    context: ServingContext,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> list[int]:
    try:
        text = context.chat.render(
            [m.to_template() for m in messages],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
        )
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc
    return encode_text(context, text, "messages")


def encode_text(context: ServingContext, text: str, param: str) -> list[int]:
    try:
        return context.tokenizer.encode(text)
    except ValueError as exc:  # not valid Unicode: a lone surrogate
        raise bad_request(f"{param}: {exc}", param) from exc


def _check_token_ids(context: ServingContext, token_ids: list[int], param: str) -> None:
    vocab_size = context.model.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param)


def check_model(context: ServingContext, model: str) -> None:
    if model != context.model.name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{context.model.name}`.",
            param="model",
            code="model_not_found",
        )


# --- generation ---------------------------------------------------------------------------------


async def _generate(
    context: ServingContext,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    *,
    is_chat: bool,
) -> Response:
    body.check_supported()
    params = _params_per_choice(context, body, prompts, is_chat=is_chat)
    context.check_serving()  # again: engines may have been lost while the prompt was read
    request_id = request.state.request_id
    scope = request_scope(request, cache_salt=body.cache_salt, session_id=body.session_id)
    generation = Generation(
        context,
        prompts,
        params,
        arrival_s=request.state.arrival_s,
        request_id=request_id,
        scope=scope,
    )
    await generation.start()
    meta = ResponseMeta(
        id=f"{'chatcmpl' if is_chat else 'cmpl'}-{request_id}",
        created_unix_s=int(time.time()),
        model=context.model.name,
        return_token_ids=body.return_token_ids,
    )
    if body.stream:
        stream = _sse_stream(context, generation, meta, body, is_chat=is_chat)
        return GenerationStreamResponse(stream, generation)
    if not await run_to_end(request, generation):  # the client went away; nobody reads this
        return Response(status_code=499)
    if is_chat:
        response_body = chat_body(
            meta, generation, context.tokenizer, parses_tool_calls=body.parses_tool_calls
        )
    else:
        response_body = completion_body(meta, generation, context.tokenizer)
    return JSONResponse(response_body)


def _params_per_choice(
    context: ServingContext,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    *,
    is_chat: bool,
) -> list[list]:
    limit = context.config.max_num_generations_per_request
    if body.n * len(prompts) > limit:
        raise bad_request(
            f"n ({body.n}) x prompts ({len(prompts)}) exceeds {limit} generations per request",
            "n",
        )
    for token_id in body.stop_token_ids or ():
        _check_token_ids(context, [token_id], "stop_token_ids")
    requested = body.max_completion_tokens if is_chat else None
    requested = requested or body.max_tokens
    max_model_len = context.model.max_model_len
    params = []
    for prompt in prompts:
        if not prompt:
            raise bad_request("prompt is empty: at least one token is needed", "prompt")
        if len(prompt) > context.max_prompt_tokens:
            raise bad_request(
                f"the prompt has {len(prompt)} tokens; the limit is {context.max_prompt_tokens}",
                "messages" if is_chat else "prompt",
            )
        if requested is not None:
            max_tokens = requested
        elif is_chat:  # as in vLLM: the checkpoint's max_new_tokens, within the context
            max_tokens = max_model_len - len(prompt)
            if context.sampling_defaults.max_tokens is not None:
                max_tokens = min(max_tokens, context.sampling_defaults.max_tokens)
        else:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        if len(prompt) + max_tokens > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                f"{max_tokens} in the completion).",
                "max_tokens",
            )
        params.append(
            [
                sampling_params(
                    body,
                    max_tokens=max_tokens,
                    seed=_choice_seed(body.seed, j),
                    defaults=context.sampling_defaults,
                )
                for j in range(body.n)
            ]
        )
    return params


def _choice_seed(seed: int | None, choice_index: int) -> int | None:
    """Choice j of a seeded request samples with seed + j: reproducible and distinct."""
    return None if seed is None else (seed + choice_index) % _SEED_MODULUS


async def run_to_end(request: Request, generation: Generation) -> bool:
    """A non-streamed generation run to its end, then closed: True, or False if the client
    disconnected first (the generation is cancelled then). Its errors propagate."""
    try:
        return await _until_disconnected(request, _drain(generation))
    finally:
        generation.close()


async def _drain(generation: Generation) -> None:
    async for _ in generation.deltas():
        pass


async def _sse_stream(
    context: ServingContext,
    generation: Generation,
    meta: ResponseMeta,
    body: CompletionRequest | ChatCompletionRequest,
    *,
    is_chat: bool,
) -> AsyncIterator[str]:
    want_logprobs = body.num_top_logprobs is not None
    decoder = context.tokenizer
    # Each choice's own parser: its calls are told from its text as the text arrives.
    parsers = [
        ToolCallParser() if is_chat and body.parses_tool_calls else None for _ in generation.choices
    ]
    try:
        if is_chat:
            for choice in generation.choices:
                yield sse(chat_role_chunk(meta, choice.index))
        async for delta in generation.deltas():
            if is_chat:
                chunks = chat_chunks(
                    meta,
                    delta,
                    parsers[delta.index],
                    want_logprobs=want_logprobs,
                    decoder=decoder,
                )
                for chunk in chunks:
                    yield sse(chunk)
            elif delta.text or delta.finish_reason or meta.return_token_ids or want_logprobs:
                yield sse(
                    completion_chunk(meta, delta, want_logprobs=want_logprobs, decoder=decoder)
                )
        if body.include_usage:
            object_name = "chat.completion.chunk" if is_chat else "text_completion"
            yield sse(usage_chunk(meta, object_name, generation))
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, param=exc.param, code=exc.code))
    yield sse("[DONE]")


class GenerationStreamResponse(StreamingResponse):
    """An SSE response that cancels its generation however it ends: finished, failed, or
    cut short by a client that disconnected (before or during the stream)."""

    def __init__(self, content: AsyncIterator[str], generation: Generation) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.close()


async def _until_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Run ``work``: True once it finishes (its exception propagates), False if the client
    disconnected first; ``work`` is cancelled then. Both tasks end before this returns."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
        watch_task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if work_task in done:
        work_task.result()  # raises what the work raised
        return True
    return False


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def api_key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The dependency every API route sits behind: 401 unless ``api_key`` is None or sent."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")

    return check

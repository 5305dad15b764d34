"""Forwarding to vLLM server engines: the generation routes of a cluster whose decode engines
are vLLM OpenAI API servers that users started with our KV connector.

Such a request is not generated here. Its prompt is tokenized by a vLLM server (a chat's
rendered here once that agrees with a server: ``local_prompts.py``), our scheduler
places it (``Forward``: a PE and a DE with their URLs), the client's JSON body goes to the DE's
server as it came (plus the placement's ``kv_transfer_params``), and that server's answer goes
back to the client unchanged:

    client ──body──▶ front door ──/tokenize──▶ any live vLLM server (a chat: rendered here)
                        │ submit(prompt ids) ──▶ scheduler ──Forward(PE, DE, URLs)──┐
                        ├─ body + kv_transfer_params ──▶ DE /v1/...   (first) ◀────┘
                        └─ prompt ids, max_tokens 1 ──▶ PE /v1/completions (then; a server)
    client ◀── the DE's answer, its SSE events relayed as they come ──┘

The raw body is forwarded, not our pydantic models: vLLM accepts fields we do not (``tools``,
``chat_template_kwargs``, its ``logprobs`` forms), and vLLM, not we, says what is wrong with a
body. The routes here match only in forwarding mode (``ServingContext.is_forwarding``); a
placement lost on the way is placed again (``forwarded_call.py``), the HTTP client is
``vllm_servers.py``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.routing import Match

from dualpath.server.context import ServingContext
from dualpath.server.errors import bad_request
from dualpath.server.routes import DEFAULT_COMPLETION_MAX_TOKENS, api_key_check, serving_check
from dualpath.server.scope import request_scope
from dualpath.types import SamplingParams
from dualpath.vllm.router.forwarded_call import ForwardedCall
from dualpath.vllm.router.vllm_servers import UpstreamAnswer, VLLMServers, is_token_ids


def build_forwarding_router(context: ServingContext, servers: VLLMServers) -> APIRouter:
    """/v1/completions and /v1/chat/completions in forwarding mode. Include it before
    ``routes.build_router``: its routes match only while ``context.is_forwarding``, and a
    request they do not match reaches the routes that generate here."""
    router = APIRouter(
        dependencies=[Depends(api_key_check(context.config.api_key))],
        route_class=_route_class_while_forwarding(context),
    )

    serving = [Depends(serving_check(context))]

    @router.post("/v1/completions", include_in_schema=False, dependencies=serving)
    async def forward_completion(request: Request) -> Response:
        return await _forward(context, servers, request, is_chat=False)

    @router.post("/v1/chat/completions", include_in_schema=False, dependencies=serving)
    async def forward_chat_completion(request: Request) -> Response:
        return await _forward(context, servers, request, is_chat=True)

    return router


def _route_class_while_forwarding(context: ServingContext) -> type[APIRoute]:
    class RouteWhileForwarding(APIRoute):
        """A route that matches only in forwarding mode."""

        def matches(self, scope: Any) -> tuple[Match, dict[str, Any]]:
            if not context.is_forwarding:
                return Match.NONE, {}
            return super().matches(scope)

    return RouteWhileForwarding


async def _forward(
    context: ServingContext, servers: VLLMServers, request: Request, *, is_chat: bool
) -> Response:
    return await forward_json(
        context, servers, request, await _json_object(request), is_chat=is_chat
    )


async def forward_json(
    context: ServingContext,
    servers: VLLMServers,
    request: Request,
    body: dict[str, Any],
    *,
    is_chat: bool,
) -> Response:
    """Forward ``body`` (a completion or chat request, as a client would send it) for
    ``request``: the DE's answer or refusal as is, our JSON error, or the SSE stream
    (``ForwardedCall.respond``). /v1/responses forwards the chat body it translates to."""
    check_forwardable(body, is_chat=is_chat)
    # The scheduler looks the prompt up in the store under the body's cache_salt; the body
    # takes it to the vLLM servers as it came, for their prefix caches and our connectors.
    scope = request_scope(
        request, cache_salt=body.get("cache_salt"), session_id=body.get("session_id")
    )
    try:
        prompt = await servers.prompt_token_ids(body, is_chat=is_chat)
    except UpstreamAnswer as answer:
        return answer.response()
    context.metrics.forwarded_prompts.labels(prompt.rendered_by).inc()
    params = scheduler_params(
        body, len(prompt.token_ids), context.model.max_model_len, is_chat=is_chat
    )
    call = ForwardedCall(
        context, servers, request, body, prompt, params, is_chat=is_chat, scope=scope
    )
    return await call.respond()


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "body") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", "body")
    return body


def check_forwardable(body: dict[str, Any], *, is_chat: bool) -> None:
    """400 for what cannot go to one DE as one request (the scheduler places one sequence):
    several choices, several prompts. Everything else is vLLM's to judge."""
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request(f"n={n!r}: this server forwards one choice per request (n=1)", "n")
    if is_chat:
        return
    prompt = body.get("prompt")
    if isinstance(prompt, str) or is_token_ids(prompt):
        return
    if not isinstance(prompt, list):
        raise bad_request("prompt must be a string or a list of token ids", "prompt")
    if len(prompt) != 1:
        raise bad_request(
            f"prompt is a list of {len(prompt)} prompts: this server forwards one prompt per "
            "request",
            "prompt",
        )
    if not (isinstance(prompt[0], str) or is_token_ids(prompt[0])):
        raise bad_request("prompt must be a string or a list of token ids", "prompt")


def scheduler_params(
    body: dict[str, Any], num_prompt_tokens: int, max_model_len: int, *, is_chat: bool
) -> SamplingParams:
    """What the scheduler is told of the request's sampling. ``max_tokens`` sizes its KV on
    the DE, so it is what vLLM will use: the body's (``max_completion_tokens`` first in a
    chat), else vLLM's default (16 for a completion, the context left for a chat). The rest
    only describes the request, since the DE samples: a value our ``SamplingParams`` would
    refuse is left out, for vLLM to judge."""
    if is_chat:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = max_tokens or max_model_len - num_prompt_tokens
    else:
        max_tokens = body.get("max_tokens") or DEFAULT_COMPLETION_MAX_TOKENS
    if type(max_tokens) is not int or max_tokens <= 0:
        raise bad_request(
            f"max_tokens must be a positive integer, got {max_tokens!r} (the prompt has "
            f"{num_prompt_tokens} tokens, the context {max_model_len})",
            "max_tokens",
        )
    fields: dict[str, Any] = {"max_tokens": max_tokens}
    temperature, seed = body.get("temperature"), body.get("seed")
    min_tokens = body.get("min_tokens")
    if type(temperature) in (int, float) and 0 <= temperature < float("inf"):
        fields["temperature"] = float(temperature)
    if type(seed) is int and 0 <= seed < 1 << 63:
        fields["seed"] = seed
    if type(min_tokens) is int and 0 <= min_tokens <= max_tokens:
        fields["min_tokens"] = min_tokens
    if body.get("ignore_eos") is True:
        fields["ignore_eos"] = True
    return SamplingParams(**fields)

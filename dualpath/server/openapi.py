"""The OpenAPI schema at ``GET /openapi.json``, made to state what the server checks.

    install_openapi(app, served_model_names=["tiny"], max_model_len=2048, ...)

FastAPI derives the schema from the routes and the pydantic request models (their
``Field(ge=..., le=...)`` bounds included). That schema misses what only the running server
knows and what the error handlers change, so it is post-processed once, then cached:

- ``model`` is an enum of the served model names (any other name is a 404);
- bounds that depend on the served model are added by property name, wherever the property
  appears (``max_tokens`` below the context length, token ids inside the vocabulary, ...);
- FastAPI's 422 is replaced by the 400 the error handlers answer, and every other status a
  route can answer is listed, each error with the ``ErrorResponse`` body (OpenAI's shape;
  Anthropic's, ``AnthropicErrorResponse``, on the Messages API's paths).

A schema that says exactly what is accepted is what lets a schema-driven fuzzer
(tests/server/test_fuzz.py) tell a server bug from a request the server was right to refuse.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

Schema = dict[str, Any]

_COMPONENTS_REF = "#/components/schemas/"
_ERROR_RESPONSE = "ErrorResponse"
_ANTHROPIC_ERROR_RESPONSE = "AnthropicErrorResponse"
ANTHROPIC_PATH_PREFIX = "/v1/messages"  # anthropic_routes.py: errors in Anthropic's shape
_SECURITY_SCHEME = "bearer"
# The operational routes (app.py): no API key, no error body of ours.
_OPEN_PATHS = ("/health", "/metrics", "/version")

_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
ERROR_RESPONSE_SCHEMA: Schema = {
    "title": _ERROR_RESPONSE,
    "description": "OpenAI's error shape: the body of every error the API answers.",
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STRING,
                "code": _NULLABLE_STRING,
            },
            "required": ["message", "type", "param", "code"],
            "additionalProperties": False,
        }
    },
    "required": ["error"],
    "additionalProperties": False,
}

ANTHROPIC_ERROR_RESPONSE_SCHEMA: Schema = {
    "title": _ANTHROPIC_ERROR_RESPONSE,
    "description": "Anthropic's error shape: the body of every error the Messages API answers.",
    "type": "object",
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            "required": ["type", "message"],
            "additionalProperties": False,
        },
    },
    "required": ["type", "error"],
    "additionalProperties": False,
}

_SSE_EVENT_SCHEMA: Schema = {
    "title": "ServerSentEvent",
    "description": "One event of a stream: its data is a JSON chunk (or an ErrorResponse "
    "body when the generation fails mid-stream), and the last event's is [DONE]; on "
    "/v1/responses, a JSON event with its type and sequence_number, the last "
    "response.completed (or response.failed); on /v1/messages, Anthropic's events, each "
    "named by an event line, the last message_stop (or error).",
    "type": "object",
    "properties": {"data": {"type": "string"}},
    "required": ["data"],
}

# Status -> why a route answers it. Which routes answer which: ``_error_statuses``.
_ERROR_DESCRIPTIONS = {
    "400": "Invalid request: a field out of its bounds, an unknown field, or an unsupported "
    "combination (``param`` names the field)",
    "401": "Missing or wrong API key",
    "404": "The model is not served here, or the stored response named does not exist",
    "413": "The request body exceeds the server's limit",
    "429": "The waiting queue is full: retry later",
    "500": "An engine request failed",
    "503": "The server is starting, shutting down, or has no live engine",
}

# What the operational routes answer that FastAPI cannot see from their signatures.
_OPERATIONAL_RESPONSES: dict[str, dict[str, Schema]] = {
    "/health": {
        "503": {
            "description": "Not ready: engines are joining, or none is alive (``reason`` says)",
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    },
    "/metrics": {
        "200": {
            "description": "Prometheus' text exposition format",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
}


def install_openapi(
    app: FastAPI,
    *,
    served_model_names: list[str],
    max_model_len: int,
    max_prompt_tokens: int,
    vocab_size: int,
    max_num_generations_per_request: int,
    is_api_key_required: bool,
) -> None:
    """Make ``app.openapi()`` return the post-processed schema (built on first use, then
    cached in ``app.openapi_schema`` as FastAPI does). Call it once the app is built; routes
    added later still appear, since nothing is built before the first request for it."""
    bounds = _PropertyBounds(
        served_model_names=list(served_model_names),
        max_model_len=max_model_len,
        max_prompt_tokens=max_prompt_tokens,
        vocab_size=vocab_size,
        max_num_generations_per_request=max_num_generations_per_request,
    )

    def openapi() -> Schema:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                openapi_version=app.openapi_version,
                description=app.description,
                routes=app.routes,
            )
            app.openapi_schema = _post_process(schema, bounds, is_api_key_required)
        return app.openapi_schema

    app.openapi = openapi  # FastAPI's documented way to extend its schema


def _post_process(schema: Schema, bounds: _PropertyBounds, is_api_key_required: bool) -> Schema:
    components = schema.setdefault("components", {})
    component_schemas = components.setdefault("schemas", {})
    for component in component_schemas.values():
        for name, property_schema in component.get("properties", {}).items():
            bounds.apply(name, property_schema)
    # Only FastAPI's 422 referred to these; no route answers 422.
    component_schemas.pop("HTTPValidationError", None)
    component_schemas.pop("ValidationError", None)
    component_schemas[_ERROR_RESPONSE] = copy.deepcopy(ERROR_RESPONSE_SCHEMA)
    component_schemas[_ANTHROPIC_ERROR_RESPONSE] = copy.deepcopy(ANTHROPIC_ERROR_RESPONSE_SCHEMA)
    if is_api_key_required:
        components["securitySchemes"] = {_SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
    for path, method_to_operation in schema.get("paths", {}).items():
        for operation in method_to_operation.values():
            body = _request_body_schema(operation, component_schemas)
            is_keyed = is_api_key_required and path not in _OPEN_PATHS
            parameters = operation.get("parameters", [])
            _document_responses(operation, path, body, parameters, is_keyed=is_keyed)
            if is_keyed:
                operation["security"] = [{_SECURITY_SCHEME: []}]
    return schema


# --- responses ------------------------------------------------------------------------------------


def _error_statuses(body: Schema | None, parameters: list[Schema], *, is_keyed: bool) -> list[str]:
    """The error statuses an operation can answer, from its request body's schema and its
    parameters."""
    statuses = []
    if body is not None or any(p.get("in") == "query" for p in parameters):
        statuses.append("400")  # validation (errors.py) and the routes' own checks
    if is_keyed:
        statuses.append("401")
    properties = (body or {}).get("properties", {})
    # A model not served, or (a path parameter) the stored object it names not found.
    if "model" in properties or any(p.get("in") == "path" for p in parameters):
        statuses.append("404")
    if body is not None:
        statuses.append("413")  # BodySizeLimitMiddleware, before any parsing
    # A body with `stream` asks for a generation (routes._generate): it may be refused
    # (429, 503) or fail in an engine (500).
    if "stream" in properties:
        statuses += ["429", "500", "503"]
    return statuses


def _document_responses(
    operation: Schema, path: str, body: Schema | None, parameters: list[Schema], *, is_keyed: bool
) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    is_anthropic = path.startswith(ANTHROPIC_PATH_PREFIX)
    error_ref = _COMPONENTS_REF + (_ANTHROPIC_ERROR_RESPONSE if is_anthropic else _ERROR_RESPONSE)
    for status in _error_statuses(body, parameters, is_keyed=is_keyed):
        responses[status] = {
            "description": _ERROR_DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": error_ref}}},
        }
    for status, response in _OPERATIONAL_RESPONSES.get(path, {}).items():
        responses[status] = copy.deepcopy(response)
    if body is not None and "stream" in body.get("properties", {}):
        ok_content = responses.setdefault("200", {}).setdefault("content", {})
        # stream=true. Before OpenAPI 3.2 (``itemSchema``) a stream's ``schema`` describes
        # each event, as readers of 3.1 schemas (schemathesis among them) take it.
        ok_content["text/event-stream"] = {"schema": _SSE_EVENT_SCHEMA}


def _request_body_schema(operation: Schema, component_schemas: Schema) -> Schema | None:
    content = operation.get("requestBody", {}).get("content", {})
    schema = content.get("application/json", {}).get("schema")
    if schema is None:
        return None
    ref = schema.get("$ref", "")
    return component_schemas[ref.removeprefix(_COMPONENTS_REF)] if ref else schema


# --- bounds by property name --------------------------------------------------------------------


class _PropertyBounds:
    """The served model's limits, added to a request property's schema by its name.

    Only what the routes check is added, so a value outside a bound is always refused; one
    inside may still be refused by a check across fields (``len(prompt) + max_tokens`` must
    fit the context, ``min_tokens`` must not exceed ``max_tokens``).
    """

    def __init__(
        self,
        *,
        served_model_names: list[str],
        max_model_len: int,
        max_prompt_tokens: int,
        vocab_size: int,
        max_num_generations_per_request: int,
    ) -> None:
        # A prompt has at least one token, so at most max_model_len - 1 are left to generate.
        max_new_tokens = max_model_len - 1
        token_ids = {"minimum": 0, "maximum": vocab_size - 1}
        self._name_to_apply: dict[str, Callable[[Schema], None]] = {
            "model": lambda s: _set_on(s, "string", {"enum": served_model_names}),
            "max_tokens": lambda s: _tighten(s, "integer", maximum=max_new_tokens),
            "max_completion_tokens": lambda s: _tighten(s, "integer", maximum=max_new_tokens),
            "max_output_tokens": lambda s: _tighten(s, "integer", maximum=max_new_tokens),
            "min_tokens": lambda s: _tighten(s, "integer", maximum=max_new_tokens),
            # n choices x prompts generations per request.
            "n": lambda s: _tighten(s, "integer", maximum=max_num_generations_per_request),
            "prompt": lambda s: _bound_prompt(
                s, token_ids, max_prompt_tokens, max_num_generations_per_request
            ),
            "tokens": lambda s: _tighten_all(s, "integer", **token_ids),
            "stop_token_ids": lambda s: _tighten_all(s, "integer", **token_ids),
        }

    def apply(self, name: str, schema: Schema) -> None:
        """Bound ``schema`` (a property's, changed in place) if ``name`` is one we bound."""
        apply = self._name_to_apply.get(name)
        if apply is not None:
            apply(schema)


def _bound_prompt(
    schema: Schema, token_ids: dict[str, int], max_prompt_tokens: int, max_num_prompts: int
) -> None:
    """A prompt is text or token ids, or a batch of either (an array of strings or arrays);
    neither an array of token ids nor a batch may be empty."""
    _tighten_all(schema, "integer", **token_ids)
    for branch in _branches(schema):
        if branch.get("type") != "array":
            continue
        items = branch.get("items", {})
        if items.get("type") == "integer":
            _tighten(branch, "array", minItems=1, maxItems=max_prompt_tokens)
        else:  # a batch: one generation per prompt at least
            _tighten(branch, "array", minItems=1, maxItems=max_num_prompts)
            if items.get("type") == "array":
                _tighten(items, "array", minItems=1, maxItems=max_prompt_tokens)


def _branches(schema: Schema) -> Iterator[Schema]:
    """The alternatives of ``schema``: each ``anyOf`` branch (a nullable field's non-null
    branch among them), or ``schema`` itself."""
    yield from schema.get("anyOf", [schema])


def _set_on(schema: Schema, type_name: str, keywords: Schema) -> None:
    for branch in _branches(schema):
        if branch.get("type") == type_name:
            branch.update(keywords)


_LOWER_KEYWORDS = ("minimum", "minItems")


def _tighten(schema: Schema, type_name: str, **bounds: int) -> None:
    """Add each bound to the ``type_name`` branches, keeping a tighter one already there."""
    for branch in _branches(schema):
        if branch.get("type") != type_name:
            continue
        for keyword, value in bounds.items():
            if keyword not in branch:
                branch[keyword] = value
            elif keyword in _LOWER_KEYWORDS:
                branch[keyword] = max(branch[keyword], value)
            else:
                branch[keyword] = min(branch[keyword], value)


def _tighten_all(schema: Schema, type_name: str, **bounds: int) -> None:
    """``_tighten`` every ``type_name`` schema inside ``schema`` (array items included)."""
    _tighten(schema, type_name, **bounds)
    for branch in _branches(schema):
        items = branch.get("items")
        if isinstance(items, dict):
            _tighten_all(items, type_name, **bounds)

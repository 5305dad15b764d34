"""The OpenAPI schema states what the server checks: served model names, the model's limits,
and every status a route answers, errors in OpenAI's shape. Built from the real router, with
no engine started."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi import FastAPI
from pydantic import BaseModel, Field

from dualpath.server.anthropic_responses import error_body as anthropic_error_body
from dualpath.server.anthropic_routes import build_anthropic_router
from dualpath.server.config import ServerConfig
from dualpath.server.errors import error_body
from dualpath.server.openapi import install_openapi
from dualpath.server.routes import build_router

MODEL = "tiny"
MAX_MODEL_LEN = 256
MAX_PROMPT_TOKENS = 200
VOCAB_SIZE = 1000
MAX_GENERATIONS = 8
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def make_app(*, api_key: str | None = "key") -> FastAPI:
    # build_router reads only the config while it builds; the routes read the rest per request.
    context = SimpleNamespace(config=ServerConfig(served_model_name=MODEL, api_key=api_key))
    app = FastAPI()
    app.include_router(build_router(context))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    install(app, is_api_key_required=api_key is not None)
    return app


def install(app: FastAPI, *, is_api_key_required: bool = True) -> None:
    install_openapi(
        app,
        served_model_names=[MODEL],
        max_model_len=MAX_MODEL_LEN,
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        vocab_size=VOCAB_SIZE,
        max_num_generations_per_request=MAX_GENERATIONS,
        is_api_key_required=is_api_key_required,
    )


def request_schema(name: str) -> dict:
    return make_app().openapi()["components"]["schemas"][name]


def test_model_is_an_enum_of_the_served_names() -> None:
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        model = request_schema(name)["properties"]["model"]
        assert model["type"] == "string" and model["enum"] == [MODEL]
    for name in ("TokenizeRequest", "DetokenizeRequest"):  # optional: the non-null branch
        string, null = request_schema(name)["properties"]["model"]["anyOf"]
        assert string == {"type": "string", "enum": [MODEL]}
        assert null == {"type": "null"}


def test_each_route_documents_the_statuses_it_answers() -> None:
    generation = {"200", "400", "401", "404", "413", "429", "500", "503"}
    expected = {
        ("/v1/models", "get"): {"200", "401"},
        ("/v1/completions", "post"): generation,
        ("/v1/chat/completions", "post"): generation,
        ("/tokenize", "post"): {"200", "400", "401", "404", "413"},
        ("/detokenize", "post"): {"200", "400", "401", "404", "413"},
        ("/health", "get"): {"200", "503"},
    }
    paths = make_app().openapi()["paths"]
    documented = {
        (path, method): set(operation["responses"])
        for path, methods in paths.items()
        for method, operation in methods.items()
    }
    assert documented == expected


def test_errors_have_openai_shape_and_422_is_gone() -> None:
    schema = make_app().openapi()
    for path, methods in schema["paths"].items():
        for operation in methods.values():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")) and path != "/health":
                    assert response["content"] == {"application/json": {"schema": ERROR_REF}}
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components
    error = components["ErrorResponse"]["properties"]["error"]
    assert set(error["required"]) == set(error_body(400, "bad")["error"])
    assert error["properties"]["param"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert error["additionalProperties"] is False


def test_the_messages_api_documents_its_errors_in_anthropics_shape() -> None:
    context = SimpleNamespace(config=ServerConfig(served_model_name=MODEL, api_key="key"))
    app = FastAPI()
    app.include_router(build_anthropic_router(context, servers=None))  # read per request
    install(app)
    schema = app.openapi()
    documented = {
        path: set(methods["post"]["responses"]) for path, methods in schema["paths"].items()
    }
    assert documented == {
        "/v1/messages": {"200", "400", "401", "404", "413", "429", "500", "503"},
        "/v1/messages/count_tokens": {"200", "400", "401", "404", "413"},
    }
    anthropic_ref = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    for methods in schema["paths"].values():
        for status, response in methods["post"]["responses"].items():
            if status != "200":
                assert response["content"] == {"application/json": {"schema": anthropic_ref}}
    error = schema["components"]["schemas"]["AnthropicErrorResponse"]
    body = anthropic_error_body(400, "bad")
    assert set(error["required"]) == set(body)
    assert set(error["properties"]["error"]["required"]) == set(body["error"])
    max_tokens = schema["components"]["schemas"]["MessagesRequest"]["properties"]["max_tokens"]
    assert max_tokens["maximum"] == MAX_MODEL_LEN - 1


def test_streams_are_documented_on_generation_routes() -> None:
    paths = make_app().openapi()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}


def test_the_api_key_is_a_bearer_scheme_on_keyed_routes_only() -> None:
    schema = make_app().openapi()
    assert schema["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}
    }
    assert schema["paths"]["/tokenize"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


def test_without_an_api_key_nothing_answers_401() -> None:
    schema = make_app(api_key=None).openapi()
    assert "securitySchemes" not in schema["components"]
    for methods in schema["paths"].values():
        for operation in methods.values():
            assert "401" not in operation["responses"]
            assert "security" not in operation


def test_limits_of_the_served_model_bound_the_fields() -> None:
    completion = request_schema("CompletionRequest")["properties"]
    max_tokens, _ = completion["max_tokens"]["anyOf"]
    assert max_tokens["maximum"] == MAX_MODEL_LEN - 1  # a prompt has at least one token
    assert completion["min_tokens"]["maximum"] == MAX_MODEL_LEN - 1
    assert completion["n"]["maximum"] == MAX_GENERATIONS
    text, token_ids, texts, batch = completion["prompt"]["anyOf"]
    assert text == {"type": "string"}
    assert token_ids["items"] == {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}
    assert (token_ids["minItems"], token_ids["maxItems"]) == (1, MAX_PROMPT_TOKENS)
    assert (texts["minItems"], texts["maxItems"]) == (1, MAX_GENERATIONS)
    assert (batch["minItems"], batch["maxItems"]) == (1, MAX_GENERATIONS)
    assert batch["items"]["maxItems"] == MAX_PROMPT_TOKENS
    chat = request_schema("ChatCompletionRequest")["properties"]
    assert chat["max_completion_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN - 1
    tokens = request_schema("DetokenizeRequest")["properties"]["tokens"]
    assert tokens["items"] == {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}


class _Body(BaseModel):
    n: int = Field(default=1, ge=1, le=4)  # tighter than the server's limit: kept
    max_tokens: int = Field(default=1, ge=1)
    stop_token_ids: list[list[int]] = []


def test_bounds_follow_property_names_and_keep_tighter_ones() -> None:
    app = FastAPI()

    @app.post("/v1/new")
    async def new(body: _Body) -> None:
        return None

    install(app)
    properties = app.openapi()["components"]["schemas"]["_Body"]["properties"]
    assert properties["n"]["maximum"] == 4
    assert properties["max_tokens"]["maximum"] == MAX_MODEL_LEN - 1
    assert properties["stop_token_ids"]["items"]["items"]["maximum"] == VOCAB_SIZE - 1


def test_the_schema_is_built_once() -> None:
    app = make_app()
    assert app.openapi() is app.openapi()

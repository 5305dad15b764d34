"""Request bodies of the OpenAI-compatible API, and their mapping to ``SamplingParams``.

Top-level request fields are checked strictly: an unknown field is a 400 naming it, and a known
field we cannot honour (``echo``, penalties, ``logit_bias``, JSON ``response_format``, forced
``tool_choice``, ...) is a 400 that says so, rather than being silently ignored. Messages are
lenient about extra keys: agent frameworks send back the assistant message they were given,
with fields such as ``refusal`` or ``annotations`` set to null.

vLLM's extensions are accepted: ``ignore_eos``, ``min_tokens``, ``top_k``,
``stop_token_ids`` and ``return_token_ids``; ``repetition_penalty`` at its neutral 1 (what
vLLM's own benchmark client sends), and /tokenize's ``add_special_tokens`` as false (what the
server does to every prompt).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dualpath.model.generation_config import SamplingDefaults
from dualpath.server.errors import bad_request
from dualpath.types import MAX_TOKEN_ID, MAX_WIRE_INT, SamplingParams

MAX_NUM_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # SamplingParams.logprobs' bound


TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class _Strict(BaseModel):
    # Types as the schema states them: no "seed": true or "ignore_eos": 0.0 (an integer is still
    # a number). NaN and infinity are not numbers a request can mean (Python's JSON parser
    # takes them).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_WIRE_INT)
    # Sampling values left out (or null) are the checkpoint's generation_config.json values,
    # else OpenAI's defaults (SAMPLING_DEFAULTS); see sampling_params.
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_WIRE_INT)
    seed: int | None = Field(default=None, ge=0, le=MAX_WIRE_INT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = Field(default=None, ge=-1, le=MAX_WIRE_INT)  # 0 or -1 = off
    ignore_eos: bool = False
    repetition_penalty: float | None = None  # only 1 (off): vLLM's bench client sends it
    min_tokens: int = Field(default=0, ge=0, le=MAX_WIRE_INT)
    stop_token_ids: list[TokenId] | None = None
    return_token_ids: bool = False
    # The tenant namespace of the prompt's KV (``server.scope``); vLLM's field.
    cache_salt: str | None = None
    # The agent session the request continues (vLLM's field; or a header, ``server.scope``).
    session_id: str | None = None

    def check_supported(self) -> None:
        """400 for fields we accept syntactically but cannot honour."""
        if self.presence_penalty or self.frequency_penalty:
            raise bad_request("presence_penalty and frequency_penalty are not supported", "penalty")
        if self.repetition_penalty not in (None, 1.0):
            raise bad_request(
                f"repetition_penalty {self.repetition_penalty} is not supported (only 1, off)",
                "repetition_penalty",
            )
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")

    def stop_strings(self) -> tuple[str, ...]:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stop) > MAX_NUM_STOP_STRINGS:
            raise bad_request(
                f"at most {MAX_NUM_STOP_STRINGS} stop strings, got {len(stop)}", "stop"
            )
        if any(not s for s in stop):
            raise bad_request("stop strings must be non-empty", "stop")
        if not all(map(is_unicode, stop)):
            raise bad_request("stop strings must be valid Unicode (no lone surrogates)", "stop")
        return stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def is_unicode(text: str) -> bool:
    """Whether ``text`` has only Unicode scalar values (JSON may carry lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class CompletionRequest(_GenerationRequest):
    # Text, token ids, or a batch of either.
    prompt: str | list[int] | list[str] | list[list[int]]  # ids checked against the vocabulary
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of not in (None, 1, self.n):
            raise bad_request("best_of other than n is not supported", "best_of")

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def to_template(self) -> dict[str, Any]:
        """The call with its arguments parsed, as vLLM hands it to a template: templates
        write ``arguments | tojson``, which must give the object the model wrote, not a
        string of it. Empty arguments are ``{}``; arguments that are not JSON are a 400."""
        arguments: Any = {}
        if self.function.arguments:
            try:
                arguments = json.loads(self.function.arguments, parse_constant=_refuse_constant)
            except (ValueError, RecursionError) as exc:
                raise bad_request(
                    f"tool call {self.id!r}: arguments are not valid JSON: {exc}", "messages"
                ) from exc
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": arguments},
        }


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # Python's parser takes NaN and Infinity


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (plain dicts and strings)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"only text content parts are supported, got {part.type!r}", "messages"
                    )
            message["content"] = [{"type": "text", "text": p.text} for p in self.content]
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_WIRE_INT)  # newer name
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True  # vLLM extension
    # Accepted and ignored: they change nothing about the tokens.
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_choice not in (None, "auto", "none"):
            raise bad_request(
                "tool_choice may be 'auto' or 'none': forcing a tool call is not supported",
                "tool_choice",
            )
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request(
                f"response_format {self.response_format.type!r} is not supported (only 'text')",
                "response_format",
            )
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request(
                "give max_tokens or max_completion_tokens, not both", "max_completion_tokens"
            )

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def parses_tool_calls(self) -> bool:
        """Whether tool calls in the output become ``tool_calls`` (else they are text)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # vLLM's field. Prompts are encoded without added special tokens (BOS, ...), so this /tokenize
    # gives the ids a completion's prompt gets only as false.
    add_special_tokens: bool = False

    def check_supported(self) -> None:
        if self.add_special_tokens:
            raise bad_request(
                "add_special_tokens=true is not supported: the server adds no special tokens "
                "to a prompt",
                "add_special_tokens",
            )


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


# OpenAI's defaults: what a request that sets nothing gets without generation_config.json.
SAMPLING_DEFAULTS = SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0)


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    seed: int | None,
    defaults: SamplingDefaults,
) -> SamplingParams:
    """The engine's parameters for one generation of ``request`` (400 on a bad combination).
    A sampling value the request leaves out is ``defaults``' (the checkpoint's), else ours."""
    if request.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({max_tokens})",
            "min_tokens",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=first_set(request.temperature, defaults.temperature, "temperature"),
            top_p=first_set(request.top_p, defaults.top_p, "top_p"),
            top_k=max(first_set(request.top_k, defaults.top_k, "top_k"), 0),
            seed=seed,
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            stop=request.stop_strings(),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            logprobs=request.num_top_logprobs,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from exc


def first_set(requested: Any, default: Any, name: str) -> Any:
    if requested is not None:
        return requested
    return default if default is not None else getattr(SAMPLING_DEFAULTS, name)

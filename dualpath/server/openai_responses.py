"""Request bodies of OpenAI's Responses API (``POST /v1/responses``) and their conversion into
the chat messages our chat template renders.

    body = ResponsesRequest(**json_body)        # a 400 names a bad or unknown field
    body.check_supported()                      # a 400 for what we cannot honour
    messages = conversation_of(body.input_items())   # chat-template messages

A Responses conversation is a list of items; a chat template reads messages. The mapping is
the one ``ChatMessage.to_template`` gives chat requests, so a conversation reaches the template
the same way through either API:

- a ``message`` item (roles system, developer, user, assistant; content a string or
  ``input_text``/``output_text`` parts) is that message;
- a ``function_call`` item is a tool call (its ``call_id`` the call's id, its arguments
  parsed) of the assistant message before it, or of a new assistant message when none is
  there: a response's text and its calls are one assistant turn, as the model wrote them;
- a ``function_call_output`` item is a ``tool`` message answering ``call_id``;
- a ``reasoning`` item is dropped (no served model reasons in hidden items).

A response's own output items go through the same mapping (``output_conversation``), so a
conversation continued with ``previous_response_id`` and one whose client sends the whole
history back render the same prompt, token for token.

Top-level fields are strict, as in ``protocol.py``: an unknown one is a 400 naming it. Items
and tools are lenient about extra keys (``id``, ``status``, ``annotations``: clients send back
what they were given). Accepted and ignored, since they change nothing about the tokens:
``reasoning``, ``include``, ``user``, Codex CLI's ``client_metadata``, ``metadata`` (echoed), ``text.verbosity`` (a hint to
OpenAI's models that ours do not take) and ``parallel_tool_calls`` (echoed, not enforced, as
on /v1/chat/completions).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator
from pydantic_core import PydanticCustomError

from dualpath.server.errors import APIError, bad_request
from dualpath.server.protocol import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    ToolCall,
    is_unicode,
)
from dualpath.server.scope import MAX_SESSION_ID_CHARS
from dualpath.types import MAX_WIRE_INT

TEXT_PART_TYPES = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class _Item(BaseModel):
    # Extra keys (an item's id, status, ...) are what clients send back; they change nothing.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextPart(_Item):
    type: str  # input_text or output_text; others are a 400 that names them
    text: str | None = None


Content = str | list[TextPart]


class MessageItem(_Item):
    type: Literal["message"] = "message"  # OpenAI's "easy" input message leaves it out
    role: Literal["system", "developer", "user", "assistant"]
    content: Content


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text of an object, as the model wrote it


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: Content


class ReasoningItem(_Item):
    type: Literal["reasoning"]


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
_ITEMS = TypeAdapter(list[InputItem])
# Text, or items: told apart first, so a bad item's error is about the item alone.
Input = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items")],
    Discriminator(lambda value: "text" if isinstance(value, str) else "items"),
]


class FunctionTool(_Item):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true (constrained arguments) is a 400: not implemented

    def to_template(self) -> dict[str, Any]:
        """The tool as a chat template reads it: a chat request's ``tools`` entry."""
        function = {"name": self.name, "description": self.description}
        function["parameters"] = self.parameters
        return {
            "type": "function",
            "function": {k: v for k, v in function.items() if v is not None},
        }

    def to_body(self) -> dict[str, Any]:
        """The tool as a response echoes it."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema's name, schema, ...: refused anyway

    type: str


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, ignored


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # OpenAI's older name of summary


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``'s body. Defaults are OpenAI's (``store`` true)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str
    input: Input
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_WIRE_INT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None  # "auto" is a 400
    text: TextConfig | None = None
    # Accepted and ignored: no served model reasons in hidden items, no output is included
    # beyond what a response always has.
    reasoning: Reasoning | None = None
    include: list[str] | None = None
    # Codex CLI's description of its turn (thread, turn and window ids): not the model's input.
    client_metadata: dict[str, Any] | None = None
    # OpenAI's cache routing key: the request's session when no other names one.
    prompt_cache_key: str | None = Field(
        default=None, min_length=1, max_length=MAX_SESSION_ID_CHARS
    )
    # vLLM's fields (``server.scope``): the tenant namespace of the KV, the agent session.
    cache_salt: str | None = None
    session_id: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, value: Any) -> Any:
        for index, item in enumerate(value if isinstance(value, list) else ()):
            kind = _item_type(item)
            if isinstance(item, dict) and isinstance(kind, str) and kind not in ITEM_TYPES:
                raise PydanticCustomError(
                    "unsupported_item",
                    "item {index} has type '{kind}': only message, function_call, "
                    "function_call_output and reasoning items are supported",
                    {"index": index, "kind": kind},
                )
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for index, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise PydanticCustomError(
                    "unsupported_tool",
                    "tool {index} has type '{kind}': only 'function' tools are supported",
                    {"index": index, "kind": kind},
                )
        return value

    def check_supported(self) -> None:
        """400 for fields we accept syntactically but cannot honour."""
        for name, value in self.model_dump().items():
            # A response repeats most fields: JSON text may carry "\ud800" and NaN (Python's
            # parser takes it, inside tool parameters), a response can carry neither.
            try:
                text = json.dumps(value, ensure_ascii=False, allow_nan=False)
            except ValueError as exc:
                raise bad_request(f"{name}: NaN and infinity are not JSON", name) from exc
            if not is_unicode(text):
                raise bad_request(f"{name}: text must be valid Unicode (no lone surrogates)", name)
        if self.tool_choice not in (None, "auto", "none"):
            raise bad_request(
                "tool_choice may be 'auto' or 'none': forcing a tool call is not supported",
                "tool_choice",
            )
        for tool in self.tools or ():
            if tool.strict:
                raise bad_request(
                    f"tool {tool.name!r}: strict=true (arguments constrained to the schema) "
                    "is not supported; send strict=false",
                    "tools",
                )
        if self.truncation == "auto":
            raise bad_request(
                "truncation 'auto' is not supported: a conversation beyond the context is a 400",
                "truncation",
            )
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            raise bad_request(
                f"text.format {text_format.type!r} is not supported (only 'text')", "text.format"
            )

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def parses_tool_calls(self) -> bool:
        """Whether tool calls in the output become function_call items (else text)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.to_template() for tool in self.tools or ()] or None


# --- items -> chat messages ---------------------------------------------------------------------


def conversation_of(items: list[InputItem]) -> list[dict[str, Any]]:
    """The chat-template messages of ``items`` (module docstring); a 400 naming ``input``
    for content we cannot render (an image) or call arguments that are not JSON."""
    messages: list[ChatMessage] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=_content(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                ChatMessage(role="tool", content=_content(item.output), tool_call_id=item.call_id)
            )
        # ReasoningItem: dropped (module docstring).
    try:
        return [message.to_template() for message in messages]
    except APIError as exc:  # the chat route's message names its field "messages"
        raise bad_request(exc.message, "input") from exc


def output_conversation(output_items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items (``responses_output.py``'s dicts) as chat messages: exactly
    what ``conversation_of`` gives a client that sends them back as input."""
    return conversation_of(_ITEMS.validate_python(output_items))


def _content(content: Content) -> str | list[ContentPart]:
    """A message's text: one string, or text parts for the template to join."""
    if isinstance(content, str):
        return content
    for part in content:
        if part.type not in TEXT_PART_TYPES or part.text is None:
            raise bad_request(
                f"only text content parts (input_text, output_text) are supported, got "
                f"{part.type!r}",
                "input",
            )
    if len(content) == 1:
        return content[0].text  # type: ignore[return-value]
    if not content:
        return ""
    return [ContentPart(type="text", text=part.text) for part in content]

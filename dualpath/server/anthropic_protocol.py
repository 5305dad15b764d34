"""Request bodies of the Anthropic Messages API (``POST /v1/messages`` and its
``/count_tokens``), and their conversion to the chat messages the OpenAI routes render.

    chat_messages = to_chat_messages(body)       # OpenAI chat messages (arguments as JSON text)
    template_messages = to_template_messages(chat_messages)  # what the chat template reads
    tools = to_chat_tools(body.tools)

A conversation becomes the messages a chat request would send (``ChatMessage``), so both APIs
render one conversation into the same prompt, and turn 2 renders turn 1's answer as the model
wrote it (its KV is found in the store). The rules are vLLM's for its own ``/v1/messages``
(0.32), so a conversation moved from a vLLM server gets the same prompt here:

- ``system`` (a string or text blocks, joined as they are) is the first message, role
  "system"; a text block that starts with ``x-anthropic-billing-header`` is dropped (Claude
  Code's attribution line changes on every request and would defeat the prefix cache);
- a message of role "system" inside ``messages`` (Claude Code sends one) is a system message
  where it stands, text blocks only;
- a message's text blocks are its content (one block: a string; several: text parts); empty
  text blocks are left out;
- an assistant's ``tool_use`` blocks are its ``tool_calls`` (``arguments``: ``json.dumps`` of
  ``input``, parsed back for the template);
- a user's ``tool_result`` blocks are role "tool" messages (``tool_call_id``, the content's
  texts joined by newlines) before the rest of that message. ``is_error`` is accepted; the
  model reads the content alone (the tool's own error text), as on vLLM.

Top-level fields are strict: an unknown one is a 400 naming it. Accepted and ignored, since
they change no token: ``cache_control`` anywhere, top level included (the prefix cache is
automatic), ``metadata``, ``service_tier``, ``speed``, ``diagnostics``, ``inference_geo``,
``user_profile_id``, ``workspace_id``, ``context_management`` (no context is edited: the
client's messages are the prompt), ``output_config.effort`` and ``thinking`` of any type (the
model is prompted the same way: it writes no thinking blocks; Claude Code turns thinking on by
itself, so refusing it would refuse Claude Code). Blocks and tools are lenient about other
keys, as ``ChatMessage`` is: clients send back blocks they were given and add beta fields to
tools (``defer_loading``, ``input_examples``, ...), which then do nothing here. Refused by
name: content blocks other than text, tool_use and tool_result (images, documents, thinking,
...), a forced ``tool_choice`` (``any``, ``tool``), ``disable_parallel_tool_use``, an
``output_config.format``, and a conversation that ends with an assistant message (continuing
it, "prefill", is not supported).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dualpath.model.generation_config import SamplingDefaults
from dualpath.server.errors import bad_request
from dualpath.server.protocol import (
    MAX_NUM_STOP_STRINGS,
    ChatMessage,
    first_set,
    is_unicode,
)
from dualpath.types import MAX_WIRE_INT, SamplingParams

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
SUPPORTED_BLOCK_TYPES = ("text", "tool_use", "tool_result")

CacheControl = dict[str, Any] | None  # {"type": "ephemeral", "ttl": "5m"}: accepted, ignored


class _Strict(BaseModel):
    # As protocol._Strict: types as the schema states them, no NaN or infinity, and (at the
    # top level) no unknown field.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Lenient(BaseModel):
    # Blocks, tools and thinking: other keys are ignored (see the module docstring).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ToolResultText(_Lenient):
    """A block of a tool_result's content; only text is supported (checked on conversion)."""

    type: str
    text: str | None = None
    cache_control: CacheControl = None


class ContentBlock(_Lenient):
    """One content block of any type. Which fields a type needs, and which types are
    supported, is checked on conversion, so a 400 names the block and its type."""

    type: str
    cache_control: CacheControl = None
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ToolResultText] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class Message(_Lenient):
    # "system" in the list: Claude Code sends its environment as a system message after the
    # user's first one (text blocks only); it is rendered where it stands.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, bash, ...) are not ours
    cache_control: CacheControl = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Lenient):
    """Accepted and ignored (module docstring): ``enabled``, ``adaptive`` or ``disabled``."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0, le=MAX_WIRE_INT)
    display: str | None = None


class Metadata(_Strict):
    user_id: str | None = None  # accepted, ignored


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # ignored
    format: dict[str, Any] | None = None  # structured output: refused


class CountTokensRequest(_Strict):
    """What shapes the prompt: the body of ``/v1/messages/count_tokens``."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    def check_supported(self) -> None:
        """400 for what is well-formed but not supported."""
        choice = self.tool_choice
        if choice is not None and choice.type not in ("auto", "none"):
            raise bad_request(
                f"tool_choice {choice.type!r} is not supported: forcing a tool call is not "
                "supported (use 'auto' or 'none')",
                "tool_choice",
            )
        if choice is not None and choice.disable_parallel_tool_use:
            raise bad_request(
                "tool_choice.disable_parallel_tool_use is not supported: the number of calls "
                "the model makes cannot be limited",
                "tool_choice.disable_parallel_tool_use",
            )
        if self.output_config is not None and self.output_config.format is not None:
            raise bad_request(
                "output_config.format is not supported (structured output)",
                "output_config.format",
            )

    @property
    def parses_tool_calls(self) -> bool:
        """Whether tool calls in the output become tool_use blocks (else they are text)."""
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.type == "auto")


class MessagesRequest(CountTokensRequest):
    """The body of ``/v1/messages``."""

    max_tokens: int = Field(ge=1, le=MAX_WIRE_INT)
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Sampling values left out are the checkpoint's generation_config.json values, else
    # OpenAI's defaults (temperature 1, as Anthropic's), as on the OpenAI routes.
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=MAX_WIRE_INT)  # 0 = off
    # Accepted and ignored: they change no token (module docstring).
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl = None  # automatic caching: ours always is
    speed: Literal["standard", "fast"] | None = None
    diagnostics: dict[str, Any] | None = None  # asks why a prompt missed Anthropic's cache
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # The tenant namespace of the prompt's KV and the agent session (``server.scope``).
    cache_salt: str | None = None
    session_id: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stop = tuple(self.stop_sequences or ())
        if len(stop) > MAX_NUM_STOP_STRINGS:
            raise bad_request(
                f"at most {MAX_NUM_STOP_STRINGS} stop_sequences, got {len(stop)}",
                "stop_sequences",
            )
        if any(not s for s in stop):
            raise bad_request("stop_sequences must be non-empty strings", "stop_sequences")
        if not all(map(is_unicode, stop)):
            raise bad_request(
                "stop_sequences must be valid Unicode (no lone surrogates)", "stop_sequences"
            )
        return stop


# --- conversion -----------------------------------------------------------------------------


def to_chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages (module docstring); 400 naming the block for
    what cannot be converted."""
    messages: list[dict[str, Any]] = []
    system = _system_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages += _chat_messages(message, f"messages.{i}")
    last = max((i for i, m in enumerate(body.messages) if m.role != "system"), default=None)
    if last is None or body.messages[last].role != "user":
        raise bad_request(
            "the last message other than a system message must be a user message: continuing "
            "an assistant message is not supported",
            f"messages.{len(body.messages) - 1 if last is None else last}.role",
        )
    return messages


def to_template_messages(chat_messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the chat template reads, exactly as for the same messages sent to
    /v1/chat/completions (``ChatMessage.to_template``)."""
    return [ChatMessage.model_validate(m).to_template() for m in chat_messages]


def to_chat_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as /v1/chat/completions takes them (``description`` left out when absent)."""
    if not tools:
        return None
    chat_tools = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _system_text(system: str | list[ContentBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    parts = []
    for j, block in enumerate(system):
        if block.type != "text" or block.text is None:
            raise bad_request(
                f"system blocks must be text blocks, got {block.type!r}"
                + (" without text" if block.type == "text" else ""),
                f"system.{j}",
            )
        if not block.text.startswith(BILLING_HEADER_PREFIX):
            parts.append(block.text)
    return "".join(parts)


def _chat_messages(message: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: its tool results (role "tool") first, then
    the message itself if it has anything left (a user's message may be results alone)."""
    chat: dict[str, Any] = {"role": message.role}
    if isinstance(message.content, str):
        chat["content"] = message.content
        return [chat]
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        param = f"{where}.content.{j}"
        if block.type == "text":
            if block.text is None:
                raise bad_request("a text block needs its text", f"{param}.text")
            if block.text:
                texts.append(block.text)
        elif block.type == "tool_use":
            _check_role(message, "assistant", block.type, param)
            calls.append(_tool_call(block, param))
        elif block.type == "tool_result":
            _check_role(message, "user", block.type, param)
            results.append(_tool_message(block, param))
        else:
            raise bad_request(
                f"content blocks of type {block.type!r} are not supported (only "
                f"{', '.join(SUPPORTED_BLOCK_TYPES)})",
                f"{param}.type",
            )
    if texts:
        chat["content"] = (
            texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
        )
    if calls:
        chat["tool_calls"] = calls
    if message.role == "user" and not texts:
        return results  # only results: nothing of the user's own
    return [*results, chat]


def _check_role(message: Message, role: str, block_type: str, param: str) -> None:
    if message.role != role:
        raise bad_request(f"{block_type} blocks belong in {role} messages", param)


def _tool_call(block: ContentBlock, param: str) -> dict[str, Any]:
    for name in ("id", "name", "input"):
        if getattr(block, name) is None:
            raise bad_request(f"a tool_use block needs its {name}", f"{param}.{name}")
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": arguments},
    }


def _tool_message(block: ContentBlock, param: str) -> dict[str, Any]:
    if block.tool_use_id is None:
        raise bad_request("a tool_result block needs its tool_use_id", f"{param}.tool_use_id")
    content = block.content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"a tool_result's content may hold text blocks only, got {part.type!r}",
                    f"{param}.content.{k}",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""}


# --- sampling -------------------------------------------------------------------------------


def sampling_params(
    body: MessagesRequest, *, max_tokens: int, defaults: SamplingDefaults
) -> SamplingParams:
    """The engine's parameters for ``body``; a value it leaves out is ``defaults``' (the
    checkpoint's), else ours (``SAMPLING_DEFAULTS``)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=first_set(body.temperature, defaults.temperature, "temperature"),
            top_p=first_set(body.top_p, defaults.top_p, "top_p"),
            top_k=max(first_set(body.top_k, defaults.top_k, "top_k"), 0),
            stop=body.stop_strings(),
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from exc

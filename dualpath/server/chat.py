"""Chat messages -> prompt text, through the checkpoint's chat template.

The template is the checkpoint's, found as transformers finds it (``chat_template.jinja``,
else ``tokenizer_config.json``'s ``chat_template``; ``read_chat_templates``), and its
"tool_use" template when a request has tools and the checkpoint names one. A checkpoint without
one gets ``DEFAULT_CHAT_TEMPLATE``: ChatML with tools and tool calls as Qwen2.5 writes them, so
turn 2 of an agent's conversation renders turn 1 as the model saw and wrote it (and its KV is
found in the store).

Templates are untrusted input (they ship with checkpoints): they run in Jinja's immutable
sandbox with the globals transformers provides (``raise_exception``, ``strftime_now``) and
its ``tojson`` filter, and nothing else.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dualpath.model.presets import CHAT_TEMPLATE
from dualpath.model.tokenizer import (
    DEFAULT_TEMPLATE_NAME,
    read_chat_templates,
    read_tokenizer_config,
)

DEFAULT_CHAT_TEMPLATE = CHAT_TEMPLATE
TOOL_USE_TEMPLATE_NAME = "tool_use"  # transformers' name for the template used with tools
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. an unsupported role order) or is broken."""


class ChatRenderer:
    """Renders a conversation with one compiled template. Thread-safe (templates are)."""

    def __init__(
        self,
        template: str | None,
        special_tokens: dict[str, str] | None = None,
        *,
        tool_use_template: str | None = None,
    ) -> None:
        """``tool_use_template`` renders requests that have tools, when given."""
        self.is_default = template is None
        self.source = DEFAULT_CHAT_TEMPLATE if template is None else template
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(self.source)
            self._tool_use_template = (
                self._template
                if tool_use_template is None
                else environment.from_string(tool_use_template)
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self._special_tokens = dict(special_tokens or {})

    @classmethod
    def for_checkpoint(cls, model_dir: Path) -> ChatRenderer:
        """The checkpoint's templates (``read_chat_templates``) and special tokens
        (``tokenizer_config.json``), if any; ``CheckpointError`` for unreadable files."""
        templates = read_chat_templates(model_dir)
        config = read_tokenizer_config(model_dir)
        special = {}
        for name in _SPECIAL_TOKEN_NAMES:
            value = config.get(name)
            if isinstance(value, dict):  # {"content": "<s>", ...}
                value = value.get("content")
            if isinstance(value, str):
                special[name] = value
        return cls(
            templates.get(DEFAULT_TEMPLATE_NAME),
            special,
            tool_use_template=templates.get(TOOL_USE_TEMPLATE_NAME),
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text; ``ChatTemplateError`` if the template refuses the conversation.
        A message without content (an assistant's tool calls) has the empty string, as vLLM
        hands it to a template that reads strings: most write ``'...' + message['content']``."""
        template = self._template if tools is None else self._tool_use_template
        messages = [m if m.get("content") is not None else m | {"content": ""} for m in messages]
        try:
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    # As transformers: no HTML escaping (the prompt is not HTML), unicode kept as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)

"""A chat request's prompt rendered by the router itself, as its vLLM servers render it, instead
of asked of a server's /tokenize: two stages (a round trip to a server) fewer on every
forwarded chat request.

    prompts = LocalPrompts(chat, tokenizer)          # the router's checkpoint's template
    token_ids = prompts.render(body)                 # None: a server renders this one
    prompts.check(token_ids, server_token_ids)       # while unchecked: trusted, or refused

Rendering here is trusted only once it was seen to agree, and never blindly:

1. Unchecked: a request is rendered here *and* by a server's /tokenize. The same ids make the
   router trust its rendering; different ones refuse it for good (logged once).
2. Trusted: requests are rendered here; no server is asked.
3. Every placement is checked where it matters: a DE's connector compares the prompt placed
   with the one its server rendered from the client's body (``served_scheduler._mismatch``).
   On a mismatch its vLLM serves the request alone (it computes the whole prompt: the
   client's tokens are right; nothing of the placement is loaded), and the router renders
   nothing more here (``refuse``).

Rendered here only: bodies without the fields by which vLLM's rendering goes beyond ours
(``SERVER_RENDERED_FIELDS``), whose messages are plain text (a content part, an image, a field
we do not render goes to a server). What vLLM refuses, vLLM says: a body this module cannot
render is left to a server's /tokenize, never refused here.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from dualpath.model.tokenizer import Tokenizer
from dualpath.server.chat import ChatRenderer, ChatTemplateError
from dualpath.server.errors import APIError
from dualpath.server.protocol import ChatMessage, Tool

logger = logging.getLogger(__name__)

# The chat body's fields by which vLLM 0.32 renders a prompt otherwise than the checkpoint's
# template alone (``ChatCompletionRequest.build_chat_params`` and the tokenizer's own): a body
# with any of them is rendered by a server.
SERVER_RENDERED_FIELDS = frozenset(
    {
        "add_special_tokens",
        "chat_template",
        "chat_template_kwargs",
        "continue_final_message",
        "documents",
        "media_io_kwargs",
        "mm_processor_kwargs",
        "reasoning_effort",
        "response_format",
    }
)
# A message's fields that the template sees here as vLLM hands them to it.
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})

UNCHECKED = "unchecked"
TRUSTED = "trusted"
REFUSED = "refused"


class LocalPrompts:
    """The router's rendering of chat prompts, and whether it is trusted (module docstring).
    Rendering is thread-safe; the state is set from the event loop and the scheduler's
    thread (``refuse``), each a single assignment."""

    def __init__(self, chat: ChatRenderer, tokenizer: Tokenizer) -> None:
        self._chat = chat
        self._tokenizer = tokenizer
        self.state = UNCHECKED

    @property
    def is_trusted(self) -> bool:
        return self.state == TRUSTED

    def render(self, body: dict[str, Any]) -> list[int] | None:
        """The chat body's prompt ids as rendered here, or None: rendering here is refused, or
        the body is one a server renders (see the module docstring)."""
        if self.state == REFUSED or not _is_renderable(body):
            return None
        try:
            messages = [ChatMessage.model_validate(m).to_template() for m in body["messages"]]
            tools = [
                Tool.model_validate(tool).model_dump(exclude_none=True)
                for tool in body.get("tools") or ()
            ]
            text = self._chat.render(
                messages,
                tools=tools or None,
                add_generation_prompt=body.get("add_generation_prompt", True),
            )
            return self._tokenizer.encode(text)
        except (ValidationError, APIError, ChatTemplateError, ValueError, TypeError):
            return None  # the server renders it, or says what is wrong with it

    def check(self, token_ids: list[int], server_token_ids: list[int]) -> None:
        """While unchecked: trust rendering here if it gave the server's ids, else refuse it."""
        if self.state != UNCHECKED:
            return
        if token_ids == server_token_ids:
            self.state = TRUSTED
            logger.info("chat prompts are rendered here: they match the vLLM servers'")
            return
        at = next(
            (
                i
                for i, (a, b) in enumerate(zip(token_ids, server_token_ids, strict=False))
                if a != b
            ),
            min(len(token_ids), len(server_token_ids)),
        )
        self.refuse(
            f"a prompt rendered here ({len(token_ids)} tokens) differs from a vLLM server's "
            f"({len(server_token_ids)} tokens) from token {at} on"
        )

    def refuse(self, why: str) -> None:
        """Render nothing more here: the servers' /tokenize renders every prompt from now on."""
        if self.state != REFUSED:
            self.state = REFUSED
            logger.warning(
                "%s: chat prompts are rendered by the vLLM servers from now on (is the "
                "router's --model the servers' checkpoint, chat template included?)",
                why,
            )


def _is_renderable(body: dict[str, Any]) -> bool:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    if not SERVER_RENDERED_FIELDS.isdisjoint(body):
        return False
    if not isinstance(body.get("add_generation_prompt", True), bool):
        return False
    return all(
        isinstance(m, dict)
        and _MESSAGE_FIELDS.issuperset(m)
        and m.get("role") != "developer"  # vLLM adds the request's tools to its message
        and (m.get("content") is None or isinstance(m["content"], str))
        for m in messages
    )

"""The client's side of a forwarded stream (``forwarded_call.py``): which events it gets for
each line its DE sends, what it was sent so far, and the chunks the front door writes itself
when a placement is lost: a continuation's /v1/completions chunks in the client's format, a
finish, the usage. Pure: no I/O, no placements.

Shapes are vLLM's (``model_dump_json(exclude_unset=True)`` of its 0.32 stream responses): a
chat chunk's choice has ``delta`` and, once finished, ``stop_reason``; a completion chunk's
choice always has ``stop_reason`` and ``prompt_token_ids``; both carry ``token_ids``, null
unless the client asked for them. A client thus cannot tell a continued stream from an
undisturbed one (but see ``in_client_format``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dualpath.server.errors import APIError
from dualpath.server.responses import sse

# The client's sampling fields a continuation is sent (min_tokens and max_tokens are reduced
# by the tokens sent; logprobs are left out: chat and completions ask for them differently).
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words",
    "allowed_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class StreamMeta:
    """What every chunk of the client's stream repeats: its first chunk's values."""

    id: str
    created: int
    model: str
    is_chat: bool

    def chunk(self, **fields: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "created": self.created,
            "model": self.model,
            **fields,
        }


class ClientStream:
    """What the client of a forwarded stream was sent, and its events for each DE line.

    ``on_tokens(token_ids)`` is called for the token ids of each chunk relayed (the DE is
    asked for them: ``return_token_ids``); a placement that goes on from them is
    ``continue_from_sent``'s, and its chunks are rewritten from then on."""

    def __init__(
        self,
        body: dict[str, Any],
        num_prompt_tokens: int,
        *,
        is_chat: bool,
        on_tokens: Callable[[list[int]], None],
    ) -> None:
        self.body = body
        self.num_prompt_tokens = num_prompt_tokens
        self.is_chat = is_chat
        self.on_tokens = on_tokens
        self.meta: StreamMeta | None = None  # from the first chunk relayed
        self.token_ids: list[int] = []  # sent to the client
        self.finish_reason: str | None = None
        self.has_chunk = False
        self.is_continued = False  # the current placement goes on from the tokens sent
        self.is_done = False  # [DONE] sent
        # Every chunk with output carried its token ids (vLLM hides them with hidden
        # reasoning): without them, where to go on from is unknown.
        self.has_exact_token_ids = True

    @property
    def wants_token_ids(self) -> bool:
        return self.body.get("return_token_ids") is True

    def relay(self, line: str) -> list[str]:
        """The client's events for one line of the DE's stream. ``APIError`` for a line that
        is not vLLM's."""
        if not line.startswith("data:"):
            return []  # blank lines between events, comments
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return self.end() if self.is_continued else self._done([])
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            message = f"the decode engine sent an event that is not JSON: {data[:200]!r}"
            raise APIError(500, message) from exc
        self._note(chunk)
        if self.is_continued:
            chunk = in_client_format(chunk, self.meta, has_token_ids=self.wants_token_ids)
            if chunk is None:
                return []
        elif not self.wants_token_ids:
            hide_token_ids(chunk)
        self.has_chunk = True
        return [sse(chunk)]

    def _note(self, chunk: dict[str, Any]) -> None:
        if self.meta is None:
            meta = [chunk.get(name) for name in ("id", "created", "model")]
            self.meta = StreamMeta(*meta, is_chat=self.is_chat)
        for choice in chunk.get("choices") or ():
            token_ids = choice.get("token_ids")
            if token_ids:
                self.on_tokens(token_ids)
                self.token_ids.extend(token_ids)
            elif has_output(choice):
                self.has_exact_token_ids = False
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def end(self) -> list[str]:
        """The events that end the stream after its last chunk: the usage if asked for (the
        whole stream's), [DONE]."""
        options = self.body.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage")):
            return self._done([])
        usage = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "total_tokens": self.num_prompt_tokens + len(self.token_ids),
        }
        return self._done([sse(self.meta.chunk(choices=[], usage=usage))])

    def finish(self, finish_reason: str) -> list[str]:
        """The events that end a stream whose last token was sent without its finish."""
        choice = {"text": "", "finish_reason": finish_reason, "stop_reason": None}
        chunk = in_client_format({"choices": [choice]}, self.meta, has_token_ids=False)
        chunk["choices"][0]["token_ids"] = [] if self.wants_token_ids else None
        self.finish_reason = finish_reason
        return [sse(chunk), *self.end()]

    def _done(self, events: list[str]) -> list[str]:
        self.is_done = True
        return [*events, sse("[DONE]")]

    def continue_from_sent(
        self, prompt_token_ids: list[int], num_left: int, kv_transfer_params: dict[str, Any]
    ) -> dict[str, Any]:
        """The /v1/completions request that goes on from the tokens sent (``prompt_token_ids``
        ends with them); the chunks relayed from now on are its."""
        body = {name: self.body[name] for name in _SAMPLING_FIELDS if name in self.body}
        min_tokens = self.body.get("min_tokens")
        if type(min_tokens) is int:
            body["min_tokens"] = max(0, min_tokens - len(self.token_ids))
        if "cache_salt" in self.body:  # the tenant's namespace, placed with it again
            body["cache_salt"] = self.body["cache_salt"]
        body.update(
            model=self.body.get("model"),
            prompt=prompt_token_ids,
            max_tokens=num_left,
            stream=True,
            return_token_ids=True,
            kv_transfer_params=kv_transfer_params,
        )
        self.is_continued = True
        return body


def in_client_format(
    chunk: dict[str, Any], meta: StreamMeta, *, has_token_ids: bool
) -> dict[str, Any] | None:
    """A continuation's /v1/completions chunk as the client's stream carries it (None for a
    chunk of no choice: the continuation's usage; ``ClientStream.end`` sends the stream's).
    Its text is content: the first DE's tool-call and reasoning parsers are not run on a
    continuation, and a stop string that spans the two placements is not seen."""
    choices = chunk.get("choices") or ()
    if not choices:
        return None
    choice = choices[0]
    finish_reason = choice.get("finish_reason")
    out: dict[str, Any] = {"index": 0}
    if meta.is_chat:
        out.update(delta={"content": choice.get("text", "")}, logprobs=None)
        out["finish_reason"] = finish_reason
        if finish_reason is not None:
            out["stop_reason"] = choice.get("stop_reason")
    else:
        out.update(text=choice.get("text", ""), logprobs=None, finish_reason=finish_reason)
        out.update(stop_reason=choice.get("stop_reason"), prompt_token_ids=None)
    out["token_ids"] = choice.get("token_ids") if has_token_ids else None
    return meta.chunk(choices=[out])


def hide_token_ids(chunk: dict[str, Any]) -> None:
    """Null the token ids the front door asked for (``return_token_ids``), as vLLM sends a
    client that did not ask for them."""
    if "prompt_token_ids" in chunk:
        chunk["prompt_token_ids"] = None
    for choice in chunk.get("choices") or ():
        for name in ("token_ids", "prompt_token_ids"):
            if name in choice:
                choice[name] = None


def has_output(choice: dict[str, Any]) -> bool:
    """Whether a stream choice carries generated text (or a tool call, or reasoning)."""
    delta = choice.get("delta") or {}
    return bool(choice.get("text")) or any(v for k, v in delta.items() if k != "role")

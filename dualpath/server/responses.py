"""Response bodies and stream chunks in OpenAI's shapes (plain dicts, serialised once).

``return_token_ids`` (vLLM's extension) adds ``token_ids`` to every choice and every chunk, and
``prompt_token_ids`` to every non-streamed choice: the exact tokens, so an agent or a benchmark
extends its context without re-tokenising.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dualpath.server.detokenizer import Decoder
from dualpath.server.generation import Choice, ChoiceDelta, Generation
from dualpath.types import TokenLogprob


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """Fields every body and chunk of one response repeats."""

    id: str
    created_unix_s: int
    model: str
    return_token_ids: bool


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


# --- /v1/completions ------------------------------------------------------------------------


def completion_body(meta: ResponseMeta, generation: Generation, decoder: Decoder) -> dict:
    choices = []
    for choice in generation.choices:
        body: dict[str, Any] = {
            "index": choice.index,
            "text": choice.text,
            "logprobs": _completion_logprobs(choice.logprobs, decoder)
            if choice.params.logprobs is not None
            else None,
            "finish_reason": choice.finish_reason,
        }
        _add_token_ids(body, meta, choice, generation)
        choices.append(body)
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created_unix_s,
        "model": meta.model,
        "choices": choices,
        "usage": generation.usage(),
    }


def completion_chunk(
    meta: ResponseMeta, delta: ChoiceDelta, *, want_logprobs: bool, decoder: Decoder
) -> dict:
    choice: dict[str, Any] = {
        "index": delta.index,
        "text": delta.text,
        "logprobs": _completion_logprobs(delta.logprobs, decoder) if want_logprobs else None,
        "finish_reason": delta.finish_reason,
    }
    if meta.return_token_ids:
        choice["token_ids"] = list(delta.token_ids)
    return _chunk(meta, "text_completion", [choice])


def _completion_logprobs(logprobs: Sequence[TokenLogprob], decoder: Decoder) -> dict:
    tokens = [decoder.decode([lp.token_id]) for lp in logprobs]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [
            {decoder.decode([token_id]): value for token_id, value in lp.top} for lp in logprobs
        ],
        "text_offset": offsets,
    }


# --- /v1/chat/completions -------------------------------------------------------------------


def chat_body(meta: ResponseMeta, generation: Generation, decoder: Decoder) -> dict:
    choices = []
    for choice in generation.choices:
        body: dict[str, Any] = {
            "index": choice.index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": _chat_logprobs(choice.logprobs, decoder)
            if choice.params.logprobs is not None
            else None,
            "finish_reason": choice.finish_reason,
        }
        _add_token_ids(body, meta, choice, generation)
        choices.append(body)
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created_unix_s,
        "model": meta.model,
        "choices": choices,
        "usage": generation.usage(),
    }


def chat_role_chunk(meta: ResponseMeta, index: int) -> dict:
    """A choice's first chunk, as OpenAI sends it: the role and empty content."""
    choice = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    if meta.return_token_ids:
        choice["token_ids"] = []
    return _chunk(meta, "chat.completion.chunk", [choice])


def chat_chunk(
    meta: ResponseMeta, delta: ChoiceDelta, *, want_logprobs: bool, decoder: Decoder
) -> dict:
    choice: dict[str, Any] = {
        "index": delta.index,
        "delta": {"content": delta.text} if delta.text else {},
        "logprobs": _chat_logprobs(delta.logprobs, decoder) if want_logprobs else None,
        "finish_reason": delta.finish_reason,
    }
    if meta.return_token_ids:
        choice["token_ids"] = list(delta.token_ids)
    return _chunk(meta, "chat.completion.chunk", [choice])


def _chat_logprobs(logprobs: Sequence[TokenLogprob], decoder: Decoder) -> dict:
    def entry(token_id: int, value: float) -> dict[str, Any]:
        token = decoder.decode([token_id])
        return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


# --- shared ---------------------------------------------------------------------------------


def usage_chunk(meta: ResponseMeta, object_name: str, generation: Generation) -> dict:
    return {**_chunk(meta, object_name, []), "usage": generation.usage()}


def _chunk(meta: ResponseMeta, object_name: str, choices: list[dict]) -> dict:
    return {
        "id": meta.id,
        "object": object_name,
        "created": meta.created_unix_s,
        "model": meta.model,
        "choices": choices,
    }


def _add_token_ids(
    body: dict[str, Any], meta: ResponseMeta, choice: Choice, generation: Generation
) -> None:
    if meta.return_token_ids:
        body["token_ids"] = list(choice.token_ids)
        body["prompt_token_ids"] = generation.prompts[choice.prompt_index]

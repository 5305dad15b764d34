"""Text of a growing sequence of generated tokens, handed out in deltas that never change.

The engine decides when a request stops (stop strings, stop tokens, EOS) and says why; this
class turns its tokens into the text the client sees, so that the streamed deltas add up to
exactly the text of the non-streamed response::

    text = decode(tokens without a final stop token)     # EOS / stop_token_ids are not text
    text = text[: first stop string]  if finish_reason == "stop" and one occurs

While streaming it holds back what may still change: bytes of an unfinished UTF-8 character
(decoded as U+FFFD), the last ``len(longest stop string) - 1`` characters (a stop string may
be completing), everything from a complete stop string on (the event that says the request
stopped may come with the token that completed it), and a trailing token that may be the stop
token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
_MAX_PENDING_TOKENS = 3


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """One generation's text. ``push`` while tokens arrive, then ``finish`` once.

    ``stop_token_ids`` are the ids that end the request when generated last (the request's
    ``stop_token_ids``, plus EOS unless ``ignore_eos``); a final one is not part of the text.
    """

    def __init__(
        self, decoder: Decoder, *, stop: tuple[str, ...] = (), stop_token_ids: Iterable[int] = ()
    ) -> None:
        self._decoder = decoder
        self._stop = stop
        # Text a stop string still being completed may start in: its length minus one.
        self._holdback_chars = max((len(s) for s in stop), default=1) - 1
        self._stop_token_ids = frozenset(stop_token_ids)
        self.token_ids: list[int] = []
        self._decoded = ""  # clean text of token_ids[:_read_offset]
        self._prefix_offset = 0  # decode windows start here (context for the next token)
        self._read_offset = 0
        self.text = ""  # handed out so far
        self.is_finished = False
        # The stop string the text was cut at (set by ``finish``; None if none was met).
        self.stop_string: str | None = None

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that can no longer change (possibly empty)."""
        if self.is_finished:
            raise RuntimeError("push after finish: the caller must stop at the final event")
        self.token_ids.extend(token_ids)
        settled = self.token_ids
        if settled and settled[-1] in self._stop_token_ids:
            settled = settled[:-1]  # may be the stop token: its text would be dropped
        self._decode_up_to(settled)
        safe_end = len(self._decoded) - self._holdback_chars
        if self._stop:  # nothing from a complete stop string on: the engine cuts it off
            search_from = max(0, len(self.text) - self._holdback_chars)
            for s in self._stop:
                found = self._decoded.find(s, search_from)
                if found >= 0:
                    safe_end = min(safe_end, found)
        if safe_end <= len(self.text):
            return ""
        delta = self._decoded[len(self.text) : safe_end]
        self.text += delta
        return delta

    def finish(self, finish_reason: str) -> str:
        """The rest of the text, cut as the engine cut it. Call once, after the last push."""
        self.is_finished = True
        token_ids = self.token_ids
        if finish_reason == "stop" and token_ids and token_ids[-1] in self._stop_token_ids:
            token_ids = token_ids[:-1]
        final = self._decoder.decode(token_ids)
        if finish_reason == "stop":
            # The engine stops at the first stop string completed: the one that starts first
            # (of two starting there, the shorter).
            found = [(final.find(s), len(s), s) for s in self._stop if s in final]
            if found:
                start, _, self.stop_string = min(found)
                final = final[:start]
        if not final.startswith(self.text):
            # Cannot happen for tokenizers whose decode is a concatenation of tokens' bytes;
            # the client already has self.text, so say so rather than contradict it.
            logger.warning("streamed text %r is not a prefix of the final text", self.text[-40:])
            return ""
        delta = final[len(self.text) :]
        self.text = final
        return delta

    def _decode_up_to(self, token_ids: list[int]) -> None:
        """Extend ``_decoded`` with the tokens up to ``len(token_ids)`` that decode cleanly.

        Decodes a small window (the previous token's start to the end) and keeps what the new
        tokens added: linear in the output length, and tokenizers that change a token's text
        by its left neighbour (SentencePiece's leading space) still come out right. A window
        ending in U+FFFD may be a character whose bytes have not all arrived: up to
        ``_MAX_PENDING_TOKENS`` tokens wait for the rest (a UTF-8 character has at most 4
        bytes, each token at least one); an invalid byte before that is text for good.
        """
        prefix_text = self._decoder.decode(token_ids[self._prefix_offset : self._read_offset])
        for end in range(len(token_ids), self._read_offset, -1):
            if len(token_ids) - end > _MAX_PENDING_TOKENS:
                return
            new_text = self._decoder.decode(token_ids[self._prefix_offset : end])
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
                self._decoded += new_text[len(prefix_text) :]
                self._prefix_offset = self._read_offset
                self._read_offset = end
                return

"""Tool calls in a chat model's output, in the Hermes/Qwen style: ``<tool_call>{json}</tool_call>``.

    parser = ToolCallParser()
    for text in text_deltas:
        events = parser.push(text)        # text pieces and ParsedToolCalls, in output order
    events += parser.finish()

    text, calls = parse_tool_calls(output)  # the same, for a whole output at once

The rules (those of vLLM's ``hermes`` parser, made exact and split-proof):

- A call is ``<tool_call>``, a JSON object with a non-empty string ``name`` and an object
  ``arguments`` (absent means ``{}``), and ``</tool_call>``. The output's last call may lack
  its closing tag: a model may stop (EOS) right after the JSON.
- Anything else between the tags (malformed JSON, no name, arguments that are not an object,
  NaN) is text, unchanged, tags included; so is a stray ``</tool_call>``.
- Whitespace next to a call (the newline before each call, between two calls, after the
  last) is layout, not text: Qwen2.5's template writes it around each call. Where text
  follows calls that text preceded, the whitespace before the first of those calls separates
  the two (``"A\n<call>\nB"`` has the text ``"A\nB"``).
- A call's ``arguments`` are ``json.dumps(object, ensure_ascii=False)``, as in vLLM: the very
  text the model wrote only if it wrote ``", "`` and ``": "`` separators and no escapes that
  ``json.dumps`` would not write. That is also what renders it back into the next turn's
  prompt (templates write ``arguments | tojson``), so the next turn's prompt repeats the
  model's own tokens, and finds their KV in the store, only in that case.

Streaming holds back what is not decided yet: a possible start of ``<tool_call>``, whitespace
that may precede one, and a whole call from ``<tool_call>`` to ``</tool_call>`` (only a whole
call can be told from text: malformed JSON stays text). So a call arrives in one piece, and
the events of any split of an output add up to exactly those of the whole output.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from dualpath.server.protocol import is_unicode

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call the model made. ``index`` counts the output's calls from 0."""

    index: int
    name: str
    arguments: str  # JSON text of an object


Event = str | ParsedToolCall


class ToolCallParser:
    """One output's tool calls, found as its text arrives. ``push`` while text arrives, then
    ``finish`` once. Adjacent text events are merged within one call's result."""

    def __init__(self) -> None:
        # Undecided text. While a call is open it starts with OPEN_TAG; otherwise it is
        # whitespace and/or a partial OPEN_TAG at the end of the text so far.
        self._pending = ""
        self._num_scanned = 0  # of _pending, searched for CLOSE_TAG already (open call)
        self._space_before_call = ""  # whitespace before the open call: text if it fails
        # Whitespace before the calls since the last text: written only if text follows.
        self._separator = ""
        self._has_text = False  # some text was handed out
        self._is_in_call = False
        self._is_after_call = False  # whitespace that follows a call is dropped
        self._is_finished = False
        self.num_calls = 0

    def push(self, text: str) -> list[Event]:
        """Add text; return what is decided now (possibly nothing)."""
        if self._is_finished:
            raise RuntimeError("push after finish: the caller must stop at the final delta")
        self._pending += text
        events: list[Event] = []
        while self._take_call(events) if self._is_in_call else self._take_text(events):
            pass
        return events

    def finish(self) -> list[Event]:
        """The rest: an open call is decided as the output ends. Call once."""
        if self._is_finished:
            raise RuntimeError("finish called twice")
        self._is_finished = True
        events: list[Event] = []
        if self._is_in_call:
            self._decide(events, self._pending, self._pending[len(OPEN_TAG) :])
        else:
            self._add_text(events, self._pending)
        self._pending = ""
        return events

    def _take_text(self, events: list[Event]) -> bool:
        """Outside a call: hand out the text that cannot be part of one; True if a call
        opened (and more may be decided)."""
        if self._is_after_call:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._is_after_call = False
        start = self._pending.find(OPEN_TAG)
        if start >= 0:
            before = self._pending[:start]
            text = before.rstrip()
            self._add_text(events, text)
            self._space_before_call = before[len(text) :]
            self._pending = self._pending[start:]
            self._num_scanned = len(OPEN_TAG)
            self._is_in_call = True
            return True
        end = len(self._pending) - _partial_open_tag_len(self._pending)
        end = len(self._pending[:end].rstrip())  # whitespace may come before a call
        self._add_text(events, self._pending[:end])
        self._pending = self._pending[end:]
        return False

    def _take_call(self, events: list[Event]) -> bool:
        """Inside a call: decide it once its closing tag is there; True if it was."""
        # A closing tag may have begun in what was searched already, but not ended there.
        search_from = max(len(OPEN_TAG), self._num_scanned - len(CLOSE_TAG) + 1)
        close = self._pending.find(CLOSE_TAG, search_from)
        if close < 0:
            self._num_scanned = len(self._pending)
            return False
        end = close + len(CLOSE_TAG)
        block, self._pending = self._pending[:end], self._pending[end:]
        self._decide(events, block, block[len(OPEN_TAG) : close])
        return True

    def _decide(self, events: list[Event], block: str, body: str) -> None:
        call = _parse_call(body, self.num_calls)
        if call is None:
            self._add_text(events, self._space_before_call + block)
        else:
            events.append(call)
            self.num_calls += 1
            self._is_after_call = True
            if self._has_text and not self._separator:
                self._separator = self._space_before_call
        self._space_before_call = ""
        self._is_in_call = False

    def _add_text(self, events: list[Event], text: str) -> None:
        if text:
            _add_text(events, self._separator + text)
            self._separator = ""
            self._has_text = True


def parse_tool_calls(output: str) -> tuple[str, list[ParsedToolCall]]:
    """A whole output's text (outside the calls) and its calls; the text is ``output``
    itself when there is no call."""
    parser = ToolCallParser()
    events = parser.push(output) + parser.finish()
    text = "".join(e for e in events if isinstance(e, str))
    return text, [e for e in events if isinstance(e, ParsedToolCall)]


def new_tool_call_id() -> str:
    """An id in OpenAI's form, unique across requests (clients match results by it)."""
    return f"call_{secrets.token_hex(12)}"


def _parse_call(body: str, index: int) -> ParsedToolCall | None:
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    arguments_text = json.dumps(arguments, ensure_ascii=False)
    if not (is_unicode(name) and is_unicode(arguments_text)):
        return None  # a "\ud800" escape: no response could carry it
    return ParsedToolCall(index, name, arguments_text)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # Python's parser takes NaN and Infinity


def _partial_open_tag_len(text: str) -> int:
    """Length of the longest end of ``text`` that OPEN_TAG starts with (0 if none)."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0


def _add_text(events: list[Event], text: str) -> None:
    if not text:
        return
    if events and isinstance(events[-1], str):
        events[-1] += text
    else:
        events.append(text)

"""Mooncake-format JSONL traces, with the agentic extension, as a replayable ``Workload``.

    workload = load_mooncake_trace(path, vocab_size=32_000, max_sessions=8, length_scale=0.1)

**Rows.** One JSON object per line: ``timestamp`` (ms), ``input_length`` and
``output_length`` (tokens) and ``hash_ids`` (one id per ``block_size_tokens``-token block,
exactly ceil(input_length / block_size) of them, prefix-chained: equal ids mean equal content
up to that block). The agentic extension adds ``session_id`` and ``turn``: rows group into
sessions, each session's turns must come in file order 0, 1, 2, ... (other sessions' rows may
interleave), and a session arrives at its first row's timestamp; each later turn keeps the gap
from the previous row's timestamp (``Turn.gap_s``, which an online replay may wait). Without
them, every row is a one-turn session arriving at its timestamp. Blank lines are skipped; any other broken line
raises ``TraceFormatError`` naming the file and line.

**Tokens.** Block id h becomes ``block_size`` random ordinary token ids drawn from a Generator
seeded by (seed, h), and a prompt is its blocks' tokens cut to ``input_length``: equal ids give
equal tokens (so the trace's prefix reuse reaches the engine's cache), different ids different
ones. Ids are taken as global, as in Mooncake's own traces; replay two files whose ids overlap
with different seeds.

**Turns (the replay rule for traces).** A trace's turn i+1 is the whole context its client
sent, which need not equal prompt_i + output_i + something: clients edit context (the agentic
trace drops earlier outputs' hidden parts; 12% of its turns are shorter than prompt_i +
output_i). With P_i the replayed prompt length, L the trace's input lengths, B the block size:

- *Continuation*: turn i+1's hash_ids start with all of turn i's blocks but the last, which
  may differ (the agentic trace gives every request's last block a fresh id, even a full one,
  so its next turn never shares it). The replay keeps prompt_i and the generated tokens and
  appends a = max(0, L_(i+1) - P_i - g_i) tokens, the last a tokens of turn i+1's trace
  prompt. So P_(i+1) = max(L_(i+1), P_i + g_i): a replay runs ahead of the trace by the
  outputs the trace dropped, and later appends pay that back.
- *Edit*: they share only k < len(hash_ids_i) - 1 blocks. The replay keeps prompt_i[:k*B]
  (the trace's hit) and re-sends the rest of turn i+1's trace prompt: P_(i+1) = L_(i+1).

**Scaling.** ``length_scale`` shrinks the block size to B' = max(1, round(B * length_scale))
and keeps each row's block count: full blocks become B' tokens, the last block
max(1, round(tail * B' / B)). Every hash id keeps its place, so the prefix-sharing structure
(which turns share which blocks) is exactly the trace's. Inputs thus scale by B'/B (0.01 of
512 gives 5, a factor of 0.0098); outputs scale by ``length_scale``. An output of 0 tokens (4
rows of the agentic trace) replays as 1: an engine always generates one.

**Packaged traces.** ``packaged_trace_path("agentic_coding_dev")`` is a trace of 37 real
agentic-coding sessions shipped in ``dualpath/workload/data`` (its README gives origin, licence
and how the rows were selected); ``bench --preset agentic`` replays it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dualpath.workload.tokens import allowed_token_ids, random_token_ids
from dualpath.workload.types import Session, Turn, Workload

TRACE_BLOCK_SIZE_TOKENS = 512  # Mooncake's hash block; both traces in shared/traces use it
_DATA_DIR = Path(__file__).parent / "data"  # traces shipped with the package (its README.md)


class TraceFormatError(ValueError):
    """A trace line that breaks the Mooncake format; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One validated line of a trace."""

    line_no: int  # 1-based, for messages
    timestamp_s: float
    input_tokens: int
    output_tokens: int  # may be 0 in a trace
    hash_ids: tuple[int, ...]
    session_id: str | None  # None: a trace without sessions
    turn: int | None


def load_mooncake_trace(
    path: str | Path,
    *,
    vocab_size: int,
    seed: int = 0,
    avoid_token_ids: Iterable[int] = (),
    block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS,
    max_sessions: int | None = None,
    length_scale: float = 1.0,
) -> Workload:
    """The trace's sessions in arrival order (file order on ties), the first ``max_sessions``
    of them. The whole file is validated even when fewer sessions are kept."""
    if max_sessions is not None and max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    if not 0 < length_scale <= 1:
        raise ValueError(f"length_scale must be in (0, 1], got {length_scale}")
    rows = read_trace_rows(path, block_size_tokens=block_size_tokens)
    groups: dict[str, list[TraceRow]] = {}
    for row in rows:
        groups.setdefault(row.session_id or f"line{row.line_no}", []).append(row)
    ordered = sorted(groups.items(), key=lambda item: (item[1][0].timestamp_s, item[1][0].line_no))
    geometry = _Geometry(block_size_tokens, max(1, round(block_size_tokens * length_scale)))
    blocks = _BlockTokens(
        seed, geometry.scaled_block_tokens, allowed_token_ids(vocab_size, avoid_token_ids)
    )
    sessions = [
        _session(session_id, session_rows, geometry, length_scale, blocks)
        for session_id, session_rows in ordered[:max_sessions]
    ]
    return Workload(
        tuple(sessions),
        f"mooncake {path} seed={seed} length_scale={length_scale} max_sessions={max_sessions}",
    )


def packaged_trace_path(name: str) -> Path:
    """The path of a trace shipped in ``dualpath/workload/data`` (``name`` without
    ``.jsonl``); ``ValueError`` naming the ones there for another name."""
    path = _DATA_DIR / f"{name}.jsonl"
    if not path.is_file():
        shipped = sorted(p.stem for p in _DATA_DIR.glob("*.jsonl"))
        raise ValueError(f"no packaged trace {name!r}; shipped: {', '.join(shipped) or 'none'}")
    return path


def read_trace_rows(
    path: str | Path, *, block_size_tokens: int = TRACE_BLOCK_SIZE_TOKENS
) -> list[TraceRow]:
    """Every row of the file, validated; ``TraceFormatError`` at the first bad line, and
    ``ValueError`` naming the path for a file that cannot be read (missing, a directory)."""
    if block_size_tokens < 1:
        raise ValueError(f"block_size_tokens must be >= 1, got {block_size_tokens}")
    rows: list[TraceRow] = []
    next_turn: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as file:
            for line_no, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                row = _parse_row(line, line_no, f"{path}:{line_no}", block_size_tokens)
                _check_order(row, rows, next_turn, f"{path}:{line_no}")
                rows.append(row)
    except OSError as exc:  # missing, a directory, unreadable: the path is the input's fault
        raise ValueError(f"trace {path}: cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: not UTF-8 text, so not a JSONL trace ({exc})") from exc
    if not rows:
        raise TraceFormatError(f"{path}: no rows")
    return rows


def _check_order(
    row: TraceRow, rows: list[TraceRow], next_turn: dict[str, int], where: str
) -> None:
    """``TraceFormatError`` unless ``row`` may follow ``rows``: one format for the whole file,
    and each session's turns 0, 1, 2, ... in order (``next_turn``: each session's next)."""
    if rows and (row.session_id is None) != (rows[0].session_id is None):
        raise TraceFormatError(
            f"{where}: rows with and without session_id/turn are mixed "
            f"(line {rows[0].line_no} sets the file's format)"
        )
    if row.session_id is not None:
        expected = next_turn.get(row.session_id, 0)
        if row.turn != expected:
            problem = "duplicate or out-of-order" if row.turn < expected else "skips to"
            raise TraceFormatError(
                f"{where}: session {row.session_id!r} {problem} turn {row.turn}; "
                f"expected turn {expected}"
            )
        next_turn[row.session_id] = expected + 1


def _parse_row(line: str, line_no: int, where: str, block_size_tokens: int) -> TraceRow:
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(fields, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(fields).__name__}")
    timestamp_ms = _field(fields, "timestamp", (int, float), where)
    if not math.isfinite(timestamp_ms) or timestamp_ms < 0:
        raise TraceFormatError(f"{where}: timestamp must be finite and >= 0, got {timestamp_ms}")
    input_tokens = _field(fields, "input_length", int, where)
    output_tokens = _field(fields, "output_length", int, where)
    if input_tokens < 1 or output_tokens < 0:
        raise TraceFormatError(
            f"{where}: need input_length >= 1 and output_length >= 0, got {input_tokens} "
            f"and {output_tokens}"
        )
    hash_ids = _field(fields, "hash_ids", list, where)
    if not all(type(h) is int for h in hash_ids) or (hash_ids and min(hash_ids) < 0):
        raise TraceFormatError(f"{where}: hash_ids must be ints >= 0")
    num_blocks = -(-input_tokens // block_size_tokens)
    if len(hash_ids) != num_blocks:
        amount = "too few" if len(hash_ids) < num_blocks else "too many"
        raise TraceFormatError(
            f"{where}: {len(hash_ids)} hash_ids are {amount} for input_length {input_tokens}: "
            f"it needs ceil({input_tokens} / {block_size_tokens}) = {num_blocks}"
        )
    if ("session_id" in fields) != ("turn" in fields):
        raise TraceFormatError(f"{where}: session_id and turn come together or not at all")
    session_id = turn = None
    if "session_id" in fields:
        session_id = _field(fields, "session_id", str, where)
        turn = _field(fields, "turn", int, where)
        if turn < 0:
            raise TraceFormatError(f"{where}: turn must be >= 0, got {turn}")
    return TraceRow(
        line_no, timestamp_ms / 1000, input_tokens, output_tokens, tuple(hash_ids), session_id, turn
    )


def _field(fields: dict, name: str, kind: type | tuple[type, ...], where: str):
    if name not in fields:
        raise TraceFormatError(f"{where}: missing field {name!r}")
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TraceFormatError(f"{where}: {name} must be {names}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class _Geometry:
    block_tokens: int  # the trace's block size
    scaled_block_tokens: int

    def input_tokens(self, row: TraceRow) -> int:
        """The row's scaled prompt length: same block count, a proportional last block."""
        tail = row.input_tokens - (len(row.hash_ids) - 1) * self.block_tokens
        scaled_tail = max(1, round(tail * self.scaled_block_tokens / self.block_tokens))
        return (len(row.hash_ids) - 1) * self.scaled_block_tokens + scaled_tail


class _BlockTokens:
    """Token ids of hash blocks, each drawn once per load (memoized)."""

    def __init__(self, seed: int, block_tokens: int, allowed: np.ndarray) -> None:
        self._seed = seed
        self._block_tokens = block_tokens
        self._allowed = allowed
        self._hash_id_to_tokens: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        tokens = self._hash_id_to_tokens.get(hash_id)
        if tokens is None:
            rng = np.random.default_rng([self._seed, hash_id])
            tokens = random_token_ids(rng, self._block_tokens, self._allowed)
            self._hash_id_to_tokens[hash_id] = tokens
        return tokens

    def span(self, hash_ids: tuple[int, ...], start: int, stop: int) -> np.ndarray:
        """Tokens ``start:stop`` of the prompt made of ``hash_ids``' blocks."""
        if start >= stop:
            return np.zeros(0, dtype=np.int32)
        first, last = start // self._block_tokens, (stop - 1) // self._block_tokens
        tokens = np.concatenate([self.block(h) for h in hash_ids[first : last + 1]])
        offset = first * self._block_tokens
        return tokens[start - offset : stop - offset]


def _session(
    session_id: str,
    rows: list[TraceRow],
    geometry: _Geometry,
    length_scale: float,
    blocks: _BlockTokens,
) -> Session:
    """The module docstring's turn rule, row by row."""
    inputs = [geometry.input_tokens(row) for row in rows]
    outputs = [max(1, round(row.output_tokens * length_scale)) for row in rows]
    turns = [Turn(blocks.span(rows[0].hash_ids, 0, inputs[0]), outputs[0])]
    prompt_tokens = inputs[0]  # the replayed prompt length, P_i
    for i in range(1, len(rows)):
        previous, row = rows[i - 1], rows[i]
        shared_blocks = _common_prefix_length(previous.hash_ids, row.hash_ids)
        gap_s = max(0.0, row.timestamp_s - previous.timestamp_s)
        if shared_blocks >= len(previous.hash_ids) - 1:
            append_tokens = max(0, inputs[i] - prompt_tokens - outputs[i - 1])
            append = blocks.span(row.hash_ids, inputs[i] - append_tokens, inputs[i])
            turns.append(Turn(append, outputs[i], gap_s=gap_s))
            prompt_tokens += outputs[i - 1] + append_tokens
        else:
            keep_tokens = shared_blocks * geometry.scaled_block_tokens
            append = blocks.span(row.hash_ids, keep_tokens, inputs[i])
            turns.append(Turn(append, outputs[i], keep_prefix_tokens=keep_tokens, gap_s=gap_s))
            prompt_tokens = inputs[i]
    return Session(session_id, rows[0].timestamp_s, tuple(turns))


def _common_prefix_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))

"""What a workload replays, in SPEC §7's terms: turns, total, context, append and gen means.

Means are over sessions of a per-session quantity, as SPEC §7's table reads: a session's
append (gen) is its mean per turn, the first prompt counted as turn 1's append. Lengths come
from the replay rules, so the numbers hold for any workload, synthetic or trace.

**The hit bound** (``ideal_hit_ratio``) is what an infinite prefix cache of ``block_size``-token
blocks could hit on the prompts the replay sends, the bound a run's measured hit ratio is read
against. It replays every session's prompts in workload order (turn order within a session),
with each generated token a fresh id no prompt shares (the model's tokens are not known
before the run, and no other session could have them). A prompt hits its longest run of
leading whole blocks already cached, at most ``(P - 1) // block_size`` of them (the last prompt
token is always computed, as the engines do); a turn then caches every whole block of its
prompt and of its first g - 1 generated tokens (the last one's KV is never computed)::

    turn i:    [ prompt_i .................. ][ gen_i ]        cached: whole blocks of
                                                               prompt_i + gen_i[:-1]
    turn i+1:  [ prompt_i .................. ][ gen_i ][ append ]
               |<- hit: leading cached whole blocks, < P_(i+1) ->|

Unlike a trace's own hit ratio at its 512-token hash blocks, it sees what the replay sends:
cut turns, scaled lengths, clones' fresh prefixes, outputs the replay keeps.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from dualpath.workload.types import Session, Workload

# The engines' KV block (EngineConfig.block_size_tokens), the unit of every hit.
DEFAULT_BLOCK_SIZE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    num_sessions: int
    turns: float  # mean turns per session
    total_tokens: float  # mean final context: the last prompt plus the last output
    context_tokens: float  # mean over sessions of the mean prompt over their turns
    append_tokens: float  # mean over sessions of the mean tokens appended per turn
    gen_tokens: float  # mean over sessions of the mean tokens generated per turn
    max_total_tokens: int  # the longest session's final context
    max_prompt_tokens: int  # the longest prompt of any turn
    # The hit ratio of an infinite prefix cache of ``block_size_tokens`` blocks that keeps
    # generated KV (module docstring): the bound of a run's measured hit ratio.
    ideal_hit_ratio: float
    block_size_tokens: int  # the cache block ``ideal_hit_ratio`` counts in


def workload_stats(
    workload: Workload, *, block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
) -> WorkloadStats:
    turns, totals, contexts, appends, gens = [], [], [], [], []
    for session in workload.sessions:
        prompts = session.prompt_lengths_tokens()
        outputs = [t.output_tokens for t in session.turns]
        turns.append(session.num_turns)
        totals.append(prompts[-1] + outputs[-1])
        contexts.append(np.mean(prompts))
        appends.append(np.mean([t.num_append_tokens for t in session.turns]))
        gens.append(np.mean(outputs))
    return WorkloadStats(
        num_sessions=workload.num_sessions,
        turns=float(np.mean(turns)),
        total_tokens=float(np.mean(totals)),
        context_tokens=float(np.mean(contexts)),
        append_tokens=float(np.mean(appends)),
        gen_tokens=float(np.mean(gens)),
        max_total_tokens=int(max(totals)),
        max_prompt_tokens=max(max(s.prompt_lengths_tokens()) for s in workload.sessions),
        ideal_hit_ratio=ideal_hit_ratio(workload, block_size_tokens=block_size_tokens),
        block_size_tokens=block_size_tokens,
    )


def ideal_hit_ratio(
    workload: Workload, *, block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
) -> float:
    """Σ hit tokens / Σ prompt tokens of an infinite cache of ``block_size_tokens`` blocks
    (module docstring)."""
    if block_size_tokens < 1:
        raise ValueError(f"block_size_tokens must be >= 1, got {block_size_tokens}")
    cached: set[bytes] = set()
    generated = _FreshIds()
    hit_tokens = prompt_tokens = 0
    for session in workload.sessions:
        known: tuple[np.ndarray, list[bytes]] = (np.zeros(0, dtype=np.int64), [])
        for prompt, context in _prompts_and_contexts(session, generated):
            digests = _block_digests(context, block_size_tokens, known)
            known = (context, digests)
            max_blocks = (prompt.size - 1) // block_size_tokens
            num_hit = 0
            while num_hit < max_blocks and digests[num_hit] in cached:
                num_hit += 1
            hit_tokens += num_hit * block_size_tokens
            prompt_tokens += prompt.size
            cached.update(digests)
    return hit_tokens / prompt_tokens


class _FreshIds:
    """Token ids no prompt holds (negative), for the tokens a replay generates."""

    def __init__(self) -> None:
        self._next = -1

    def take(self, num_tokens: int) -> np.ndarray:
        ids = np.arange(self._next, self._next - num_tokens, -1, dtype=np.int64)
        self._next -= num_tokens
        return ids


def _prompts_and_contexts(session: Session, generated: _FreshIds):
    """Each turn's prompt and the context whose KV it computes (prompt + gen[:-1]), by the
    replay rules of ``replay.next_prompt`` on int64 arrays."""
    prompt = session.turns[0].append_token_ids.astype(np.int64)
    output = generated.take(session.turns[0].output_tokens)
    yield prompt, np.concatenate([prompt, output[:-1]])
    for turn in session.turns[1:]:
        kept = turn.keep_prefix_tokens
        head = np.concatenate([prompt, output]) if kept is None else prompt[:kept]
        prompt = np.concatenate([head, turn.append_token_ids])
        output = generated.take(turn.output_tokens)
        yield prompt, np.concatenate([prompt, output[:-1]])


def _block_digests(
    token_ids: np.ndarray, block_size_tokens: int, known: tuple[np.ndarray, list[bytes]]
) -> list[bytes]:
    """Prefix-chained digests of the array's whole blocks: equal digests at block k mean equal
    tokens up to its end, as the store's block keys. ``known`` is an earlier array and its
    digests: those of the blocks both arrays start with are reused."""
    known_ids, known_digests = known
    length = min(token_ids.size, known_ids.size)
    differ = np.flatnonzero(token_ids[:length] != known_ids[:length])
    num_same_blocks = (int(differ[0]) if differ.size else length) // block_size_tokens
    digests = known_digests[:num_same_blocks]
    previous = digests[-1] if digests else b""
    first = num_same_blocks * block_size_tokens
    for start in range(first, token_ids.size - block_size_tokens + 1, block_size_tokens):
        block = token_ids[start : start + block_size_tokens].tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        digests.append(previous)
    return digests

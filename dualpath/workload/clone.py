"""More sessions from fewer: the paper's cloning rule (SPEC §7).

A clone copies a session and prepends a fresh first turn of random tokens that generates 1
token. Its every prompt then starts with tokens no other session has, so under prefix-chained
block hashes clones share no cache block with each other or with the original: hits stay
within a trajectory. The clone's later turns share the original's append token arrays; a trace
turn that keeps a prompt prefix (``Turn.keep_prefix_tokens``) keeps ``prefix_tokens + 1`` more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from dualpath.workload.tokens import allowed_token_ids, random_token_ids
from dualpath.workload.types import Session, Turn, Workload

# One Full Block of the store's default size (KVStoreConfig.block_size_tokens): the clone's first
# block is all fresh tokens, so it differs even under a hash that is not prefix-chained.
DEFAULT_CLONE_PREFIX_TOKENS = 64


def clone_sessions(
    workload: Workload,
    num_sessions: int,
    *,
    seed: int,
    vocab_size: int,
    avoid_token_ids: Iterable[int] = (),
    prefix_tokens: int = DEFAULT_CLONE_PREFIX_TOKENS,
) -> Workload:
    """``num_sessions`` sessions: the originals unchanged, then clones of originals 0, 1, ...
    in turn (round robin), each with its own fresh prefix turn and its original's arrival.

    A clone has one more turn and ``prefix_tokens + 1`` more context than its original, which
    a caller near the model's max length must leave room for. ``ValueError`` if
    ``num_sessions`` is below the number of originals.
    """
    originals = workload.sessions
    if num_sessions < len(originals):
        raise ValueError(
            f"num_sessions ({num_sessions}) is below the workload's {len(originals)} sessions"
        )
    if prefix_tokens < 1:
        raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
    allowed = allowed_token_ids(vocab_size, avoid_token_ids)
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    sessions = list(originals)
    for index in range(num_sessions - len(originals)):
        original = originals[index % len(originals)]
        prefix = Turn(random_token_ids(rng, prefix_tokens, allowed), output_tokens=1)
        sessions.append(
            Session(
                f"{original.session_id}+clone{index // len(originals)}",
                original.arrival_s,
                (prefix, *(_shifted(t, prefix_tokens + 1) for t in original.turns)),
            )
        )
    return Workload(tuple(sessions), f"{workload.source} cloned to {num_sessions} seed={seed}")


def _shifted(turn: Turn, num_tokens: int) -> Turn:
    if turn.keep_prefix_tokens is None:
        return turn
    return dataclasses.replace(turn, keep_prefix_tokens=turn.keep_prefix_tokens + num_tokens)

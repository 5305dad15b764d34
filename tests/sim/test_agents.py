"""Agents from a workload: hits within a session, and first prompts that share a prefix with
an earlier session's (found by content, as the store finds them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dualpath.sim.agents import workload_agents
from dualpath.workload import Session, Turn, Workload, load_mooncake_trace

SHARED_ROWS = Path(__file__).resolve().parents[1] / "workload" / "data" / "mooncake_shared.jsonl"


def _session(name: str, arrival_s: float, tokens: np.ndarray, *more: Turn) -> Session:
    return Session(name, arrival_s, (Turn(tokens, 4), *more))


def _hits(*sessions: Session) -> list[tuple[int, ...]]:
    agents = workload_agents(Workload(sessions, "test"), block_size_tokens=64)
    return [agent.hit_tokens for agent in agents]


def test_a_first_prompt_hits_the_full_blocks_an_earlier_session_stored():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 1000, 200)  # 3 full blocks + 8 tokens
    one = np.concatenate([shared, rng.integers(0, 1000, 100)])
    two = np.concatenate([shared, rng.integers(0, 1000, 40)])
    assert _hits(_session("a", 0.0, one), _session("b", 1.0, two)) == [(0,), (192,)]
    # Arrival decides who stored first, not the order of the list.
    assert _hits(_session("a", 2.0, one), _session("b", 1.0, two)) == [(192,), (0,)]
    # Unrelated content shares nothing; a repeated prompt keeps its last token to compute.
    other = rng.integers(0, 1000, 300)
    assert _hits(_session("a", 0.0, one), _session("b", 0.0, other)) == [(0,), (0,)]
    exact = shared[:128]
    assert _hits(_session("a", 0.0, exact), _session("b", 1.0, exact.copy())) == [(0,), (64,)]


def test_later_turns_keep_the_within_session_rule():
    rng = np.random.default_rng(1)
    first = rng.integers(0, 1000, 130)
    later = Turn(rng.integers(0, 1000, 50), 4)
    (hits,) = _hits(_session("a", 0.0, first, later))
    assert hits == (0, 128)  # 130 + 4 tokens with KV, less the last: 2 full blocks


def test_mooncake_rows_share_prefixes_across_requests_as_their_hash_ids_say():
    path = SHARED_ROWS  # rows 49, 58 and 61 share leading blocks with earlier rows
    agents = workload_agents(load_mooncake_trace(path, vocab_size=32_000), block_size_tokens=64)
    rows = sorted(
        (json.loads(line) for line in path.read_text().splitlines() if line.strip()),
        key=lambda row: row["timestamp"],
    )
    # Independently, from the ids: each row's leading 512-token blocks seen in an earlier row.
    seen: set[int] = set()
    expected = 0
    for row in rows:
        ids = row["hash_ids"]
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        expected += min(n, (row["input_length"] - 1) // 512) * 512
        seen.update(ids)
    ours = sum(agent.hit_tokens[0] for agent in agents)
    assert expected == (57 + 5 + 28) * 512
    # 64-token blocks also find the shared part of a partial 512-token block.
    assert expected <= ours <= expected + 448 * len(rows)
    assert all(a.hit_tokens[0] < a.prompt_tokens[0] for a in agents)

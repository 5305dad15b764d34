"""Agent sessions through a real `dualpath serve` and the official `openai` client.

1P2D: a session's turns land on one decode engine (the server log names each session
request's engine and outcome) and /metrics counts the sessions, their requests, prompt tokens
and store hits. 1P1D with a store of 12 blocks: a session's blocks outlive capacity pressure
that evicts another conversation's older blocks, so its next turn hits all of them. Each server
is its module's (one per fixture); token-id prompts, greedy, ``ignore_eos``: exact lengths.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dualpath.kv.block_file import HEADER_BYTES, block_file_path
from dualpath.kv.hashing import block_keys
from dualpath.model.identity import checkpoint_kv_identity
from tests.server.serving import MODEL, Server, metric_values, random_ids, start_server

pytest.importorskip("nixl_cu12")

BLOCK_SIZE_TOKENS = 64  # serve's default
HEARTBEAT_TIMEOUT_S = 120  # a loaded machine must not see an engine as dead
PERSIST_WAIT_S = 120  # a turn waits for the last one's blocks, however long their writes take
BUDGET_S = 60  # waits end as soon as what they wait for has happened: only a hang guard
SESSION_LOG = re.compile(r"session '([\w-]+)': decode engine (\d+) \((\w+)\)")


SAME_DE = ("dualpath_session_affinity_total", (("outcome", "same_de"),))


def wait_until(server: Server, is_done) -> dict:
    """/metrics' values once ``is_done(values)`` (engines report, and the scheduler publishes
    its snapshot, every fraction of a second)."""
    deadline_s = time.monotonic() + BUDGET_S
    while True:
        values = metric_values(server)
        if is_done(values):
            return values
        assert time.monotonic() < deadline_s, "/metrics never showed it"
        time.sleep(0.1)


def complete(server: Server, prompt: list[int], max_tokens: int, **kwargs) -> tuple[list, int]:
    """(generated token ids, cached prompt tokens) of one greedy completion."""
    out = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **kwargs.pop("body", {})},
        **kwargs,
    )
    token_ids = list(out.choices[0].token_ids)
    assert len(token_ids) == max_tokens
    return token_ids, out.usage.prompt_tokens_details.cached_tokens


# --- 1P2D: the same decode engine, and the metrics ---------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve-sessions")
    with start_server(
        tiny_model_dir,
        root,
        "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
        "--persist-wait-s", str(PERSIST_WAIT_S),
    ) as started:  # fmt: skip
        yield started


def test_a_sessions_turns_land_on_one_decode_engine_and_are_counted(server: Server) -> None:
    # Session "a" names itself by header, "b" by Dynamo's header, "c" by vLLM's body field.
    # Each round sends its sessions' turns at once, so that the policy alone would spread
    # them over both engines as their loads come (the scheduler's own tests pin that down).
    named = {
        "a": {"extra_headers": {"X-Session-Id": "agent-a"}},
        "b": {"extra_headers": {"X-Dynamo-Session-ID": "agent-b"}},
        "c": {"body": {"session_id": "agent-c"}},
    }
    prompts = {name: random_ids(150, seed) for seed, name in enumerate(named, start=1)}
    rounds = ["abc", "abc", "ac", "a"]
    num_prompt_tokens = num_cached_tokens = 0
    with ThreadPoolExecutor(len(named)) as pool:
        for number, names in enumerate(rounds):
            turns = {
                name: pool.submit(complete, server, prompts[name], 8, **dict(named[name]))
                for name in names
            }
            for name, turn in turns.items():
                output, cached = turn.result()
                num_prompt_tokens += len(prompts[name])
                num_cached_tokens += cached
                if number:  # a later turn finds the earlier turns' blocks in the store
                    assert cached >= BLOCK_SIZE_TOKENS, (name, number)
                prompts[name] += output + random_ids(40, 10 * number + len(name))
    complete(server, random_ids(150, 50), 8)  # no session: counted nowhere below
    placements = SESSION_LOG.findall(server.log)  # (session, engine, outcome), as placed
    for name in named:
        of_session = [
            (engine, outcome) for s, engine, outcome in placements if s == f"agent-{name}"
        ]
        num_turns = sum(name in names for names in rounds)
        assert [outcome for _, outcome in of_session] == ["first"] + ["same_de"] * (num_turns - 1)
        assert len({engine for engine, _ in of_session}) == 1, of_session
    # The scheduler's series come from its latest snapshot (republished every 0.1 s).
    values = wait_until(server, lambda v: v.get(SAME_DE, 0) == 6)
    assert values[("dualpath_sessions_active", ())] == 3
    affinity = {
        outcome: values[("dualpath_session_affinity_total", (("outcome", outcome),))]
        for outcome in ("first", "same_de", "moved")
    }
    assert affinity == {"first": 3, "same_de": 6, "moved": 0}
    assert values[("dualpath_session_requests_total", ())] == 9
    assert values[("dualpath_session_prompt_tokens_total", ())] == num_prompt_tokens
    assert values[("dualpath_session_cached_tokens_total", ())] == num_cached_tokens


def test_a_session_id_in_the_body_and_another_in_a_header_are_a_400(server: Server) -> None:
    response = server.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1, "session_id": "x"},
        headers={"X-Session-Id": "y"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "session_id"


# --- 1P1D: the session's blocks outlive capacity pressure --------------------------------------

STORE_BLOCKS = 12


@pytest.fixture(scope="module")
def small_store_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    _, identity = checkpoint_kv_identity(tiny_model_dir, None, BLOCK_SIZE_TOKENS)
    block_file_bytes = HEADER_BYTES + identity.layout.full_block_bytes
    capacity_gb = (STORE_BLOCKS + 0.5) * block_file_bytes / 1e9
    root = tmp_path_factory.mktemp("serve-retention")
    with start_server(
        tiny_model_dir,
        root,
        "--nodes", "1P1D",
        "--kv-store-capacity-gb", repr(capacity_gb),
        "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
        "--persist-wait-s", str(PERSIST_WAIT_S),
    ) as started:  # fmt: skip
        yield started


def test_a_sessions_blocks_outlive_pressure_that_evicts_older_ones(
    small_store_server: Server,
) -> None:
    server = small_store_server
    session = {"extra_headers": {"X-Session-Id": "agent"}}
    # The session's turn, then another conversation's: 300 + 40 tokens, 5 full blocks each,
    # the session's the least recently used.
    agent, other = random_ids(300, 1), random_ids(300, 2)
    agent_output, _ = complete(server, agent, 40, **session)
    other_output, _ = complete(server, other, 40)
    # Four more prompts of 4 blocks each: 26 blocks written into a store of 12. Plain LRU would
    # take the session's 5 blocks first, then the other conversation's.
    for seed in range(3, 7):
        complete(server, random_ids(300, seed), 1)
    fingerprint = next(p.name for p in (server.root / "kv").iterdir() if p.is_dir())
    other_root = block_keys(other[:BLOCK_SIZE_TOKENS], BLOCK_SIZE_TOKENS, fingerprint)[0]
    other_root_path = block_file_path(server.root / "kv", fingerprint, other_root)
    deadline_s = time.monotonic() + BUDGET_S
    while other_root_path.exists():  # (writes are write-behind: evictions follow them)
        assert time.monotonic() < deadline_s, "the other conversation's blocks were kept"
        time.sleep(0.05)
    _, agent_cached = complete(server, agent + agent_output + random_ids(60, 7), 1, **session)
    _, other_cached = complete(server, other + other_output + random_ids(60, 8), 1)
    assert agent_cached == 5 * BLOCK_SIZE_TOKENS
    assert other_cached == 0
    values = wait_until(server, lambda v: v.get(("dualpath_store_evictions_total", ()), 0) > 0)
    assert values[("dualpath_store_retained_evictions_total", ())] == 0

"""`dualpath serve --engine vllm` on the embedded checkpoint: token-id prompts of 300-4,000 tokens
give plain vLLM's greedy tokens (its own `LLM`, no connector) on 1P1D and 1P2D, cold, warm
(hits read from the store) and after the server is restarted on the same store; a chat's
turn 2 finds turn 1 in the store. A first difference is accepted only where plain vLLM's top
two tokens were within 1e-3 in logprob (vLLM need not be bit-exact between a cached and an
uncached prefill), and counted."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.server.serving import MODEL, Server, metric_values, start_server
from tests.vllm.reference import near_ties, plain_vllm

pytestmark = pytest.mark.vllm

CONTEXT = 4160  # 4,000-token prompts + output, in whole 64-token blocks
PROMPT_LENGTHS = (300, 700, 1200, 1800, 2400, 3000, 3500, 4000)
MAX_TOKENS = 8
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, float32: layers x K,V x heads x dims
SERVE_ARGS = ("--engine", "vllm", "--read-path", "pe", "--max-model-len", str(CONTEXT))


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(100, 40_000, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(smollm2_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    requests = [(prompt, MAX_TOKENS) for prompt in _prompts()]
    return plain_vllm(smollm2_model_dir, CONTEXT, requests, tmp_path_factory.mktemp("reference"))


def _read_bytes(server: Server, *, until: float | None = None) -> float:
    """Hit KV the server's engines read from the store so far (/metrics, both sides); with
    ``until``, waits (60 s at most) for the engines' periodic reports to reach that figure."""
    deadline = time.monotonic() + 60
    while True:
        value = sum(
            value
            for (name, _), value in metric_values(server).items()
            if name == "dualpath_read_path_bytes_total"
        )
        if until is None or value == until or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def _replay(server: Server, references: list[dict], label: str, *, is_warm: bool) -> int:
    """Near ties met; every prompt's tokens checked against plain vLLM's, and its cached
    tokens: all its full blocks when warm (from the store, or vLLM's own prefix cache)."""
    client = server.client.with_options(timeout=600)
    num_ties = 0
    for prompt, reference in zip(_prompts(), references, strict=True):
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        num_ties += near_ties(reference, out.choices[0].token_ids, f"{label} {len(prompt)}")
        cached = out.usage.prompt_tokens_details.cached_tokens
        assert cached == ((len(prompt) - 1) // 64 * 64 if is_warm else 0), (label, len(prompt))
    return num_ties


@pytest.mark.parametrize("nodes", ["1P1D", "1P2D"])
def test_served_tokens_are_plain_vllms_cold_warm_and_after_a_restart(
    nodes: str, smollm2_model_dir: Path, references: list[dict], tmp_path: Path
) -> None:
    args = (*SERVE_ARGS, "--nodes", nodes)
    num_ties = 0
    with start_server(smollm2_model_dir, tmp_path, *args) as server:
        num_ties += _replay(server, references, f"{nodes} cold", is_warm=False)
        assert _read_bytes(server) == 0
        num_ties += _replay(server, references, f"{nodes} warm", is_warm=True)
        # The PE's vLLM still holds most prompts: those blocks are not read from the store.
        cached_bytes = sum((n - 1) // 64 * 64 for n in PROMPT_LENGTHS) * KV_BYTES_PER_TOKEN
        assert _read_bytes(server) < cached_bytes
    with start_server(smollm2_model_dir, tmp_path, *args) as server:  # the same store
        num_ties += _replay(server, references, f"{nodes} restarted", is_warm=True)
        # A new engine holds nothing: every hit block is read from the store, once.
        read_bytes = _read_bytes(server, until=cached_bytes)
        assert read_bytes == cached_bytes, "the PE did not read the hits it reported"
    print(f"{nodes}: {num_ties} near-tie difference(s) in {3 * len(PROMPT_LENGTHS)} prompts")


def test_turn_two_of_a_chat_finds_turn_one_in_the_store(
    smollm2_model_dir: Path, tmp_path: Path
) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()[:4000]
    messages = [{"role": "user", "content": f"{readme}\n\nIn one sentence, what is this?"}]
    with start_server(smollm2_model_dir, tmp_path, *SERVE_ARGS, "--nodes", "1P1D") as server:
        client = server.client.with_options(timeout=600)
        first = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=48
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And what does `make test` do?"},
        ]
        second = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=8
        )
    turn_one = first.usage.prompt_tokens + first.usage.completion_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 1000 and cached >= 0.9 * turn_one, (cached, turn_one)

"""The DE read path on vLLM engines: `dualpath serve --engine vllm --nodes 1P2D` replays 8
conversations of 3 turns (token ids, greedy) with the hit KV read by the PE (`--read-path pe`),
by the DE (`de`, pulled layer by layer by the PE's connector) and by both (`split`). Every path
gives the same tokens, and plain vLLM's (its own `LLM`, no connector; a first difference only
at a near tie of its top two, counted). The DE side reads on `de` and `split` and not on
`pe`; on every path the two sides' reads plus the hit KV the PE's vLLM still held (not read
again) are exactly the cached tokens' KV."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.server.serving import MODEL, Server, metric_values, start_server
from tests.vllm.reference import near_ties, plain_vllm

pytestmark = pytest.mark.vllm

CONTEXT = 2048
NUM_SESSIONS, NUM_TURNS, MAX_TOKENS = 8, 3, 8
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, float32: layers x K,V x heads x dims
READ_SERIES = ("dualpath_read_path_bytes_total", "dualpath_engine_cached_bytes_total")


def _openings() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(100, 40_000, 200 + 90 * s).tolist() for s in range(NUM_SESSIONS)]


def _new_user_tokens(session: int, turn: int) -> list[int]:
    return np.random.default_rng(100 * session + turn).integers(100, 40_000, 70).tolist()


def _replay(server: Server) -> tuple[dict, dict, int]:
    """Every turn of every session, one request at a time; each turn's prompt is the last
    one, its answer and new user tokens. (prompts, tokens, cached tokens in all)."""
    client = server.client.with_options(timeout=600)
    prompts, tokens, num_cached = {}, {}, 0
    contexts = _openings()
    for turn in range(NUM_TURNS):
        for session in range(NUM_SESSIONS):
            prompt = contexts[session]
            out = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            answer = list(out.choices[0].token_ids)
            prompts[session, turn], tokens[session, turn] = prompt, answer
            num_cached += out.usage.prompt_tokens_details.cached_tokens
            contexts[session] = prompt + answer + _new_user_tokens(session, turn)
    return prompts, tokens, num_cached


def _reads(server: Server, expected_bytes: int) -> dict[str, float]:
    """Hit KV per side (``prefill``, ``decode``) and held by the engine (``engine``), once the
    engines' periodic reports add up to ``expected_bytes`` (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        reads = {"prefill": 0.0, "decode": 0.0, "engine": 0.0}
        for (name, labels), value in metric_values(server).items():
            if name == READ_SERIES[0]:
                reads[dict(labels)["side"]] += value
            elif name == READ_SERIES[1]:
                reads["engine"] += value
        if sum(reads.values()) == expected_bytes or time.monotonic() > deadline:
            return reads


def test_every_read_path_gives_the_same_tokens_and_reads_each_hit_once(
    smollm2_model_dir: Path, tmp_path: Path
) -> None:
    tokens_by_path, reads_by_path = {}, {}
    for read_path in ("pe", "de", "split"):
        root = tmp_path / read_path
        root.mkdir()
        args = ("--engine", "vllm", "--nodes", "1P2D", "--read-path", read_path)
        with start_server(
            smollm2_model_dir, root, *args, "--max-model-len", str(CONTEXT)
        ) as server:
            prompts, tokens, num_cached = _replay(server)
            assert num_cached > 0, read_path
            reads = _reads(server, num_cached * KV_BYTES_PER_TOKEN)
        assert sum(reads.values()) == num_cached * KV_BYTES_PER_TOKEN, (read_path, reads)
        tokens_by_path[read_path], reads_by_path[read_path] = tokens, reads
        if read_path == "pe":
            pe_prompts = prompts
    print({path: {side: int(b) for side, b in r.items()} for path, r in reads_by_path.items()})
    assert reads_by_path["pe"]["decode"] == 0
    assert reads_by_path["de"]["decode"] > 0 and reads_by_path["de"]["prefill"] == 0
    # (The PE side's share of a split is mostly in the PE's vLLM already: later turns of a
    # session find their earlier prompts there. A load of both PE-read and DE-read blocks is
    # tests/vllm/test_connector.py's.)
    assert reads_by_path["split"]["decode"] > 0
    assert tokens_by_path["de"] == tokens_by_path["pe"]
    assert tokens_by_path["split"] == tokens_by_path["pe"]

    keys = sorted(pe_prompts)
    references = plain_vllm(
        smollm2_model_dir,
        CONTEXT,
        [(pe_prompts[key], MAX_TOKENS) for key in keys],
        tmp_path,
    )
    num_ties = sum(
        near_ties(reference, tokens_by_path["pe"][key], f"session {key[0]} turn {key[1]}")
        for key, reference in zip(keys, references, strict=True)
    )
    print(f"{num_ties} near-tie difference(s) from plain vLLM in {len(keys)} turns")

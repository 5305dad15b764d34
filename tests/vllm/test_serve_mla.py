"""`dualpath serve --engine vllm` on the paper's model family: DeepSeek-V3 in miniature
(``tiny-deepseek-v3``: MLA, one 576-value latent + rope entry a token, MoE), on vLLM's CPU MLA
pages (``CPU_MLA``: 16-token blocks, no prefix cache of its own), which the servers choose
themselves (no ``--block-size``). Three 1P1D servers in turn, on one store:

- ``--read-path pe`` on a new store: token-id prompts of 300-4,000 tokens give plain vLLM's
  greedy tokens cold, then warm with every hit read on the prefill side;
- ``--read-path de``, restarted on that store: the same tokens, every hit read on the decode
  side and pulled layer by layer into the PE's MLA pages;
- ``--read-path split``, restarted again: the same tokens, the hits read by both sides.

On every server the sides' reads add up to exactly the prompts' full blocks of KV (vLLM holds
none of its own). A first difference from plain vLLM is accepted only at a near tie of its top
two tokens (``near_ties``). Blocks of another size (``--block-size 64``) are refused before any
engine starts.

One decode engine is enough for every check here (each path's reads are one PE's and one DE's),
and plain vLLM's engine loads while the first server starts.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.server.serving import MODEL, Server, metric_values, start_server
from tests.vllm.reference import PlainVllm, near_ties

pytestmark = pytest.mark.vllm

BLOCK = 16  # vLLM's CPU_MLA pages hold 16 tokens: the store's blocks are theirs
CONTEXT = 4096
KV_BYTES_PER_TOKEN = 4 * 576 * 4  # layers x (latent 512 + rope 64) x float32
PROMPT_LENGTHS = (300, 1700, 4000)
MAX_TOKENS = 8
HANG_GUARD_S = 600
READ_SERIES = "dualpath_read_path_bytes_total"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three servers' store and logs."""
    return tmp_path_factory.mktemp("mla")


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 1024, n).tolist() for n in PROMPT_LENGTHS]


class Reference:
    """Plain vLLM's tokens for ``_prompts()`` (its own ``LLM`` on the same backend, no
    connector): its engine starts loading at construction, answers once when first asked,
    and is closed then (its memory is the next servers')."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self._engine = PlainVllm(model_dir, log_path, block_size=BLOCK)
        self._answers: list[dict] | None = None

    def answers(self) -> list[dict]:
        if self._answers is None:
            try:
                self._answers = self._engine.generate([(p, MAX_TOKENS) for p in _prompts()])
            finally:
                self._engine.close()
        return self._answers

    def close(self) -> None:
        self._engine.close()


@pytest.fixture(scope="module")
def reference(
    tiny_deepseek_v3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Reference]:
    log = tmp_path_factory.mktemp("mla-reference") / "vllm.log"
    started = Reference(tiny_deepseek_v3_dir, log)
    try:
        yield started
    finally:
        started.close()


def _serve(model_dir: Path, root: Path, read_path: str) -> Iterator[Server]:
    args = ("--engine", "vllm", "--nodes", "1P1D", "--read-path", read_path)
    args += ("--max-model-len", str(CONTEXT))  # no --block-size: the model's 16 (BLOCK)
    args += ("--heartbeat-timeout-s", "120")  # a long prefill on 2 busy cores; see test_serve
    with start_server(model_dir, root, *args) as server:
        yield server


def _replay(server: Server, references: list[dict], label: str, *, is_warm: bool) -> None:
    client = server.client.with_options(timeout=HANG_GUARD_S)
    num_ties = 0
    for prompt, reference in zip(_prompts(), references, strict=True):
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        num_ties += near_ties(reference, out.choices[0].token_ids, f"{label} {len(prompt)}")
        cached = out.usage.prompt_tokens_details.cached_tokens
        expected = (len(prompt) - 1) // BLOCK * BLOCK if is_warm else 0
        assert cached == expected, (label, len(prompt), cached)
    print(f"{label}: {num_ties} near-tie difference(s) in {len(PROMPT_LENGTHS)} prompts")


def _read_bytes(server: Server, total_bytes: float) -> dict[str, float]:
    """Hit KV read per side once the engines' reports add up to ``total_bytes`` (60 s at
    most: then as they are, for the caller's assertion to show)."""
    deadline = time.monotonic() + 60
    while True:
        reads = {"prefill": 0.0, "decode": 0.0}
        for (name, labels), value in metric_values(server).items():
            if name == READ_SERIES:
                reads[dict(labels)["side"]] += value
        if sum(reads.values()) == total_bytes or time.monotonic() > deadline:
            return reads
        time.sleep(0.1)


FULL_BLOCKS_BYTES = sum((n - 1) // BLOCK * BLOCK for n in PROMPT_LENGTHS) * KV_BYTES_PER_TOKEN


def test_prefill_side_reads_cold_then_warm(
    tiny_deepseek_v3_dir: Path, root: Path, reference: Reference
) -> None:
    for server in _serve(tiny_deepseek_v3_dir, root, "pe"):
        references = reference.answers()  # loaded while the server started
        _replay(server, references, "pe cold", is_warm=False)
        _replay(server, references, "pe warm", is_warm=True)
        reads = _read_bytes(server, FULL_BLOCKS_BYTES)
        assert reads == {"prefill": FULL_BLOCKS_BYTES, "decode": 0}, reads


def test_decode_side_reads_after_a_restart(
    tiny_deepseek_v3_dir: Path, root: Path, reference: Reference
) -> None:
    references = reference.answers()
    assert (root / "kv").is_dir(), "the prefill-side server fills the store this one reads"
    for server in _serve(tiny_deepseek_v3_dir, root, "de"):
        _replay(server, references, "de restarted", is_warm=True)
        reads = _read_bytes(server, FULL_BLOCKS_BYTES)
        assert reads == {"prefill": 0, "decode": FULL_BLOCKS_BYTES}, reads


def test_split_reads_after_a_restart(
    tiny_deepseek_v3_dir: Path, root: Path, reference: Reference
) -> None:
    references = reference.answers()
    assert (root / "kv").is_dir(), "the prefill-side server fills the store this one reads"
    for server in _serve(tiny_deepseek_v3_dir, root, "split"):
        _replay(server, references, "split restarted", is_warm=True)
        reads = _read_bytes(server, FULL_BLOCKS_BYTES)
        assert reads["prefill"] > 0 and reads["decode"] > 0, reads
        assert reads["prefill"] + reads["decode"] == FULL_BLOCKS_BYTES, reads


def test_other_blocks_than_vllms_mla_pages_are_refused_before_any_engine_starts(
    tiny_deepseek_v3_dir: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "dualpath.cli", "serve", "--engine", "vllm"]
    argv += ["--model", str(tiny_deepseek_v3_dir), "--kv-store", str(tmp_path / "kv")]
    argv += ["--block-size", "64"]  # without it, the model's own 16
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "pass --block-size 16" in result.stderr

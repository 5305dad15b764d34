"""`dualpath generate --engine vllm`: one vLLM engine in the command's process with the store
behind it. Run twice on one store, the second run reads the first one's blocks (every whole
block of its prompt but the last token's) and both give plain vLLM's greedy tokens (the
near-tie rule of ``reference.near_ties``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.vllm.reference import PlainVllm, near_ties

pytestmark = pytest.mark.vllm

CONTEXT = 2048
MAX_TOKENS = 12
BLOCK = 64


def _generate(model_dir: Path, store: Path, prompt: list[int]) -> dict:
    argv = [
        sys.executable, "-m", "dualpath.cli", "generate", "--engine", "vllm",
        "--model", str(model_dir), "--kv-store", str(store), "--threads", "1",
        "--max-model-len", str(CONTEXT), "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
        "--prompt-ids", ",".join(map(str, prompt)), "--json",
    ]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=900, check=False, env=dict(os.environ)
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_generate_on_vllm_reads_the_blocks_an_earlier_run_persisted(
    smollm2_model_dir: Path, plain_vllm: PlainVllm, tmp_path: Path
) -> None:
    prompt = np.random.default_rng(7).integers(100, 40_000, 1000).tolist()
    (reference,) = plain_vllm.generate([(prompt, MAX_TOKENS)])
    cold = _generate(smollm2_model_dir, tmp_path / "kv", prompt)
    warm = _generate(smollm2_model_dir, tmp_path / "kv", prompt)
    assert cold["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] == (len(prompt) - 1) // BLOCK * BLOCK
    num_ties = near_ties(reference, cold["token_ids"], "cold")
    num_ties += near_ties(reference, warm["token_ids"], "warm")
    print(f"{num_ties} near-tie difference(s) in 2 runs")

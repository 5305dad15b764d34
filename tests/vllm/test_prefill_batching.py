"""`dualpath serve --engine vllm --vllm-prefill-batching quota`: the PE hands vLLM one batch at a
time from the compute-quota batcher (its predictor profiled on vLLM at start). With a quota so
small that every batch holds one request, 6 prompts sent at once queue in the batcher and each
gives plain vLLM's greedy tokens (a first difference only at a near tie of its top two)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.server.serving import MODEL, start_server
from tests.vllm.reference import PlainVllm, near_ties

pytestmark = pytest.mark.vllm

CONTEXT = 1280
PROMPT_LENGTHS = (300, 450, 600, 750, 900, 1050)
MAX_TOKENS = 8


def test_quota_batches_give_plain_vllms_tokens(
    smollm2_model_dir: Path, plain_vllm: PlainVllm, tmp_path: Path
) -> None:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(100, 40_000, n).tolist() for n in PROMPT_LENGTHS]
    references = plain_vllm.generate([(p, MAX_TOKENS) for p in prompts])
    args = ("--engine", "vllm", "--nodes", "1P1D", "--max-model-len", str(CONTEXT))
    args += ("--vllm-prefill-batching", "quota", "--attention-quota-s", "0.00001")
    with start_server(smollm2_model_dir, tmp_path, *args) as server:
        client = server.client.with_options(timeout=600)

        def complete(prompt: list[int]) -> list[int]:
            out = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            return list(out.choices[0].token_ids)

        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(complete, prompts))
    for prompt, tokens, reference in zip(prompts, outputs, references, strict=True):
        near_ties(reference, tokens, f"prompt of {len(prompt)}")

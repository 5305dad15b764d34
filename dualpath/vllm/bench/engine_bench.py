"""vLLM's engine beside ours in ``dualpath bench engine --engines ours,transformers,vllm``
(``dualpath.bench.engine_bench`` loads it only when asked): vLLM 0.32's ``LLMEngine`` in the
benchmark's process, stepped there, on the same weights and prompts as ours."""

from __future__ import annotations

import os
import time

from dualpath.bench.engine_bench import EngineBenchConfig, Timing, Workload


class VllmEngine:
    """vLLM's ``LLMEngine`` in this process (eager, prefix caching off: every run prefills, no
    connector), stepped here; a step's tokens are stamped when the step returns."""

    def __init__(self, config: EngineBenchConfig, dtype: str) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise ValueError(
                "--engines ...,vllm needs vLLM installed: run it from .venv-vllm (`make "
                f"test-vllm` builds it): {exc}"
            ) from exc
        max_batch = max(config.batch_sizes)
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=str(config.model_dir),
                dtype=dtype,
                seed=config.seed,
                enforce_eager=True,
                enable_prefix_caching=False,
                disable_log_stats=True,
                max_num_seqs=max(64, max_batch),
                max_model_len=max(
                    config.prompt_tokens + 1, config.decode_prompt_tokens + config.decode_tokens
                ),
                # Every decode batch prefills in one step, as ours does.
                max_num_batched_tokens=max(
                    8192, config.prompt_tokens, max_batch * config.decode_prompt_tokens
                ),
            )
        )
        self._next_id = 0

    def run(self, prompts: list[list[int]], workload: Workload) -> Timing:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=0,
            max_tokens=workload.output_tokens,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        start_s = time.monotonic()
        ids = []
        for prompt in prompts:
            self._next_id += 1
            ids.append(str(self._next_id))
            self.engine.add_request(ids[-1], {"prompt_token_ids": prompt}, params)
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        first_s: dict[str, float] = {}
        last_s = start_s
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            last_s = time.monotonic()
            for output in outputs:
                new = output.outputs[0].token_ids
                if new:
                    first_s.setdefault(output.request_id, last_s)
                    tokens[output.request_id] += new
        first_token_s = max(first_s.values())
        return Timing(
            prefill_s=first_token_s - start_s,
            decode_s=last_s - first_token_s,
            token_ids=[tokens[request_id] for request_id in ids],
        )


def vllm_version() -> str:
    import vllm

    return vllm.__version__

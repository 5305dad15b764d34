"""Engine benchmark: our single-node engine against transformers' ``generate`` (and, with
``--engines ours,transformers,vllm``, vLLM's engine) on the same weights.

Run: ``dualpath bench engine --json results/engine.json`` (or ``python -m
dualpath.bench.engine_bench`` with the same flags).

For each weight dtype, two engines load the same checkpoint directory: ours (``dualpath.LLM``,
no KV store, so nothing is reused between runs) and transformers'
``AutoModelForCausalLM.from_pretrained(dir, dtype=...)`` driving ``generate`` (greedy,
``min_new_tokens = max_new_tokens`` so it cannot stop early); with ``vllm`` among the engines,
also vLLM's ``LLMEngine`` (the installed build, in this process, eager, prefix caching off, no
connector), stepped here with each step's tokens stamped as it returns. All run on the same
torch intra-op thread count, set once for the process before any engine is built (vLLM's CPU
worker freezes it). Three workloads:

- prefill: one ``prompt_tokens`` prompt, one output token; tokens/s = prompt tokens / time to
  the first token;
- decode at each batch size B: B prompts of ``decode_prompt_tokens`` (equal lengths: no
  padding), ``decode_tokens`` output tokens each; aggregate tokens/s at steady state =
  B * (decode_tokens - 1) / (time of the last token - time of the first token), so the prefill
  is left out;
- copy bandwidth: a large torch tensor ``copy_``, bytes read + written over time. The batch-1
  bound is that bandwidth / the weight bytes one token reads (every parameter once; the tied
  embedding counted once, for the LM head).

One untimed warm-up pass runs every workload first; then each repeat runs every workload on
every variant, engines alternating which goes first, so the variants share the machine's
state (others' load, frequency) as closely as a shared CPU allows. Medians are reported,
with every raw timing and each variant's spread (slowest / fastest repeat). On a CPU that
other processes also use, every OpenMP barrier of a multi-threaded op can wait for a
descheduled thread, so ``--threads`` equal to the core count makes single runs swing by
multiples; the spread says how far, and more ``--repeats`` steady the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from dualpath.flags import positive_int
from dualpath.options import (
    add_json_argument,
    add_model_argument,
    add_repeats_argument,
    add_seed_argument,
    add_threads_argument,
)

if TYPE_CHECKING:  # imported where it runs: building the CLI's parser must not import torch
    import torch

DTYPES = ("float32", "bfloat16")
ENGINES = ("ours", "transformers", "vllm")
DEFAULT_ENGINES = ("ours", "transformers")
# 256 MiB: far past any last-level cache, so the copy streams from and to DRAM.
_COPY_BYTES = 256 << 20


@dataclass(frozen=True)
class EngineBenchConfig:
    """What one run measures; ``__post_init__`` refuses what could not be measured."""

    model_dir: Path
    dtypes: tuple[str, ...] = DTYPES
    num_threads: int = 1
    prompt_tokens: int = 2048  # the prefill workload's prompt
    decode_prompt_tokens: int = 128  # each decode prompt: a short chat turn's context
    decode_tokens: int = 64  # output tokens per decode sequence; decode_tokens - 1 are timed
    batch_sizes: tuple[int, ...] = (1, 16)
    num_repeats: int = 3
    seed: int = 0
    engines: tuple[str, ...] = DEFAULT_ENGINES

    def __post_init__(self) -> None:
        is_bad = set(DEFAULT_ENGINES) - set(self.engines) or set(self.engines) - set(ENGINES)
        if is_bad or len(set(self.engines)) != len(self.engines):
            raise ValueError(
                f"engines must be ours and transformers, optionally vllm, each once, got "
                f"{','.join(self.engines)}"
            )
        bad = [d for d in self.dtypes if d not in DTYPES]
        if not self.dtypes or bad or len(set(self.dtypes)) != len(self.dtypes):
            raise ValueError(f"dtypes must be distinct names from {DTYPES}, got {self.dtypes}")
        if not self.batch_sizes or any(b <= 0 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be integers > 0, got {self.batch_sizes}")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError(f"batch sizes must be distinct, got {self.batch_sizes}")
        for name in ("num_threads", "prompt_tokens", "decode_prompt_tokens", "num_repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.decode_tokens < 2:
            raise ValueError(
                f"decode_tokens must be >= 2 (the first token ends the prefill), "
                f"got {self.decode_tokens}"
            )


@dataclass(frozen=True)
class Workload:
    """One measured shape: ``batch_size`` prompts of ``prompt_tokens``, ``output_tokens`` each."""

    name: str  # "prefill" or "decode@B"
    batch_size: int
    prompt_tokens: int
    output_tokens: int

    @property
    def is_prefill(self) -> bool:
        return self.name == "prefill"


@dataclass(frozen=True)
class Timing:
    """One run of a workload: seconds to the first token, then from the first to the last."""

    prefill_s: float
    decode_s: float
    token_ids: list[list[int]]  # per sequence, for checking lengths and comparing engines


def workloads(config: EngineBenchConfig) -> list[Workload]:
    prefill = Workload("prefill", 1, config.prompt_tokens, 1)
    decodes = [
        Workload(f"decode@{b}", b, config.decode_prompt_tokens, config.decode_tokens)
        for b in config.batch_sizes
    ]
    return [prefill, *decodes]


def run_engine_bench(config: EngineBenchConfig, *, show_progress: bool = False) -> dict:
    """Measure every (workload, dtype, engine) side by side; a JSON-able dict (module doc)."""
    from dualpath.model.registry import read_config

    model_config = read_config(config.model_dir / "config.json")
    _check_fits(config, model_config.max_position_embeddings)
    import torch  # after the checks: a bad --model is refused without it

    torch.set_num_threads(config.num_threads)  # process-wide: every variant runs on these
    shapes = workloads(config)
    prompts = _prompts(shapes, model_config.vocab_size, config.seed)
    engines = {
        (dtype, name): _load(name, config, dtype)
        for dtype in config.dtypes
        for name in config.engines
    }
    copy_buffers = _copy_buffers(_COPY_BYTES)
    samples: dict[tuple[str, str, str], list[Timing]] = {}
    copy_samples_s: list[float] = []
    total = len(shapes) * len(engines) * (config.num_repeats + 1)
    with tqdm(total=total, desc="engine bench", unit="run", disable=not show_progress) as bar:
        for repeat in range(-1, config.num_repeats):  # -1: the untimed warm-up
            # Alternate which engine runs first, so neither always follows the other.
            order = config.engines if repeat % 2 == 0 else config.engines[::-1]
            for workload in shapes:
                for dtype in config.dtypes:
                    for name in order:
                        bar.set_postfix_str(f"{name} {dtype} {workload.name}")
                        timing = engines[dtype, name].run(prompts[workload.name], workload)
                        _check_lengths(timing, workload, name)
                        if repeat >= 0:
                            samples.setdefault((dtype, name, workload.name), []).append(timing)
                        bar.update(1)
            copy_s = _time_copy(*copy_buffers)
            if repeat >= 0:
                copy_samples_s.append(copy_s)
    weight_bytes = {dtype: engines[dtype, "ours"].weight_bytes() for dtype in config.dtypes}
    from dualpath.bench.engine_report import build_report  # it imports this module

    return build_report(
        config, shapes, samples, copy_samples_s, _COPY_BYTES, weight_bytes, model_config
    )


def _check_fits(config: EngineBenchConfig, max_positions: int) -> None:
    longest = max(config.prompt_tokens + 1, config.decode_prompt_tokens + config.decode_tokens)
    if longest > max_positions:
        raise ValueError(
            f"a workload needs {longest} positions but the model has "
            f"max_position_embeddings {max_positions}"
        )


def _prompts(shapes: list[Workload], vocab_size: int, seed: int) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(seed)
    return {
        w.name: rng.integers(0, vocab_size, size=(w.batch_size, w.prompt_tokens)).tolist()
        for w in shapes
    }


def _check_lengths(timing: Timing, workload: Workload, engine: str) -> None:
    lengths = {len(ids) for ids in timing.token_ids}
    if len(timing.token_ids) != workload.batch_size or lengths != {workload.output_tokens}:
        raise RuntimeError(
            f"{engine} {workload.name}: expected {workload.batch_size} sequences of "
            f"{workload.output_tokens} tokens, got lengths {sorted(lengths)}: not a result"
        )


# --- the engines ---------------------------------------------------------------------------------


class OurEngine:
    """``dualpath.LLM`` without a KV store; times come from its ``RequestOutput``s."""

    def __init__(self, config: EngineBenchConfig, dtype: str) -> None:
        from dualpath import LLM

        max_batch = max(config.batch_sizes)
        self.llm = LLM(
            config.model_dir,
            dtype=dtype,
            num_threads=config.num_threads,
            max_num_seqs=max(64, max_batch),
            # Every decode batch prefills in one step, so its first tokens come together.
            max_num_batched_tokens=max(
                8192, config.prompt_tokens, max_batch * config.decode_prompt_tokens
            ),
        )

    def run(self, prompts: list[list[int]], workload: Workload) -> Timing:
        from dualpath import SamplingParams

        params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        first_token_s = {o.first_token_s for o in outs}
        assert len(first_token_s) == 1, f"{workload.name}: first tokens in several steps"
        first_s = first_token_s.pop()
        return Timing(
            prefill_s=first_s - min(o.arrival_s for o in outs),
            decode_s=max(o.finish_s for o in outs) - first_s,
            token_ids=[o.token_ids for o in outs],
        )

    def weight_bytes(self) -> int:
        """Bytes one batch-1 token reads: every parameter once (``parameters()`` yields a tied
        embedding once, so the LM head is not counted twice)."""
        model = self.llm.engine.loaded.model
        return sum(p.numel() * p.element_size() for p in model.parameters())


class TransformersEngine:
    """transformers' ``generate``, greedy, unable to stop early; a logits processor stamps
    each token's time (it runs once per token, right after that token's forward)."""

    def __init__(self, config: EngineBenchConfig, dtype: str) -> None:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()  # generation-config notes, not results
        transformers.logging.disable_progress_bar()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            config.model_dir, dtype=getattr(torch, dtype)
        ).eval()
        eos = self.model.config.eos_token_id
        self.pad_token_id = eos[0] if isinstance(eos, list) else eos

    def run(self, prompts: list[list[int]], workload: Workload) -> Timing:
        import torch
        import transformers

        input_ids = torch.tensor(prompts)
        times_s: list[float] = []

        def stamp(_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            times_s.append(time.monotonic())
            return scores

        start_s = time.monotonic()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=workload.output_tokens,
                min_new_tokens=workload.output_tokens,
                do_sample=False,
                logits_processor=transformers.LogitsProcessorList([stamp]),
                pad_token_id=self.pad_token_id,
            )
        return Timing(
            prefill_s=times_s[0] - start_s,
            decode_s=times_s[-1] - times_s[0],
            token_ids=out[:, input_ids.shape[1] :].tolist(),
        )


def _load(engine: str, config: EngineBenchConfig, dtype: str) -> Any:
    if engine == "vllm":  # vLLM's engine, in dualpath.vllm: only that imports vLLM
        from dualpath.vllm.bench.engine_bench import VllmEngine

        return VllmEngine(config, dtype)
    kinds = {"ours": OurEngine, "transformers": TransformersEngine}
    return kinds[engine](config, dtype)


def _copy_buffers(num_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    source = torch.ones(num_bytes, dtype=torch.uint8)
    destination = torch.empty(num_bytes, dtype=torch.uint8)
    destination.copy_(source)  # first-touch page faults, once
    return source, destination


def _time_copy(source: torch.Tensor, destination: torch.Tensor) -> float:
    start_s = time.perf_counter()
    destination.copy_(source)
    return time.perf_counter() - start_s


# --- command line --------------------------------------------------------------------------------


def _csv(kind: type, choices: tuple[str, ...] | None = None) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from exc
        if not values or (choices and any(v not in choices for v in values)):
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma-separated list of {choices or kind.__name__}"
            )
        return values

    return parse


def _default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument(
        "--dtypes",
        type=_csv(str, DTYPES),
        default=DTYPES,
        help="weight dtypes, each measured for both engines in this run; targets are judged "
        "per dtype (default: float32,bfloat16)",
    )
    add_threads_argument(
        parser,
        default=_default_threads(),
        default_help="this machine's cores available to the process",
        detail=", the same for every variant",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=2048,
        help="prompt length of the prefill workload",
    )
    parser.add_argument(
        "--decode-prompt-tokens",
        type=positive_int,
        default=128,
        help="prompt length of every sequence in the decode workloads",
    )
    parser.add_argument(
        "--decode-tokens",
        type=positive_int,
        default=64,
        help="output tokens per decode sequence; the last N-1 are timed (steady state)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=_csv(int),
        default=(1, 16),
        help="decode batch sizes, comma-separated; tokens/s is the batch's aggregate "
        "(default: 1,16)",
    )
    add_repeats_argument(parser, default=3)
    add_seed_argument(parser, what="random prompt token ids")
    parser.add_argument(
        "--engines",
        type=_csv(str, ENGINES),
        default=DEFAULT_ENGINES,
        help="the engines side by side: ours and transformers, and vllm (vLLM's engine in this "
        "process; needs vLLM installed, e.g. .venv-vllm) (default: ours,transformers)",
    )
    add_json_argument(
        parser,
        what="the result (config, every raw timing, ratios, targets)",
        detail=", and the Markdown summary beside it as .md",
    )


def main(args: argparse.Namespace) -> int:
    from dualpath.bench.engine_report import markdown
    from dualpath.model.default import resolve_model_dir

    settings = {
        "dtypes": args.dtypes,
        "num_threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "decode_prompt_tokens": args.decode_prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "batch_sizes": args.batch_sizes,
        "num_repeats": args.repeats,
        "seed": args.seed,
        "engines": args.engines,
    }
    EngineBenchConfig(Path(), **settings)  # bad flags fail before a first use converts the model
    config = EngineBenchConfig(resolve_model_dir(args.model), **settings)
    report = run_engine_bench(config, show_progress=True)
    text = markdown(report)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        args.json.with_suffix(".md").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))

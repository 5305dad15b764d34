"""Microbenchmarks of the real engine's model on this machine, written as the simulator's
``local`` profile (a JSON file ``dualpath.sim.local`` reads; the simulator imports no torch).

    python -m dualpath.bench.sim_profile --json dualpath/sim/local_profile.json

What is measured, each the median of a few timed runs after a warm-up, in one process with
the engines' thread count (``dualpath serve`` gives each engine one torch thread):

* prefill forward time (all layers + LM head) for one chunk of ``(cached, new)`` tokens over a
  grid, fitted as ``fixed + per_new_token x new + per_pair x new x (cached + new / 2)``;
* decode step time of the engine loop (``LLMEngine.step``: schedule, forward, sample) for
  ``b`` sequences of ``c`` cached tokens each, fitted as ``fixed + per_seq x b +
  per_context_token x b x c``; what the loop adds to a bare forward is added to prefill's
  fixed time too;
* a host memory copy rate (``copy_bytes_per_s``): what a KV move between engines costs on one
  host with the shared-memory transport.

The fits are least squares with non-negative coefficients (so times grow with work). Nothing
here looks at a benchmark run: a fidelity check can then use any workload and seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dualpath.model.llama import DecoderModel, PackedBatch

PREFILL_GRID = tuple(
    (cached, new) for cached in (0, 256, 1024, 2048) for new in (16, 64, 256, 1024)
)
DECODE_GRID = tuple((b, c) for b in (1, 2, 4, 8) for c in (128, 512, 2048))


@torch.inference_mode()
def _forward_s(model: DecoderModel, chunks: list[tuple[int, int]], num_repeats: int) -> float:
    config = model.config
    dtype = model.model.embed_tokens.weight.dtype
    batch = PackedBatch(
        num_cached_tokens=tuple(c for c, _ in chunks), num_new_tokens=tuple(n for _, n in chunks)
    )
    num_rows = sum(n for _, n in chunks)
    input_ids = torch.randint(0, config.vocab_size, (num_rows,))
    past = [
        [
            (
                torch.randn(c, config.num_kv_heads, config.head_dim).to(dtype),
                torch.randn(c, config.num_kv_heads, config.head_dim).to(dtype),
            )
            for c, _ in chunks
        ]
        for _ in range(config.num_layers)
    ]
    times_s = []
    for _ in range(num_repeats + 1):
        start = time.perf_counter()
        model.forward_full(input_ids, batch, past)
        times_s.append(time.perf_counter() - start)
    return statistics.median(times_s[1:])


def _engine_decode_s(loaded, num_seqs: int, num_cached: int, num_threads: int) -> float:
    """Median time of one decode step of the real engine loop (``LLMEngine.step``: schedule,
    forward, sample, bookkeeping) with ``num_seqs`` sequences of ``num_cached`` tokens."""
    from dualpath.config import EngineConfig, KVStoreConfig
    from dualpath.engine.llm import LLMEngine
    from dualpath.types import SamplingParams

    engine = LLMEngine(loaded, EngineConfig(num_threads=num_threads), KVStoreConfig())
    generator = np.random.default_rng(num_seqs * 10_000 + num_cached)
    num_steps = 10
    for _ in range(num_seqs):
        prompt = generator.integers(1, loaded.config.vocab_size - 1, num_cached).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=num_steps + 2, ignore_eos=True))
    times_s = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times_s.append(time.perf_counter() - start)
    return statistics.median(times_s[-num_steps:])


def _nonnegative_fit(rows: list[list[float]], times_s: list[float]) -> list[float]:
    """Least squares with coefficients >= 0 (active set: drop negatives and refit)."""
    a = np.array(rows, dtype=float)
    y = np.array(times_s, dtype=float)
    active = list(range(a.shape[1]))
    coefficients = np.zeros(a.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active = [i for i, value in zip(active, solution, strict=True) if value > 0]
    return [float(c) for c in coefficients]


def _copy_bytes_per_s(num_bytes: int = 64 << 20, num_repeats: int = 5) -> float:
    source = np.ones(num_bytes, dtype=np.uint8)
    target = np.empty_like(source)
    times_s = []
    for _ in range(num_repeats + 1):
        start = time.perf_counter()
        np.copyto(target, source)
        times_s.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times_s[1:])


def measure(model_dir: Path, *, num_threads: int = 1, num_repeats: int = 3) -> dict:
    """Every measurement and fit of the module docstring, as the JSON's dict."""
    from dualpath.model.loader import load_model

    torch.set_num_threads(num_threads)
    loaded = load_model(model_dir)
    model = loaded.model
    config = loaded.config
    prefill = [(c, n, _forward_s(model, [(c, n)], num_repeats)) for c, n in PREFILL_GRID]
    forward_decode = [(b, c, _forward_s(model, [(c, 1)] * b, num_repeats)) for b, c in DECODE_GRID]
    decode = [(b, c, _engine_decode_s(loaded, b, c, num_threads)) for b, c in DECODE_GRID]
    # What the engine loop adds to a bare forward (sampling, scheduling): charged to prefill
    # steps too, whose microbenchmark times the forward alone.
    step_overhead_s = max(
        0.0, statistics.median(e[2] - f[2] for e, f in zip(decode, forward_decode, strict=True))
    )
    prefill_fit = _nonnegative_fit(
        [[1.0, n, n * (c + n / 2)] for c, n, _ in prefill], [t for *_, t in prefill]
    )
    decode_fit = _nonnegative_fit([[1.0, b, b * c] for b, c, _ in decode], [t for *_, t in decode])
    itemsize = loaded.dtype.itemsize if hasattr(loaded.dtype, "itemsize") else 4
    return {
        "profile": "local",
        "model_dir": str(model_dir),
        "num_threads": num_threads,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "num_layers": config.num_layers,
        "kv_bytes_per_token": config.num_layers * config.kv_bytes_per_token_per_layer(itemsize),
        "prefill": {
            "fixed_s": prefill_fit[0] + step_overhead_s,
            "engine_step_overhead_s": step_overhead_s,
            "per_new_token_s": prefill_fit[1],
            "per_pair_s": prefill_fit[2],
            "samples": [[c, n, round(t, 6)] for c, n, t in prefill],
        },
        "decode": {
            "fixed_s": decode_fit[0],
            "per_seq_s": decode_fit[1],
            "per_context_token_s": decode_fit[2],
            "samples": [[b, c, round(t, 6)] for b, c, t in decode],
        },
        "copy_bytes_per_s": _copy_bytes_per_s(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: tiny)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (engines: 1)")
    parser.add_argument("--json", type=Path, required=True, help="write the profile here")
    args = parser.parse_args(argv)
    from dualpath.cli import _resolve_model

    profile = measure(_resolve_model(args.model), num_threads=args.threads)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(profile, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

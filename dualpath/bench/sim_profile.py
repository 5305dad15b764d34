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
  host with the shared-memory transport;
* the serving path (``serving``): a real ``dualpath serve --nodes 1P2D`` answers streamed
  requests one at a time over HTTP, ``(new, hit, output)`` tokens in ``SERVING_GRID`` (a
  probe with hits first stores the turn it extends), timing TTFT, the decode and the PE's
  busy time (``/metrics``). What the engine's model alone does not explain (the PE's work
  around the forward, the HTTP front end, the scheduler, the PE -> DE hand-off, the engine
  process's loop around ``LLMEngine.step``) is what ``dualpath.sim.fidelity.fit_serving``
  finds by simulating the same requests on the fitted costs; the front end's CPU time per
  request is recorded beside it.

The fits are least squares with non-negative coefficients (so times grow with work). Nothing
here looks at a benchmark run: a fidelity check can then use any workload and seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from dualpath.bench.process_cpu import process_cpu_s
from dualpath.model.layerwise import LayerwiseModel, PackedBatch
from dualpath.options import add_json_argument, add_model_argument, add_threads_argument
from dualpath.sim.local import nonnegative_fit

PREFILL_GRID = tuple(
    (cached, new) for cached in (0, 256, 1024, 2048) for new in (16, 64, 256, 1024)
)
DECODE_GRID = tuple((b, c) for b in (1, 2, 4, 8) for c in (128, 512, 2048))
# (new prompt tokens, hit tokens, output tokens) of the serving-path probes; each is sent
# NUM_SERVING_REPEATS times, one request at a time, after NUM_SERVING_WARMUP requests that are
# not kept. A probe with hits first sends a turn of that many fresh tokens and then extends it.
SERVING_GRID = (
    (64, 0, 1),
    (512, 0, 1),
    (64, 0, 33),
    (512, 0, 33),
    (32, 512, 1),
    (32, 1024, 1),
)
NUM_SERVING_REPEATS = 5
NUM_SERVING_WARMUP = 3
SERVING_PAUSE_S = 0.2  # between probes: the cluster is idle when each one arrives


@torch.inference_mode()
def _forward_s(model: LayerwiseModel, chunks: list[tuple[int, int]], num_repeats: int) -> float:
    config = model.config
    dtype = model.model.embed_tokens.weight.dtype
    batch = PackedBatch(
        num_cached_tokens=tuple(c for c, _ in chunks), num_new_tokens=tuple(n for _, n in chunks)
    )
    num_rows = sum(n for _, n in chunks)
    input_ids = torch.randint(0, config.vocab_size, (num_rows,))
    past = [
        [torch.randn(c, *model.cache_entry_shape).to(dtype) for c, _ in chunks]
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
    from dualpath.engine.llm_engine import LLMEngine
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


def _copy_bytes_per_s(num_bytes: int = 64 << 20, num_repeats: int = 5) -> float:
    source = np.ones(num_bytes, dtype=np.uint8)
    target = np.empty_like(source)
    times_s = []
    for _ in range(num_repeats + 1):
        start = time.perf_counter()
        np.copyto(target, source)
        times_s.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times_s[1:])


async def _serving_probes(url: str, vocab_size: int, server_pid: int) -> dict:
    from dualpath.bench.agents import complete_turn
    from dualpath.bench.harness import SERVED_MODEL_NAME
    from dualpath.bench.server_process import metric_sum, scrape

    generator = np.random.default_rng(0)
    metrics_client = httpx.Client()

    def pe_busy_s() -> float:
        samples = scrape(url, client=metrics_client)
        return metric_sum(samples, "dualpath_engine_busy_seconds_total", role="prefill")

    async def send(client: httpx.AsyncClient, prompt: list[int], num_output: int):
        completion = await complete_turn(client, SERVED_MODEL_NAME, 0, 0, prompt, num_output)
        if completion.record.error is not None:
            raise RuntimeError(f"serving probe failed: {completion.record.error}")
        # Idle again before the next probe, and the PE's busy time reported.
        await asyncio.sleep(SERVING_PAUSE_S)
        return completion

    def fresh(num_tokens: int) -> list[int]:
        return generator.integers(1, vocab_size - 1, num_tokens).tolist()

    async def pe_busy_after(before_s: float) -> float:
        """The PE's busy time once it has reported a batch run since ``before_s`` was read
        (within a report interval; 2 s at most)."""
        deadline_s = time.monotonic() + 2.0
        busy_s = pe_busy_s()
        while busy_s == before_s and time.monotonic() < deadline_s:
            await asyncio.sleep(0.02)
            busy_s = pe_busy_s()
        return busy_s

    samples, cpu = [], []
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        for _ in range(NUM_SERVING_WARMUP):  # the engines' first decode steps are slower
            await send(client, fresh(64), 33)
        # The warm-ups' batches all reported: the value stops changing (an idle engine
        # reports within its keep-alive period, 0.25 s).
        busy_s = pe_busy_s()
        while True:
            await asyncio.sleep(0.3)
            if (settled_s := pe_busy_s()) == busy_s:
                break
            busy_s = settled_s
        for num_new, num_hit, num_output in SERVING_GRID:
            server_cpu_s, client_cpu_s = process_cpu_s(server_pid), time.process_time()
            for _ in range(NUM_SERVING_REPEATS):
                prompt = fresh(num_new)
                if num_hit:  # an earlier turn stores the hit; this one extends it
                    earlier = fresh(num_hit)
                    earlier_output = (await send(client, earlier, 1)).token_ids
                    prompt = [*earlier, *earlier_output, *prompt]
                    busy_s = await pe_busy_after(busy_s)  # that turn's batch, not this one's
                record = (await send(client, prompt, num_output)).record
                busy_after_s = await pe_busy_after(busy_s)
                samples.append(
                    [
                        record.num_prompt_tokens - record.num_cached_tokens,
                        record.num_cached_tokens,
                        num_output,
                        round(record.ttft_s, 6),
                        round(record.finish_s - record.first_token_s, 6),
                        round(busy_after_s - busy_s, 6),
                    ]
                )
                busy_s = busy_after_s
            cpu.append(
                [
                    num_new,
                    num_hit,
                    num_output,
                    round((process_cpu_s(server_pid) - server_cpu_s) / NUM_SERVING_REPEATS, 6),
                    round((time.process_time() - client_cpu_s) / NUM_SERVING_REPEATS, 6),
                ]
            )
    metrics_client.close()
    return {"samples": samples, "frontend_cpu_s_per_request": cpu}


def measure_serving(model_dir: Path, vocab_size: int) -> dict:
    """The serving-path probes (module docstring) on a fresh uncapped 1P2D ``dualpath serve``:
    ``samples`` ``[new, hit, output, ttft_s, first token -> last token s, PE busy s]`` (the
    PE's time in batches from ``/metrics``) and the front end's CPU seconds per request
    (priming turns included), ``[new, hit, output, server, client]`` (the server process with
    the scheduler, not its engines; this process as the client; idle polling included)."""
    from dualpath.bench.harness import ModeRun, serve_args
    from dualpath.bench.server_process import ServerProcess

    run = ModeRun(mode="dualpath", model_dir=model_dir, nodes="1P2D", snic_bandwidth_gbps=0.0)
    with tempfile.TemporaryDirectory(prefix="dualpath-sim-profile-") as tmp:
        work = Path(tmp)
        server = ServerProcess(
            serve_args(run, work / "kv", work / "logs"), log_path=work / "serve.log"
        ).start()
        try:
            probes = asyncio.run(_serving_probes(server.url, vocab_size, server.pid))
        finally:
            server.stop()
    return {"nodes": run.nodes, "mode": run.mode, **probes}


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
    prefill_fit = nonnegative_fit(
        [[1.0, n, n * (c + n / 2)] for c, n, _ in prefill], [t for *_, t in prefill]
    )
    decode_fit = nonnegative_fit([[1.0, b, b * c] for b, c, _ in decode], [t for *_, t in decode])
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


def measure_all(model_dir: Path, *, num_threads: int = 1) -> dict:
    """The model's microbenchmarks, then the serving path's, with what the simulator misses of
    it (``dualpath.sim.fidelity.fit_serving``, which simulates the probes on the new costs)."""
    from dualpath.sim.fidelity import fit_serving

    profile = measure(model_dir, num_threads=num_threads)
    config = json.loads((model_dir / "config.json").read_text())
    serving = measure_serving(model_dir, int(config["vocab_size"]))
    profile["serving"] = {**serving, **fit_serving(profile, serving["samples"])}
    return profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser, tiny=True)
    add_threads_argument(parser, default=1, default_help="1, as serve's engines")
    add_json_argument(parser, what="the profile", required=True)
    args = parser.parse_args(argv)
    from dualpath.model.default import resolve_model_dir

    profile = measure_all(resolve_model_dir(args.model, tiny=True), num_threads=args.threads)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(profile, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`dualpath bench vs-vllm`: dualpath against vLLM's own serving, on real agent sessions.

    .venv-vllm/bin/dualpath bench vs-vllm --regime beyond-memory --json results/vs_vllm.json

The same agentic replay (real sessions, every agent at once, no link caps) against each system
in turn, one at a time, each on a fresh store and fresh processes:

    vllm-single                    one vLLM instance on every core (its threads bound to them),
                                   prefix caching on: what a user would run instead of ours
    dualpath-1P1D, dualpath-1P2D   ``dualpath serve --engine vllm`` of that shape (DualPath
                                   mode): our scheduler, store and transport, vLLM's engine in
                                   each engine process (``--threads`` each, ``--decode-threads``
                                   each DE: with --regime every core, and 1)
    dualpath-native-1P2D           ``dualpath serve`` on our own engine, 1P2D
    dualpath-local-1P1D            ``dualpath-1P1D`` with conditional disaggregation: a turn the
                                   store misses by at most ``--local-prefill-tokens`` goes to its
                                   DE alone (``serve --local-prefill-tokens``)
    vllm-pd-1P1D, vllm-pd-1P2D     vLLM's own prefill/decode disaggregation of the same shape:
                                   one ``vllm.entrypoints.openai.api_server`` per instance with
                                   its NixlConnector (``kv_buffer_device: cpu``), instance i on
                                   core i mod cores (``VLLM_CPU_OMP_THREADS_BIND``), fronted by
                                   ``pd_proxy`` as vLLM's docs describe

``--regime small|beyond-memory`` (``dualpath/bench/regimes.py``) sets the sessions, the pause
after every answer and every system's KV memory by one rule: the same total KV memory for each
system (vLLM alone all of it, our engines an equal share each), fitting every session's
context (small) or half of what they need (beyond memory); its default systems are vllm-single
and ours (vLLM engines 1P1D and 1P2D, native 1P2D). Without it, ``--kv-cache-gb`` per engine
and per vLLM instance (the single instance twice that), the sessions back to back.

Every vLLM instance and every engine of ours gets the same checkpoint, dtype (float32), block
size (64), eager mode and prefix caching. The figures depend on this host: its cores are
shared by every process of a system and by the client.

JSON: ``modes`` (one entry per system, as the other benchmarks' modes, so the same summary
and plots: each system's ``jct_s``, ``ttft_s``/``tpot_s`` percentiles, ``hit_ratio`` and
``hit_ratio_of_bound``, ``recomputed_tokens``, ``store_read_bytes``, ``process_cpu`` with CPU
seconds per process, ``num_failed`` ...), ``memory`` (the rule's figures), ``ratios``
(``<ours>_vs_<theirs>_jct``: the other system's JCT over ours, above 1 when ours is faster),
``targets``. A failed request in any system makes the run invalid (exit 1, no ratios).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from dualpath.bench.arguments import add_preset_argument
from dualpath.bench.hardware import hardware_info
from dualpath.bench.harness import (
    ModeRun,
    run_mode,
    token_mismatches,
)
from dualpath.bench.offline import load_workload, workload_report
from dualpath.bench.presets import PRESETS
from dualpath.bench.regimes import (
    REGIMES,
    Regime,
    RegimeMemory,
    best_of_ours,
    cpu_seconds,
    legacy_targets,
    regime_memory,
    regime_targets,
)
from dualpath.bench.report import add_output_arguments, finish
from dualpath.bench.spec import (
    BLOCK_SIZE_TOKENS,
    EngineSpec,
    RunSpec,
    VsVllmSpec,
    modes_of,
    output_spec,
    workload_spec,
)
from dualpath.bench.validity import mark_validity, mode_problems
from dualpath.cluster_options import add_kv_cache_argument, add_transport_argument
from dualpath.flags import non_negative_float, positive_float, positive_int
from dualpath.model.identity import kv_layout
from dualpath.model.registry import read_config
from dualpath.options import (
    add_clones_argument,
    add_decode_threads_argument,
    add_max_sessions_argument,
    add_model_argument,
    add_seed_argument,
    add_threads_argument,
    add_trace_argument,
    add_trace_shape_arguments,
)
from dualpath.units import gb_to_bytes
from dualpath.vllm.args import (
    add_vllm_arg_argument,
    check_vllm_args,
    check_vllm_installed,
)
from dualpath.vllm.bench.vllm_systems import run_vllm_system, system_nodes
from dualpath.workload.stats import workload_stats

SYSTEMS = (
    "dualpath-1P1D",
    "dualpath-1P2D",
    "dualpath-native-1P2D",
    "dualpath-local-1P1D",
    "vllm-pd-1P1D",
    "vllm-pd-1P2D",
    "vllm-single",
)
# Without --regime: ours on vLLM engines against vLLM's P/D and the single instance.
LEGACY_SYSTEMS = ("dualpath-1P1D", "dualpath-1P2D", "vllm-pd-1P1D", "vllm-pd-1P2D", "vllm-single")
# With --regime: vLLM alone first (the reference of every ratio and of the tokens), then ours.
# (dualpath-local-1P1D only when asked: on 2 shared CPU cores it gained no JCT in either regime,
# docs/vllm-engine.md.)
REGIME_SYSTEMS = ("vllm-single", "dualpath-1P1D", "dualpath-1P2D", "dualpath-native-1P2D")
# A short append, prefilled on its DE: at the regimes' 5% of the trace's length a later turn
# appends 21 tokens at the median and 90-130 at p75, 900 at p90, and a real first turn 550+.
DEFAULT_LOCAL_PREFILL_TOKENS = 256
METRICS_PERIOD_S = 5.0  # ours' /metrics scrapes (the final counters are read at the end)
# The replay when no flag reshapes it: the first 6 real agentic-coding sessions, 12 turns each,
# at 8% of their length (contexts up to ~6K tokens of SmolLM2's 8K), all at once, no clones.
DEFAULT_SHAPE = {"max_sessions": 6, "max_turns": 12, "length_scale": 0.08, "clones": 0}


def run_dualpath_system(
    system: str,
    workload,
    spec: VsVllmSpec,
    work_dir: Path,
    *,
    kv_cache_bytes: int,
    max_model_len: int | None,
) -> dict:
    """``dualpath serve`` of the system's shape and engine, DualPath mode, no link caps; each
    engine ``kv_cache_bytes`` of KV memory."""
    nodes = system.rsplit("-", 1)[1]
    is_native = system.startswith("dualpath-native-")
    is_local = system.startswith("dualpath-local-")
    run = ModeRun(
        mode="dualpath",
        model_dir=spec.run.model_dir,
        nodes=nodes,
        snic_bandwidth_gbps=0.0,
        engine="native" if is_native else "vllm",
        vllm_args=() if is_native else tuple(sorted(spec.run.engine.vllm_args)),
        kv_cache_gb=kv_cache_bytes / 1e9,
        transport=spec.run.engine.transport,
        extra_serve_args=(
            *("--threads", str(spec.threads)),
            *(("--decode-threads", str(spec.decode_threads)) if spec.decode_threads else ()),
            *(("--local-prefill-tokens", str(spec.local_prefill_tokens)) if is_local else ()),
            *(("--max-model-len", str(max_model_len)) if max_model_len else ()),
        ),
    )
    # No link caps, so no SNIC timeline to draw: /metrics is scraped every few seconds only
    # (every 0.5 s cost ours about 2% of the CPU it shares, which vLLM alone is not charged).
    result = run_mode(
        run,
        workload,
        work_dir=work_dir / system,
        pause_s=spec.pause_s,
        metrics_period_s=METRICS_PERIOD_S,
    )
    paths = result.get("path_bytes") or {}
    result["store_read_bytes"] = sum(paths.values()) if paths else None
    return result


def _num_engines(system: str) -> int:
    if system == "vllm-single":
        return 1
    num_prefill, num_decode = system_nodes(system)
    return num_prefill + num_decode


def kv_bytes_per_engine(system: str, spec: VsVllmSpec, memory: RegimeMemory | None) -> int:
    """Each engine's (each vLLM instance's) KV memory: the regime's total shared equally, or
    ``--kv-cache-gb`` (the single instance: twice that, the 1P1D shape's two engines')."""
    if memory is not None:
        return memory.per_engine_bytes(_num_engines(system))
    per_engine = gb_to_bytes(spec.kv_cache_gb)
    return 2 * per_engine if system == "vllm-single" else per_engine


def compare(spec: VsVllmSpec, workload, work_dir: Path, memory: RegimeMemory | None = None) -> dict:
    """Each system's figures, the ratios and the targets (the report, before validity)."""
    model_dir = spec.run.model_dir
    config = read_config(model_dir / "config.json")
    systems = spec.run.modes
    ideal = workload_stats(workload, block_size_tokens=BLOCK_SIZE_TOKENS).ideal_hit_ratio
    max_model_len = memory.max_model_len_tokens if memory is not None else None
    results = {}
    for system in systems:
        print(f"== {system}", file=sys.stderr, flush=True)
        kv_cache_bytes = kv_bytes_per_engine(system, spec, memory)
        if system.startswith("dualpath"):
            result = run_dualpath_system(
                system,
                workload,
                spec,
                work_dir,
                kv_cache_bytes=kv_cache_bytes,
                max_model_len=max_model_len,
            )
        else:
            result = run_vllm_system(
                system,
                workload,
                model_dir=model_dir,
                max_model_len=max_model_len or config.max_position_embeddings,
                kv_cache_bytes=kv_cache_bytes,
                work_dir=work_dir,
                start_timeout_s=spec.start_timeout_s,
                pause_s=spec.pause_s,
            )
            result["store_read_bytes"] = None  # vLLM keeps no store
        result["kv_cache_bytes_per_engine"] = kv_cache_bytes
        result["recomputed_tokens"] = result["prompt_tokens"] - result["cached_tokens"]
        result["hit_ratio_of_bound"] = result["hit_ratio"] / ideal if ideal else None
        result["process_cpu_s"] = cpu_seconds(result.get("process_cpu"))
        results[system] = result
    reference = results[systems[0]]["tokens"]
    for result in results.values():
        # Systems may part at a near tie (a cached and an uncached prefill need not be
        # bit-exact in vLLM), and an agent's later prompts then differ too.
        result["token_mismatches"] = token_mismatches(result.pop("tokens"), reference)
    if memory is None:
        ratios, targets = legacy_targets(results)
    else:
        ratios, targets = regime_targets(spec.regime, results, ideal)
    return {
        "modes": results,
        "best_system": best_of_ours(results),
        "ratios": ratios,
        "targets": targets,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--regime",
        choices=sorted(REGIMES),
        default=None,
        help="compare in this regime (dualpath/bench/regimes.py): "
        + "; ".join(f"{name}: {r.description}" for name, r in sorted(REGIMES.items()))
        + ". Sets the sessions, --pause-s and every system's KV memory (the same total for "
        "each: vLLM alone all of it, our engines an equal share each); the shape flags below "
        "still override the sessions (default: none, the sessions back to back)",
    )
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated systems to run, in order (of {', '.join(SYSTEMS)}; default "
        f"with --regime {','.join(REGIME_SYSTEMS)}, else {','.join(LEGACY_SYSTEMS)}); tokens "
        "are counted against the first, ratios against vllm-single and vLLM's P/D",
    )
    add_model_argument(parser)
    add_preset_argument(parser, default="agentic")
    add_seed_argument(parser)
    add_trace_argument(parser)
    add_max_sessions_argument(
        parser, default=None, default_help=f"the regime's, else {DEFAULT_SHAPE['max_sessions']}"
    )
    add_trace_shape_arguments(
        parser,
        defaults={"length_scale": None, "max_turns": None, "gen_scale": None},
        default_help={
            "length_scale": f"the regime's, else {DEFAULT_SHAPE['length_scale']}, contexts up "
            "to ~6K tokens",
            "max_turns": f"the regime's, else {DEFAULT_SHAPE['max_turns']}",
            "gen_scale": "the preset's",
        },
    )
    add_clones_argument(parser, default=0, default_help="0")
    parser.add_argument(
        "--pause-s",
        type=non_negative_float,
        default=None,
        help="seconds each session pauses after every answer before its next turn, for its "
        "tools (default: the regime's, else 0)",
    )
    add_kv_cache_argument(
        parser,
        default=None,
        default_help="1 without --regime; refused with it (its rule sizes every system)",
        detail=" and per vLLM instance (the single instance gets twice this): vLLM's "
        "--num-gpu-blocks-override of that many bytes' blocks, in as many whole GiB of "
        "VLLM_CPU_KVCACHE_SPACE as it takes (an integer in vLLM 0.32), as serve --engine "
        "vllm sizes its engines",
    )
    add_threads_argument(
        parser,
        default=None,
        default_help="every core with --regime, else 1",
        detail=" of ours (serve --threads; engine e on cores e*threads ...: with as many "
        "threads as cores every engine may use every core)",
    )
    add_decode_threads_argument(
        parser, default_help="1 with --regime, else --threads; ours' engines, as serve's"
    )
    parser.add_argument(
        "--local-prefill-tokens",
        type=positive_int,
        default=DEFAULT_LOCAL_PREFILL_TOKENS,
        help="the dualpath-local-* systems' serve --local-prefill-tokens: a turn the store "
        "misses by at most this many tokens is prefilled on its decode engine (default "
        f"{DEFAULT_LOCAL_PREFILL_TOKENS})",
    )
    parser.add_argument(
        "--start-timeout-s",
        type=positive_float,
        default=600.0,
        help="how long a vLLM instance may take to start (default 600)",
    )
    add_transport_argument(parser)
    add_vllm_arg_argument(parser, where="for dualpath serve's vLLM engines (not vLLM's own)")
    add_output_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from dualpath.model.default import resolve_model_dir

    regime = REGIMES[args.regime] if args.regime else None
    if regime is not None and args.kv_cache_gb is not None:
        raise ValueError(
            "--kv-cache-gb: --regime sizes every system's KV memory by its rule; give one of them"
        )
    systems = modes_of(args.systems, ",".join(REGIME_SYSTEMS if regime else LEGACY_SYSTEMS))
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValueError(
            f"--systems: unknown {', '.join(unknown) or 'none given'}; choose from "
            f"{', '.join(SYSTEMS)}"
        )
    vllm_args = dict(args.vllm_arg or ())
    check_vllm_args(vllm_args)
    check_vllm_installed()
    _apply_regime(args, regime, systems)
    spec = vs_vllm_spec(args, resolve_model_dir(args.model, tiny=False))
    shape = spec.run.workload.shape(PRESETS[args.preset])
    workload = load_workload(shape, model_dir=spec.run.model_dir, seed=args.seed)
    memory = None
    if regime is not None:
        config = read_config(spec.run.model_dir / "config.json")
        memory = regime_memory(
            regime,
            workload,
            full_block_bytes=kv_layout(config, "float32", BLOCK_SIZE_TOKENS).full_block_bytes,
            block_size_tokens=BLOCK_SIZE_TOKENS,
        )
    with tempfile.TemporaryDirectory(prefix="dualpath-vs-vllm-") as tmp:
        compared = compare(spec, workload, Path(tmp), memory)
    report = {
        "benchmark": "vs-vllm",
        "regime": args.regime,
        "preset": args.preset,
        "seed": args.seed,
        "model": str(spec.run.model_dir),
        "memory": None if memory is None else asdict(memory),
        "kv_cache_gb_per_engine": spec.kv_cache_gb if memory is None else None,
        "transport": spec.run.engine.transport,
        "threads_per_engine": spec.threads,
        "threads_per_decode_engine": spec.decode_threads or spec.threads,
        "local_prefill_tokens": spec.local_prefill_tokens,
        "pause_s": spec.pause_s,
        # Set for every process the benchmark starts (OpenMP's idle threads spin or sleep).
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "hardware": hardware_info(),
        **workload_report(workload, shape),
        **compared,
    }
    problems = [p for system, r in report["modes"].items() for p in mode_problems(system, r)]
    mark_validity(report, problems)
    return finish(report, args, f"vs_vllm_{args.regime}" if args.regime else "vs_vllm")


def _apply_regime(args: argparse.Namespace, regime: Regime | None, systems) -> None:
    """Fill the flags left unset from ``regime`` (or the defaults without one)."""
    shape = (
        {"max_sessions": regime.max_sessions, "max_turns": regime.max_turns,
         "length_scale": regime.length_scale}
        if regime is not None
        else {key: DEFAULT_SHAPE[key] for key in ("max_sessions", "max_turns", "length_scale")}
    )  # fmt: skip
    for key, value in shape.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.pause_s is None:
        args.pause_s = regime.pause_s if regime is not None else 0.0
    if args.kv_cache_gb is None and regime is None:
        args.kv_cache_gb = 1.0
    if args.threads is None:
        args.threads = (os.cpu_count() or 1) if regime is not None else 1
    if args.decode_threads is None and regime is not None:
        args.decode_threads = 1
    args.systems = ",".join(systems)


def vs_vllm_spec(args: argparse.Namespace, model_dir: Path) -> VsVllmSpec:
    """``bench vs-vllm``'s command line as one run: the systems are its modes."""
    return VsVllmSpec(
        run=RunSpec(
            model_dir=model_dir,
            workload=workload_spec(args),
            modes=modes_of(args.systems, ""),
            engine=EngineSpec(
                engine="vllm",
                vllm_args=tuple(dict(args.vllm_arg or ()).items()),
                transport=args.transport,
            ),
            output=output_spec(args),
        ),
        kv_cache_gb=args.kv_cache_gb or 0.0,
        threads=args.threads,
        decode_threads=args.decode_threads,
        local_prefill_tokens=args.local_prefill_tokens,
        start_timeout_s=args.start_timeout_s,
        regime=args.regime,
        pause_s=args.pause_s,
    )

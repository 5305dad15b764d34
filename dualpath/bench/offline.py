"""Offline (RL-rollout style) benchmark: N agents start together; JCT is when the last ends.

    dualpath bench offline --preset ci --modes basic,dualpath,oracle --json results/offline.json
    dualpath bench offline --preset agentic --json results/agentic.json  # real sessions
    dualpath bench offline --preset paper-ratio --trace my_sessions.jsonl  # shaped as the preset

Each mode gets a fresh `dualpath serve` (fresh store) with the same workload and seed; the
agents talk to it over its OpenAI-compatible API (``harness.run_mode``). Link caps emulate a
cluster's SNICs on one host (SPEC §4), so every figure depends on the caps, which the JSON
records.

**Calibrated caps (``paper-ratio``, ``--rho``).** The paper's regime is a PE whose storage
reads, not its compute, limit Basic. Before the timed runs, a calibration run of ``oracle``
(uncapped) measures the PE: the hit-KV bytes it read over the PE's busy time give the rate a
PE consumes hit KV at its prefill speed, and each node's SNIC cap is set to that rate / rho;
the prompt tokens it got through per busy second set the scheduler's beta (5 s of work a PE
may hold, ``--prefill-tokens-per-s``; the server's fixed default would let a PE hold a
fraction of a second of this workload and idle while reads are in flight). Every mode,
``oracle`` included, then runs with both.
With 1P2D, Basic puts the whole demand on one SNIC (rho = 2: about 2x slower than Oracle)
while DualPath spreads it over three (rho / 3 < 1: about Oracle's speed); the ideal speedup
is max(1, rho) / max(1, rho / 3).

**The engines' KV memory (vLLM engines).** vLLM's prefix cache is a tier above the store: a
PE with room for every agent's context holds the hits itself, the store serves none, and the
calibration refuses the run (one line naming ``--kv-cache-gb``). So on vLLM engines a preset
with ``engine_kv_fraction`` (``paper-ratio``, ``agentic``: 0.2) gives each engine that fraction
of the KV of the agents' final contexts (their last prompt and output, summed over sessions),
at least one request of the model's whole context, raised to the next MB
(``presets.engine_kv_cache_gb``); ``--kv-cache-gb`` wins. The native engine keeps serve's
default: it keeps no prefix cache above the store.

**Valid or fail.** Before any server starts, every turn of the shaped workload is checked
against the model's context (and ``--max-prompt-tokens``): a turn that cannot fit would fail
in every mode, so the run is refused, naming the session, the turn and the ``--length-scale``
that fits. After the runs, a failed request, an incomplete mode or tokens that differ between
modes make the run invalid (``validity.py``): the command exits 1 and says why, and the JSON
has ``"valid": false``, the ``problems`` and no ``ratios``.

JSON (``modes.<mode>``): ``jct_s``, ``agent_jct_s`` (each agent's own JCT, percentiles),
``tokens_per_s``, ``ttft_s``/``ttst_s``/``tpot_s`` percentiles, ``hit_ratio``, ``snic_bytes``
(per SNIC), ``path_bytes.{pe,de}`` (hit KV read by each side), ``engine_cached_bytes`` (hit
KV neither side read: a vLLM PE still held it), ``snic_load_balance`` (SPEC
§7), ``snic_read_load_balance`` (hit-KV reads alone), ``snic_load_balance_busy`` (over
the windows whose mean SNIC moved at least half its cap), ``process_cpu`` (cores each
process kept busy: ``process_cpu.py``), ``pe_busy_fraction``, ``num_failed``, ``first_errors``, ``is_complete``, ``token_mismatches``
(turns whose tokens differ from the first mode's); top level ``valid``, ``problems``,
``ratios``, ``rho``, ``snic_caps_gbps``, ``prefill_tokens_per_s``, ``prompt_tokens_per_busy_s``,
``kv_bytes_per_token``, ``kv_cache_gb`` with ``kv_cache_gb_source`` ("flag", "preset rule"
or null: each engine's KV memory, ``engines_kv_cache_gb``), ``calibration_run`` (the uncapped
run the caps come from: its JCT, PE busy fraction, tokens and bytes read), ``shaping`` (the workload's shaping: ``presets.WorkloadShape``) and
``workload`` (its statistics, with ``ideal_hit_ratio``, the infinite-cache hit bound at the
servers' block size).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from dualpath.bench.hardware import hardware_info
from dualpath.bench.harness import ModeRun, run_against_url, run_mode, token_mismatches
from dualpath.bench.presets import (
    PRESETS,
    BenchPreset,
    WorkloadShape,
    engine_kv_cache_gb,
    shaped_workload,
)
from dualpath.bench.report import add_output_arguments, finish
from dualpath.bench.spec import (
    EngineSpec,
    RunSpec,
    engine_spec,
    modes_of,
    output_spec,
    workload_spec,
)
from dualpath.bench.stats import ideal_speedup
from dualpath.bench.validity import mark_validity, mode_problems
from dualpath.config import MODES, READ_PATHS, EngineConfig
from dualpath.errors import CalibrationError
from dualpath.flags import positive_float, positive_int
from dualpath.model.identity import kv_facts, kv_layout
from dualpath.model.registry import read_config
from dualpath.options import (
    add_attention_quota_argument,
    add_clones_argument,
    add_max_sessions_argument,
    add_model_argument,
    add_trace_argument,
    add_trace_shape_arguments,
    add_transport_argument,
    add_workload_seed_argument,
)
from dualpath.units import GB, bytes_per_s_to_gbps
from dualpath.vllm_args import (
    add_engine_kind_arguments,
    check_vllm_installed,
)
from dualpath.workload import Misfit, Workload, first_misfit, ideal_hit_ratio, workload_stats

# The servers' KV block (serve --block-size's default): hits are whole blocks of it.
BLOCK_SIZE_TOKENS = EngineConfig().block_size_tokens
# The servers' KV dtype (serve --dtype's default): what a token's KV costs in an engine.
KV_DTYPE = EngineConfig().dtype


def load_workload(
    shape: WorkloadShape,
    *,
    model_dir: Path,
    seed: int,
    max_prompt_tokens: int | None = None,
    num_agents: int | None = None,
) -> Workload:
    """The shaped workload (``presets.shaped_workload``), every turn checked against the
    model's context and ``max_prompt_tokens``: ``ValueError`` naming the first turn that does
    not fit and the ``--length-scale`` that would, before any server starts."""
    from dualpath.model.registry import read_config

    config = read_config(Path(model_dir) / "config.json")

    def build(one: WorkloadShape) -> Workload:
        return shaped_workload(
            one,
            seed=seed,
            vocab_size=config.vocab_size,
            avoid_token_ids=tuple(config.eos_token_ids),
            num_agents=num_agents,
        )

    def misfit_of(workload: Workload) -> Misfit | None:
        return first_misfit(
            workload,
            max_model_len=config.max_position_embeddings,
            max_prompt_tokens=max_prompt_tokens,
        )

    workload = build(shape)
    misfit = misfit_of(workload)
    if misfit is None:
        return workload
    fitting = fitting_length_scale(shape, misfit, lambda s: misfit_of(build(s)) is None)
    fix = (
        f"rerun with --length-scale {fitting:g} (now {shape.length_scale:g}; about the "
        "largest that fits)"
        if fitting is not None
        else "no --length-scale fits it: raise --max-prompt-tokens or use a longer-context --model"
    )
    raise ValueError(
        f"the workload does not fit {Path(model_dir).name}: {misfit.describe()}; every mode "
        f"would fail those requests, so no server was started: {fix}"
    )


def fitting_length_scale(
    shape: WorkloadShape,
    misfit: Misfit,
    fits: Callable[[WorkloadShape], bool],
    max_tries: int = 8,
) -> float | None:
    """A two-significant-digit ``length_scale`` at which ``fits(shape)`` holds: the current one
    divided by the misfit's overshoot, rounded down, then 3% less at a time (lengths scale a
    little unevenly: blocks and outputs round, a clone's first turn does not scale); None if
    none within ``max_tries``."""
    candidate = _round_down(shape.length_scale / misfit.max_fill)
    for _ in range(max_tries):
        if candidate <= 0:
            return None
        if fits(replace(shape, length_scale=candidate)):
            return candidate
        candidate = _round_down(candidate * 0.97)
    return None


def _round_down(value: float) -> float:
    """``value`` cut to two significant digits (0.1249 -> 0.12)."""
    if value <= 0:
        return 0.0
    unit = 10.0 ** (math.floor(math.log10(value)) - 1)
    return round(math.floor(value / unit + 1e-9) * unit, 12)


def checked_preset(preset_name: str, modes: list[str]) -> BenchPreset:
    """The named preset; ``ValueError`` naming an unknown preset or mode."""
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown modes {unknown or modes}; choose from {', '.join(MODES)}")
    return PRESETS[preset_name]


def oracle_run(preset: BenchPreset, model_dir: Path, engine: EngineSpec) -> ModeRun:
    """The preset's cluster in ``oracle`` mode on ``engine`` (other modes:
    ``replace(run, mode=...)``)."""
    return ModeRun(
        mode="oracle",
        model_dir=Path(model_dir),
        nodes=preset.nodes,
        snic_bandwidth_gbps=preset.snic_bandwidth_gbps or 0.0,
        read_path=engine.read_path,
        transport=engine.transport,
        max_prompt_tokens=engine.max_prompt_tokens,
        engine=engine.engine,
        vllm_args=engine.vllm_args,
        kv_cache_gb=engine.kv_cache_gb,
        vllm_prefill_batching=engine.vllm_prefill_batching,
        attention_quota_s=engine.attention_quota_s,
    )


def check_engine_modes(engine: str) -> None:
    """``ValueError`` before any server starts for an engine kind this Python cannot run (the
    servers run it)."""
    if engine == "vllm":
        check_vllm_installed()


def engine_report(run: ModeRun, kv_cache_gb_source: str | None) -> dict:
    """The JSON's ``engine``, ``vllm_args``, ``kv_cache_gb`` (null: the server's default) with
    ``kv_cache_gb_source`` ("flag", "preset rule" or null: ``engines_kv_cache_gb``), and
    ``vllm_prefill_batching`` and ``attention_quota_s`` (null: serve's): what ran the model in
    every server, with how much KV memory, and how a prefill engine batched."""
    return {
        "engine": run.engine,
        "vllm_args": dict(run.vllm_args),
        "kv_cache_gb": run.kv_cache_gb,
        "kv_cache_gb_source": kv_cache_gb_source,
        "vllm_prefill_batching": run.vllm_prefill_batching,
        "attention_quota_s": run.attention_quota_s,
    }


def engines_kv_cache_gb(
    preset: BenchPreset,
    workload: Workload,
    model_dir: Path,
    *,
    engine: str,
    kv_cache_gb: float | None,
) -> tuple[float | None, str | None]:
    """Each engine's KV memory (GB) and where it came from: ``--kv-cache-gb`` ("flag"); else,
    on vLLM engines, the preset's ``engine_kv_fraction`` of the KV of ``workload``'s final
    contexts, at least one request of the model's context ("preset rule":
    ``presets.engine_kv_cache_gb``); else None, None (serve's default).

    NOTE: the native engine keeps serve's default: it holds no prefix cache above the store
    (every hit is read from the store, whatever its KV memory), so its runs are in the
    presets' regime already, and less memory would only shrink the decode engines' batches."""
    if kv_cache_gb is not None:
        return kv_cache_gb, "flag"
    if engine != "vllm" or preset.engine_kv_fraction is None:
        return None, None
    config = read_config(Path(model_dir) / "config.json")
    layout = kv_layout(config, KV_DTYPE, BLOCK_SIZE_TOKENS)
    # The servers run the model's whole context (no --max-model-len), and an engine refuses to
    # start without the blocks of one such request (``capacity.check_device_cache``).
    num_blocks = -(-config.max_position_embeddings // layout.block_size_tokens)
    size_gb = engine_kv_cache_gb(
        workload,
        fraction=preset.engine_kv_fraction,
        kv_bytes_per_token=layout.full_block_bytes / layout.block_size_tokens,
        min_bytes=num_blocks * layout.full_block_bytes,
    )
    return size_gb, "preset rule"


def workload_report(workload: Workload, shape: WorkloadShape) -> dict:
    """The JSON's ``shaping`` and ``workload`` (statistics and the hit bound at the servers'
    block size, from the prompts this run replays)."""
    stats = workload_stats(workload, block_size_tokens=BLOCK_SIZE_TOKENS)
    return {"shaping": asdict(shape), "workload": {"source": workload.source, **asdict(stats)}}


def run_offline(spec: RunSpec) -> dict:
    """Every mode of ``spec`` on its shaped workload; the report, ``valid`` or not
    (``validity.py``)."""
    preset = run_preset(spec)
    shape = spec.workload.shape(preset)
    workload = load_workload(
        shape,
        model_dir=spec.model_dir,
        seed=spec.workload.seed,
        max_prompt_tokens=spec.engine.max_prompt_tokens,
    )
    if preset.snic_bandwidth_gbps is None:
        check_calibration_workload(workload, calibrated_by(spec))
    base, kv_cache_gb_source = base_run(spec, preset, workload)
    report: dict = {
        **run_header("offline", spec, preset, base, kv_cache_gb_source),
        "transport": spec.engine.transport,
        "read_path": spec.engine.read_path,
        **workload_report(workload, shape),
        "hardware": hardware_info(),
    }
    with tempfile.TemporaryDirectory(prefix="dualpath-bench-") as tmp:
        root = Path(spec.output.work_dir or tmp)
        if preset.snic_bandwidth_gbps is None:
            assert preset.rho is not None, "a calibrated preset names its rho"
            base, calibration, problems = calibrated_run(
                base, preset.rho, workload, root / "calibration", progress=spec.output.progress
            )
            if problems:  # caps from a broken run would be wrong: no timed run
                report["modes"] = {}
                return mark_validity(report, problems)
            report.update(calibration)
        results = {
            mode: run_mode(
                replace(base, mode=mode),
                workload,
                work_dir=root / mode,
                progress=spec.output.progress,
            )
            for mode in dict.fromkeys(spec.modes)  # a mode named twice runs once
        }
    report["link_caps_emulated"] = base.snic_bandwidth_gbps > 0
    report["snic_caps_gbps"] = base.snic_bandwidth_gbps
    report["modes"] = results
    finish_report(report, list(spec.modes))
    return report


def run_preset(spec: RunSpec) -> BenchPreset:
    """``spec``'s preset, calibrated to ``spec.rho`` where given; ``ValueError`` for an
    unknown preset or mode, or an engine kind this Python cannot run."""
    preset = checked_preset(spec.workload.preset, list(spec.modes))
    check_engine_modes(spec.engine.engine)
    if spec.rho is not None:
        preset = replace(preset, snic_bandwidth_gbps=None, rho=spec.rho)
    return preset


def calibrated_by(spec: RunSpec) -> str:
    """The flag that asked for calibration (``--preset paper-ratio``, ``--rho 2``)."""
    return f"--preset {spec.workload.preset}" if spec.rho is None else f"--rho {spec.rho:g}"


def base_run(spec: RunSpec, preset: BenchPreset, workload: Workload) -> tuple[ModeRun, str | None]:
    """The oracle run every mode starts from, its engines' KV memory sized for ``workload``
    (``engines_kv_cache_gb``), and where that size came from."""
    kv_cache_gb, source = engines_kv_cache_gb(
        preset,
        workload,
        spec.model_dir,
        engine=spec.engine.engine,
        kv_cache_gb=spec.engine.kv_cache_gb,
    )
    engine = replace(spec.engine, kv_cache_gb=kv_cache_gb)
    return oracle_run(preset, spec.model_dir, engine), source


def run_header(
    benchmark: str,
    spec: RunSpec,
    preset: BenchPreset,
    base: ModeRun,
    kv_cache_gb_source: str | None,
) -> dict:
    """The report's first keys: the benchmark, its preset, seed, model and engines."""
    model_dir = spec.model_dir
    return {
        "benchmark": benchmark,
        "preset": spec.workload.preset,
        "preset_config": asdict(preset),
        "seed": spec.workload.seed,
        "model_dir": str(model_dir),
        "model": kv_facts(read_config(Path(model_dir) / "config.json")),
        **engine_report(base, kv_cache_gb_source),
    }


def calibrated_run(
    base: ModeRun, rho: float, workload: Workload, work_dir: Path, *, progress: bool
) -> tuple[ModeRun, dict, list[str]]:
    """``base`` (oracle, uncapped) run on ``workload``, and the SNIC caps and beta calibrated on
    it (``calibrate``): the run with them, the report's calibration keys, and [] for problems;
    or ``base`` unchanged, {} and why the calibration run is not a result."""
    oracle = run_mode(base, workload, work_dir=work_dir, progress=progress)
    problems = mode_problems("calibration (oracle, uncapped)", oracle)
    if problems:
        return base, {}, problems
    calibration = calibrate(oracle, rho, base.model_dir, kv_cache_gb=base.kv_cache_gb)
    calibrated = replace(
        base,
        snic_bandwidth_gbps=calibration["snic_caps_gbps"],
        prefill_tokens_per_s=calibration["prompt_tokens_per_busy_s"],
    )
    return calibrated, calibration, []


def check_calibration_workload(workload: Workload, what: str) -> None:
    """``ValueError`` before any server starts when ``calibrate`` could not work on
    ``workload``: the caps come from the hit KV the calibration run reads from the store, and
    a workload whose turns never reuse a whole block of an earlier turn reads none. ``what``
    names the flag that asked for calibration (``--preset paper-ratio``, ``--rho 2``)."""
    if ideal_hit_ratio(workload, block_size_tokens=BLOCK_SIZE_TOKENS) > 0:
        return
    max_turns = max(session.num_turns for session in workload.sessions)
    reason = (
        f"every one of its {workload.num_sessions} sessions has a single turn"
        if max_turns == 1
        else f"none of its {workload.num_sessions} sessions' turns starts with a whole "
        f"{BLOCK_SIZE_TOKENS}-token block of an earlier turn (a larger --length-scale makes "
        "prompts longer)"
    )
    fixed = ", ".join(name for name, p in PRESETS.items() if p.snic_bandwidth_gbps is not None)
    raise ValueError(
        f"{what} calibrates the SNIC caps on the hit KV a prefill engine reads from the KV "
        f"store, but this workload has no hits: {reason}; replay multi-turn sessions (a "
        f"--trace whose turns extend earlier ones, or leave --trace out), or use a preset with "
        f"fixed caps ({fixed}) without --rho"
    )


def calibrate(
    oracle: dict, rho: float, model_dir: Path, *, kv_cache_gb: float | None = None
) -> dict:
    """SNIC caps from an uncapped run: cap = (hit-KV bytes a PE consumes per second of
    prefill) / rho. ``CalibrationError`` naming what to change when the run cannot give them:
    it read no hit KV from the store, or its prefill engine's own prefix cache held most of
    the hits (``kv_cache_gb``: the engines' KV memory it ran with, None: serve's default)."""
    layout = kv_layout(read_config(Path(model_dir) / "config.json"), KV_DTYPE, BLOCK_SIZE_TOKENS)
    kv_bytes_per_token = layout.full_block_bytes / layout.block_size_tokens
    busy_s = oracle["pe_busy_fraction"] * oracle["jct_s"]
    hit_bytes = sum(oracle["path_bytes"].values())
    held_bytes = oracle.get("engine_cached_bytes") or 0
    if held_bytes > hit_bytes:
        memory = "serve's default" if kv_cache_gb is None else f"{kv_cache_gb:g} GB"
        raise CalibrationError(
            f"in the calibration run the prefill engine's own prefix cache held "
            f"{held_bytes / (held_bytes + hit_bytes):.0%} of the hit KV "
            f"({held_bytes / GB:.3f} GB; {hit_bytes / GB:.3f} GB came from the store), so no "
            "SNIC cap makes the store's reads the bottleneck (the regime rho describes): give "
            f"the engines less KV memory than their {memory} (--kv-cache-gb) or replay more "
            "agents' contexts than it holds"
        )
    if busy_s <= 0 or hit_bytes <= 0:
        raise CalibrationError(
            f"the calibration run read {hit_bytes} bytes of hit KV from the store in "
            f"{busy_s:.3g} s of prefill: no SNIC cap can be computed from it; replay sessions "
            "whose turns extend earlier ones (leave --trace out), or use a preset with fixed "
            "caps without --rho"
        )
    demand_bytes_per_s = hit_bytes / busy_s
    return {
        "rho": rho,
        "snic_caps_gbps": bytes_per_s_to_gbps(demand_bytes_per_s / rho),
        "pe_hit_kv_demand_gbps": bytes_per_s_to_gbps(demand_bytes_per_s),
        "prefill_tokens_per_s": (oracle["prompt_tokens"] - oracle["cached_tokens"]) / busy_s,
        # Prompt tokens (cached + new) per PE-busy second: the unit of the scheduler's tok_e,
        # so beta (5 s of it) lets a PE hold 5 s of this workload's work.
        "prompt_tokens_per_busy_s": oracle["prompt_tokens"] / busy_s,
        "kv_bytes_per_token": kv_bytes_per_token,
        "ideal_speedup": ideal_speedup(rho),
        "calibration_run": calibration_figures(oracle),
    }


def calibration_figures(oracle: dict) -> dict:
    """What the caps were computed from (the JSON's ``calibration_run``)."""
    keys = (
        "jct_s", "pe_busy_fraction", "prompt_tokens", "cached_tokens", "path_bytes",
        "engine_cached_bytes",
    )  # fmt: skip
    return {key: oracle.get(key) for key in keys}


def finish_report(report: dict, modes: list[str]) -> dict:
    """Token mismatches against the first mode, the ratios between modes, and whether the run
    is a result at all (no ratio survives an invalid run)."""
    results = report["modes"]
    reference = results[modes[0]]["tokens"]
    for result in results.values():
        result["token_mismatches"] = token_mismatches(result.pop("tokens"), reference)
    ratios = {}
    if "basic" in results:
        for mode, r in results.items():
            if mode != "basic":
                ratios[f"{mode}_vs_basic_jct"] = results["basic"]["jct_s"] / r["jct_s"]
    if "oracle" in results:
        for mode, r in results.items():
            if mode != "oracle":
                ratios[f"{mode}_vs_oracle_jct"] = r["jct_s"] / results["oracle"]["jct_s"]
    report["ratios"] = ratios
    problems = [
        problem
        for mode, result in results.items()
        for problem in mode_problems(
            mode,
            result,
            reference=modes[0],
            kv_bytes_per_token=report.get("model", {}).get("kv_bytes_per_token"),
        )
    ]
    return mark_validity(report, problems)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``bench offline`` and ``bench online``."""
    parser.add_argument(
        "--preset", default="ci", choices=sorted(PRESETS), help="workload + cluster (default ci)"
    )
    parser.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated modes to compare, in order (of {', '.join(MODES)}; "
        "default basic,dualpath,oracle)",
    )
    add_model_argument(parser, tiny=True)
    add_workload_seed_argument(parser)
    add_trace_argument(parser)
    add_max_sessions_argument(parser, default=None, default_help="the preset's agents")
    add_trace_shape_arguments(
        parser,
        defaults={"length_scale": None, "max_turns": None, "gen_scale": None},
        default_help={
            "length_scale": "the preset's",
            "max_turns": "the preset's cap",
            "gen_scale": "the preset's",
        },
        where="a trace's too: ",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=None,
        help="the servers' longest prompt (serve --max-prompt-tokens; default the model's "
        "context minus one): the workload is checked against it before any server starts",
    )
    parser.add_argument(
        "--url",
        default=None,
        help="run the agents against this OpenAI-compatible server instead of starting ours "
        "(not with --modes; link figures are then null)",
    )
    parser.add_argument("--api-key", default=None, help="bearer key for --url")
    parser.add_argument("--served-model-name", default=None, help="model id to request from --url")
    add_transport_argument(parser)
    parser.add_argument(
        "--read-path",
        choices=READ_PATHS,
        default=None,
        help="force one read path in every mode (default: each mode's own)",
    )
    add_engine_kind_arguments(parser, where="every server the benchmark starts")
    parser.add_argument(
        "--kv-cache-gb",
        type=positive_float,
        default=None,
        help="each engine's device KV memory, GB (serve --kv-cache-gb). On vLLM engines it "
        "also bounds the prefill engine's own prefix cache, a tier above the store: a regime "
        "where storage supplies the hits needs it well below the agents' KV (default: on vLLM "
        "engines, paper-ratio and agentic give a fifth of the agents' final contexts' KV, at "
        "least one request of the model's context; otherwise serve's)",
    )
    add_attention_quota_argument(parser, default_help="serve's")
    add_output_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_clones_argument(parser, default=None, default_help="the preset's")
    parser.add_argument(
        "--rho",
        type=_rho_values,
        default=None,
        help="calibrate SNIC caps to this hit-KV demand over one SNIC (e.g. 2), or a sweep "
        "0.5,1,2,3 (each value runs the modes; plotted against the ideal speedup)",
    )


def check_url_flags(args: argparse.Namespace) -> None:
    """``ValueError`` for flags that only speak to a ``--url`` server, given without it."""
    given = [
        flag
        for flag, value in (
            ("--api-key", args.api_key),
            ("--served-model-name", args.served_model_name),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)}: only for a server of your own (bench offline --url); the "
            "servers the benchmark starts need neither"
        )


def _rho_values(text: str) -> list[float]:
    """``--rho``: one value or a comma-separated sweep, each finite and > 0 (a cap is the
    demand divided by it)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < value < math.inf for value in values):
        raise argparse.ArgumentTypeError(
            f"expected a number > 0 or a comma-separated sweep of them (0.5,1,2,3), got {text!r}"
        )
    return values


def main(args: argparse.Namespace) -> int:
    from dualpath.model.default import resolve_model_dir

    model_dir = resolve_model_dir(args.model, tiny=True)
    if args.url is not None:
        if args.modes is not None:
            raise ValueError("--url runs against one existing server: do not give --modes")
        if args.engine != "native" or args.vllm_arg:
            raise ValueError("--url runs against one existing server: do not give --engine")
        return finish(_run_url(args, model_dir), args, "offline")
    check_url_flags(args)
    spec = run_spec(args, model_dir)
    reports = [run_offline(replace(spec, rho=rho)) for rho in args.rho or [None]]
    if len(reports) == 1:
        return finish(reports[0], args, "offline")
    problems = [f"rho {r['rho']:g}: {p}" for r in reports for p in r["problems"]]
    sweep = {"benchmark": "offline-rho-sweep", "runs": reports}
    return finish(mark_validity(sweep, problems), args, "offline")


def run_spec(args: argparse.Namespace, model_dir: Path) -> RunSpec:
    """``bench offline``'s command line as one run (a ``--rho`` sweep: one per value)."""
    return RunSpec(
        model_dir=model_dir,
        workload=workload_spec(args),
        modes=modes_of(args.modes, "basic,dualpath,oracle"),
        engine=engine_spec(args),
        output=output_spec(args),
    )


def _run_url(args: argparse.Namespace, model_dir: Path) -> dict:
    """The agents against ``--url``: one "mode", validity as for our own servers."""
    workload_of = workload_spec(args)
    shape = workload_of.shape(PRESETS[args.preset])
    workload = load_workload(
        shape, model_dir=model_dir, seed=args.seed, max_prompt_tokens=args.max_prompt_tokens
    )
    result = run_against_url(
        args.url, args.served_model_name or model_dir.name, workload, api_key=args.api_key
    )
    result.pop("tokens")
    report = {
        "benchmark": "offline",
        "url": args.url,
        "preset": args.preset,
        "seed": args.seed,
        **workload_report(workload, shape),
        "modes": {"url": result},
    }
    return mark_validity(report, mode_problems("url", result))

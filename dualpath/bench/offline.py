"""Offline (RL-rollout style) benchmark: N agents start together; JCT is when the last ends.

    dualpath bench offline --preset ci --modes basic,dualpath,oracle --json results/offline.json
    dualpath bench offline --preset agentic --json results/agentic.json  # real sessions
    dualpath bench offline --preset paper-ratio --trace my_sessions.jsonl  # shaped as the preset
    dualpath bench offline --vllm-servers --preset paper-ratio  # from .venv-vllm

Each mode gets a fresh `dualpath serve` (fresh store) with the same workload and seed; the
agents talk to it over its OpenAI-compatible API (``harness.run_mode``). Link caps emulate a
cluster's SNICs on one host (SPEC §4), so every figure depends on the caps, which the JSON
records. With ``--vllm-servers`` every mode's cluster is DualPath inside vLLM servers instead:
one vLLM OpenAI server per engine, made one by ``dualpath vllm-config``, behind ``dualpath
serve --external-engines`` (``served_run.py``: where each setting goes, what is refused); the
JSON's ``engine`` is then ``"vllm-servers"``.

**Calibrated caps (``paper-ratio``, ``--rho``).** Before the timed runs, an uncapped ``oracle``
run measures the PE, and the SNIC caps and the scheduler's beta are set from it
(``calibration.py``; or from a recorded one, ``--calibration``); every mode, ``oracle``
included, then runs with both.

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
(per SNIC), ``path_bytes.{pe,de}`` (hit KV read by each side), ``engine_cached_bytes`` (hit KV
neither side read: a vLLM PE still held it), ``store_hit_tokens`` (prompt tokens the server
placed as store hits: what the hit-KV rule checks the reads against), ``replaced_hit_tokens``
(those of the placements a front door made again: read again, and counted by the rule too),
``forwarded_replacements`` (``--vllm-servers``: requests placed again), ``snic_load_balance``
(SPEC §7), ``snic_read_load_balance`` (hit-KV reads alone), ``snic_load_balance_busy`` (over
the windows whose mean SNIC moved at least half its cap), ``process_cpu`` (cores each process
kept busy: ``process_cpu.py``), ``pe_busy_fraction``, ``num_failed``, ``first_errors``,
``is_complete``, ``token_mismatches`` (turns whose tokens differ from the first mode's),
``server_exit_code`` (and with ``--vllm-servers``, ``vllm_server_exit_codes``); top level
``valid``, ``problems``, ``ratios``, ``rho``, ``snic_caps_gbps``, ``prefill_tokens_per_s``,
``prompt_tokens_per_busy_s``, ``kv_bytes_per_token``, ``kv_cache_gb`` with
``kv_cache_gb_source`` ("flag", "preset rule" or null: each engine's KV memory,
``engines_kv_cache_gb``), ``calibration_run`` (the uncapped run the caps come from: its JCT, PE
busy fraction, tokens and bytes read), ``calibration_source`` ("recorded", "recorded by this
run", "this run") with ``calibration_record`` (where, when and by which command), ``shaping``
(the workload's shaping: ``presets.WorkloadShape``) and ``workload`` (its statistics, with
``ideal_hit_ratio``, the infinite-cache hit bound at the servers' block size).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from dualpath.bench.arguments import add_workload_arguments, calibration_settings, check_url_flags
from dualpath.bench.calibration import (
    calibrated_run,
    calibration_source,
    check_calibration_flags,
    check_calibration_workload,
)
from dualpath.bench.hardware import hardware_info
from dualpath.bench.harness import ModeRun, run_against_url, run_mode, token_mismatches
from dualpath.bench.kernel_links import KernelTestbed, links_testbed
from dualpath.bench.presets import (
    PRESETS,
    BenchPreset,
    WorkloadShape,
    engine_kv_cache_gb,
    fitting_length_scale,
    shaped_workload,
)
from dualpath.bench.report import finish
from dualpath.bench.spec import (
    BLOCK_SIZE_TOKENS,
    KV_DTYPE,
    VLLM_SERVERS,
    EngineSpec,
    RunSpec,
    engine_spec,
    modes_of,
    output_spec,
    workload_spec,
)
from dualpath.bench.validity import mark_validity, mode_problems
from dualpath.config import MODES
from dualpath.engine.capacity import num_device_blocks_needed
from dualpath.model.identity import kv_facts, kv_layout
from dualpath.model.registry import read_config
from dualpath.options import add_clones_argument
from dualpath.vllm.args import check_vllm_installed
from dualpath.vllm.bench.served_run import check_served_engine
from dualpath.workload import Misfit, Workload, first_misfit, workload_stats

# The engine kinds that run vLLM (with a prefix cache above the store: engines_kv_cache_gb).
VLLM_ENGINES = ("vllm", VLLM_SERVERS)


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


def check_engine(engine: EngineSpec) -> None:
    """``ValueError`` before any server starts for an engine kind this Python cannot run (the
    servers run it), or vLLM settings the vLLM servers cannot take (``--vllm-servers``)."""
    if engine.engine == VLLM_SERVERS:
        if engine.links != "emulated":
            raise ValueError(
                "--links kernel runs our engine processes on the test hosts (--engine native "
                "or vllm), not --vllm-servers"
            )
        check_served_engine(dict(engine.vllm_args), engine.vllm_prefill_batching)
    if engine.engine in VLLM_ENGINES:
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
    if engine not in VLLM_ENGINES or preset.engine_kv_fraction is None:
        return None, None
    config = read_config(Path(model_dir) / "config.json")
    layout = kv_layout(config, KV_DTYPE, BLOCK_SIZE_TOKENS)
    # The servers run the model's whole context (no --max-model-len), and a vLLM engine refuses
    # to start without the blocks of one such request and its null block
    # (``capacity.num_device_blocks_needed``).
    num_blocks = num_device_blocks_needed(
        layout.block_size_tokens, config.max_position_embeddings, engine="vllm"
    )
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


def run_offline(spec: RunSpec, testbed: KernelTestbed | None = None) -> dict:
    """Every mode of ``spec`` on its shaped workload; the report, ``valid`` or not
    (``validity.py``). ``--links kernel`` builds its test hosts for the run, or runs on
    ``testbed``'s."""
    preset = run_preset(spec)
    shape = spec.workload.shape(preset)
    workload = load_workload(
        shape,
        model_dir=spec.model_dir,
        seed=spec.workload.seed,
        max_prompt_tokens=spec.engine.max_prompt_tokens,
    )
    check_calibration_flags(spec, preset)
    if preset.snic_bandwidth_gbps is None:
        check_calibration_workload(workload, calibrated_by(spec))
    base, kv_cache_gb_source = base_run(spec, preset, workload)
    report: dict = {
        **run_header("offline", spec, preset, base, kv_cache_gb_source),
        "transport": spec.engine.transport,
        "read_path": spec.engine.read_path,
        "links": spec.engine.links,
        **workload_report(workload, shape),
        "hardware": hardware_info(),
    }
    with (
        tempfile.TemporaryDirectory(prefix="dualpath-bench-") as tmp,
        links_testbed(spec.engine.links, base.nodes, given=testbed) as testbed,
    ):
        root = Path(spec.output.work_dir or tmp)
        base = replace(base, testbed=testbed)
        if preset.snic_bandwidth_gbps is None:
            assert preset.rho is not None, "a calibrated preset names its rho"
            base, calibration, problems = calibrated_run(
                base,
                preset.rho,
                workload,
                root / "calibration",
                progress=spec.output.progress,
                **calibration_source(spec),
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
    check_engine(spec.engine)
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
        ours = (args.engine != "native", args.vllm_arg, args.vllm_servers, args.calibration)
        if any(ours) or args.calibration_runs is not None or args.links != "emulated":
            raise ValueError(
                "--url runs against one existing server: do not give --engine, --vllm-servers, "
                "--calibration, --calibration-runs or --links"
            )
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
        **calibration_settings(args),
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

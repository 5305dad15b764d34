"""Offline (RL-rollout style) benchmark: N agents start together; JCT is when the last ends.

    dualpath bench offline --preset ci --modes basic,dualpath,oracle --json results/offline.json

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

JSON (``modes.<mode>``): ``jct_s``, ``tokens_per_s``, ``ttft_s``/``ttst_s``/``tpot_s``
percentiles, ``hit_ratio``, ``snic_bytes`` (per SNIC), ``path_bytes.{pe,de}`` (hit KV read by
each side), ``snic_load_balance``, ``pe_busy_fraction``, ``token_mismatches`` (turns whose
tokens differ from the first mode's); top level ``ratios``, ``rho``, ``snic_caps_gbps``,
``prefill_tokens_per_s``, ``prompt_tokens_per_busy_s``, ``kv_bytes_per_token``, ``workload``
(its statistics).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from dualpath.bench.hardware import hardware_info
from dualpath.bench.harness import ModeRun, run_against_url, run_mode, token_mismatches
from dualpath.bench.presets import PRESETS, BenchPreset, preset_workload
from dualpath.bench.report import write_outputs
from dualpath.config import MODES, READ_PATHS
from dualpath.units import bytes_per_s_to_gbps
from dualpath.workload import Workload, load_mooncake_trace, workload_stats


def ideal_speedup(rho: float, num_snics: int = 3) -> float:
    """DualPath over Basic when only SNICs limit: Basic's one SNIC carries rho, DualPath's
    ``num_snics`` carry rho / num_snics each (SPEC §5; 1P2D has three)."""
    return max(1.0, rho) / max(1.0, rho / num_snics)


def load_workload(
    preset: BenchPreset,
    *,
    model_dir: Path,
    seed: int,
    trace: Path | None = None,
    max_sessions: int | None = None,
    length_scale: float | None = None,
) -> Workload:
    """The preset's synthetic trajectories, or a Mooncake-format trace (every session
    arriving at 0 for an offline run)."""
    from dualpath.model.config import ModelConfig

    config = ModelConfig.from_file(Path(model_dir) / "config.json")
    avoid = tuple(config.eos_token_ids)
    if trace is None:
        return preset_workload(
            preset,
            seed=seed,
            vocab_size=config.vocab_size,
            avoid_token_ids=avoid,
            num_agents=max_sessions,
            length_scale=length_scale,
        )
    workload = load_mooncake_trace(
        trace,
        vocab_size=config.vocab_size,
        seed=seed,
        avoid_token_ids=avoid,
        max_sessions=max_sessions,
        length_scale=length_scale or 1.0,
    )
    return workload.with_arrival_offsets([0.0] * workload.num_sessions)


def checked_preset(preset_name: str, modes: list[str]) -> BenchPreset:
    """The named preset; ``ValueError`` naming an unknown preset or mode."""
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown modes {unknown or modes}; choose from {', '.join(MODES)}")
    return PRESETS[preset_name]


def oracle_run(
    preset: BenchPreset, model_dir: Path, *, transport: str, read_path: str | None = None
) -> ModeRun:
    """The preset's cluster in ``oracle`` mode (other modes: ``replace(run, mode=...)``)."""
    return ModeRun(
        mode="oracle",
        model_dir=Path(model_dir),
        nodes=preset.nodes,
        snic_bandwidth_gbps=preset.snic_bandwidth_gbps or 0.0,
        read_path=read_path,
        transport=transport,
    )


def run_offline(
    modes: list[str],
    preset_name: str,
    *,
    model_dir: Path,
    seed: int = 0,
    work_dir: Path | None = None,
    transport: str = "nixl",
    read_path: str | None = None,
    rho: float | None = None,
    trace: Path | None = None,
    max_sessions: int | None = None,
    length_scale: float | None = None,
    progress: bool = True,
) -> dict:
    preset = checked_preset(preset_name, modes)
    if rho is not None:
        preset = replace(preset, snic_bandwidth_gbps=None, rho=rho)
    workload = load_workload(
        preset,
        model_dir=model_dir,
        seed=seed,
        trace=trace,
        max_sessions=max_sessions,
        length_scale=length_scale,
    )
    base = oracle_run(preset, model_dir, transport=transport, read_path=read_path)
    report: dict = {
        "benchmark": "offline",
        "preset": preset_name,
        "preset_config": asdict(preset),
        "seed": seed,
        "model_dir": str(model_dir),
        "transport": transport,
        "read_path": read_path,
        "workload": {"source": workload.source, **asdict(workload_stats(workload))},
        "hardware": hardware_info(),
    }
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dualpath-bench-") as tmp:
        root = Path(work_dir or tmp)
        if preset.snic_bandwidth_gbps is None:
            assert preset.rho is not None, "a calibrated preset names its rho"
            oracle = run_mode(base, workload, work_dir=root / "calibration", progress=progress)
            calibration = calibrate(oracle, preset.rho, model_dir)
            report.update(calibration)
            base = replace(
                base,
                snic_bandwidth_gbps=calibration["snic_caps_gbps"],
                prefill_tokens_per_s=calibration["prompt_tokens_per_busy_s"],
            )
        for mode in modes:
            if mode not in results:
                run = replace(base, mode=mode)
                results[mode] = run_mode(run, workload, work_dir=root / mode, progress=progress)
    report["link_caps_emulated"] = base.snic_bandwidth_gbps > 0
    report["snic_caps_gbps"] = base.snic_bandwidth_gbps
    report["modes"] = {mode: results[mode] for mode in modes}
    _finish(report, modes)
    return report


def calibrate(oracle: dict, rho: float, model_dir: Path) -> dict:
    """SNIC caps from an uncapped run: cap = (hit-KV bytes a PE consumes per second of
    prefill) / rho."""
    from dualpath.model.identity import checkpoint_kv_identity

    _, identity = checkpoint_kv_identity(Path(model_dir), "float32", 64)
    kv_bytes_per_token = identity.layout.full_block_bytes / identity.layout.block_size_tokens
    busy_s = oracle["pe_busy_fraction"] * oracle["jct_s"]
    hit_bytes = sum(oracle["path_bytes"].values())
    if busy_s <= 0 or hit_bytes <= 0:
        raise RuntimeError("calibration run read no hit KV or never prefilled: cannot fix caps")
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
    }


def _finish(report: dict, modes: list[str]) -> None:
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
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--trace", type=Path, default=None, help="replay a Mooncake-format JSONL trace instead"
    )
    parser.add_argument(
        "--max-sessions", type=int, default=None, help="agents (sessions) to replay"
    )
    parser.add_argument(
        "--length-scale",
        type=float,
        default=None,
        help="multiply every length (prompts, appends, outputs) by this (default: the preset's)",
    )
    parser.add_argument(
        "--url",
        default=None,
        help="run the agents against this OpenAI-compatible server instead of starting ours "
        "(not with --modes; link figures are then null)",
    )
    parser.add_argument("--api-key", default=None, help="bearer key for --url")
    parser.add_argument("--served-model-name", default=None, help="model id to request from --url")
    parser.add_argument("--transport", choices=("nixl", "shm"), default="nixl")
    parser.add_argument(
        "--read-path",
        choices=READ_PATHS,
        default=None,
        help="force one read path in every mode (default: each mode's own)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="write the Markdown summary and PNG plots here (default: beside --json)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument(
        "--rho",
        default=None,
        help="calibrate SNIC caps to this hit-KV demand over one SNIC (e.g. 2), or a sweep "
        "0.5,1,2,3 (each value runs the modes; plotted against the ideal speedup)",
    )


def main(args: argparse.Namespace) -> int:
    from dualpath.cli import _resolve_model

    model_dir = _resolve_model(args.model, tiny=True)
    if args.url is not None:
        if args.modes is not None:
            raise ValueError("--url runs against one existing server: do not give --modes")
        preset = PRESETS[args.preset]
        workload = load_workload(
            preset,
            model_dir=model_dir,
            seed=args.seed,
            trace=args.trace,
            max_sessions=args.max_sessions,
            length_scale=args.length_scale,
        )
        result = run_against_url(
            args.url, args.served_model_name or model_dir.name, workload, api_key=args.api_key
        )
        result.pop("tokens")
        report = {"benchmark": "offline", "url": args.url, "preset": args.preset, "modes": {}}
        report["modes"]["url"] = result
        _write(report, args)
        return 0
    modes = [m.strip() for m in (args.modes or "basic,dualpath,oracle").split(",") if m.strip()]
    rhos = [float(x) for x in args.rho.split(",")] if args.rho else [None]
    reports = [
        run_offline(
            modes,
            args.preset,
            model_dir=model_dir,
            seed=args.seed,
            transport=args.transport,
            read_path=args.read_path,
            rho=rho,
            trace=args.trace,
            max_sessions=args.max_sessions,
            length_scale=args.length_scale,
        )
        for rho in rhos
    ]
    report = (
        reports[0] if len(reports) == 1 else {"benchmark": "offline-rho-sweep", "runs": reports}
    )
    _write(report, args)
    return 0


def _write(report: dict, args: argparse.Namespace) -> None:
    write_outputs(report, json_path=args.json, out_dir=args.out_dir, default_stem="offline")

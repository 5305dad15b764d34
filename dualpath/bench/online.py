"""Online benchmark: agents arrive as a Poisson process; SLO attainment and capacity.

    dualpath bench online --preset ci --modes basic,dualpath --aps 2 --json results/online.json
    dualpath bench online --preset paper-ratio --modes basic,dualpath --find-capacity
    dualpath bench online --preset agentic --modes basic,dualpath --find-capacity

**SLO (SPEC §7, scaled to this machine).** By default TTFT <= 4 x and TPOT <= 4 x Oracle's
*unloaded* p50 (one agent alone, measured once per invocation and recorded in the JSON);
``--slo-ttft-s`` / ``--slo-tpot-s`` fix them instead, and ``--slo-basis basic`` takes the
unloaded p50s of one agent on Basic with the run's link caps: on one host the capped modes'
unloaded TTFT already includes reading the hit KV through one emulated SNIC, so 4 x Oracle's
can leave them no room for queueing at all (the JSON records both latencies).

**Steady state.** A run attains the SLO when the p90 TTFT and p90 TPOT of the requests sent in
the second half of its *arrival window* (from the first agent's arrival to the last's) are
within it: by then the agents that arrived in the first half keep the cluster loaded, and
agents are still arriving, so the figures are those of the steady state, not of the ramp-up
before it nor of the drain after the last arrival (a run's last agents finish alone, with
latencies no loaded cluster would see). The window lasts at least 3 x the unloaded agent's
JCT: enough agents arrive for that at the given rate, and at least ``--min-agents`` (48), so
that the judged half rests on a few hundred requests and half a window of ramp-up precedes it.

**Capacity** (``--find-capacity``): the largest APS (agents per second) that attains the SLO,
per mode: from the starting rate, double or halve until the SLO is bracketed, then bisect
until the bracket is within 5%, at most 6 probes in all; each probe is a fresh server. A probe
still running 10 unloaded agent JCTs after its last arrival is overloaded: it is stopped there
and counts as a miss (``is_complete`` false in its JSON). A mode that attained at no probe
has ``capacity_aps`` null and ``capacity_below_aps`` (its lowest probe); where that is Basic,
``ratios`` gives ``<mode>_vs_basic_capacity_at_least``, a lower bound.
Link caps are the preset's, or calibrated as in ``bench offline`` (``paper-ratio``).

**Agents.** A synthetic preset generates as many trajectories as a probe has agents; a trace
(``agentic``, ``--trace``) gives its shaped sessions in order, cloned round robin (SPEC §7)
when a probe needs more agents than it has. Each agent sends its next turn when the previous
one ends, or, with ``--replay-gaps [SCALE]``, also no sooner than the trace's gap between the
two requests times SCALE (default 1), at most ``--max-gap-s``, after the previous one was sent
(``agents.py``: real sessions pause for hours). The unloaded agent waits them too, so the SLO's
and the run's lengths follow.

**Valid or fail.** As offline (``validity.py``): a failed request in any probe, the unloaded
runs or the calibration makes the run invalid (exit 1, ``"valid": false``, no ratios). A probe
stopped for overload is a measured miss, not a failure.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from dualpath.bench.agents import TurnRecord
from dualpath.bench.hardware import hardware_info
from dualpath.bench.harness import ModeRun, run_mode
from dualpath.bench.offline import (
    add_workload_arguments,
    calibrate,
    check_calibration_workload,
    check_engine_modes,
    check_url_flags,
    checked_preset,
    engine_report,
    engines_kv_cache_gb,
    load_workload,
    oracle_run,
    workload_report,
)
from dualpath.bench.presets import workload_shape
from dualpath.bench.report import write_outputs
from dualpath.bench.validity import invalid_message, mark_validity, mode_problems
from dualpath.flags import non_negative_float, positive_float, positive_int
from dualpath.model.identity import kv_facts
from dualpath.model.registry import read_config
from dualpath.vllm_args import engine_kind_args
from dualpath.workload import Workload, poisson_arrival_offsets_s

SLO_FACTOR = 4.0  # SPEC §7's SLO over the unloaded latencies (4 s and 50 ms on the paper's)
MIN_RUN_AGENT_JCTS = 3.0  # the arrival window lasts at least this many unloaded agent JCTs
# A probe still running this many unloaded agent JCTs after its last arrival is overloaded:
# within the SLO an agent takes at most ~4x its unloaded JCT. It is stopped and counts as a
# miss, rather than draining a queue that only grows (the slowest part of a capacity search).
OVERLOAD_AGENT_JCTS = 10.0
DEFAULT_MIN_AGENTS = 48  # and has at least this many agents
SLO_BASES = ("oracle", "basic")  # whose unloaded latencies the SLO multiplies
MAX_PROBES = 6
BRACKET_TOLERANCE = 0.05


def second_half_p90(
    records: list[TurnRecord], arrival_window_s: float
) -> tuple[float | None, float | None]:
    """p90 TTFT and p90 TPOT of the requests sent in the second half of the arrival window:
    from ``arrival_window_s / 2`` to ``arrival_window_s`` after the first request (the first
    agent arrives at offset 0; the last at ``arrival_window_s``)."""
    start_s = min(r.arrival_s for r in records)
    low_s, high_s = start_s + arrival_window_s / 2, start_s + arrival_window_s
    late = [r for r in records if low_s <= r.arrival_s <= high_s and r.error is None]
    ttfts = [r.ttft_s for r in late if r.ttft_s is not None]
    tpots = [r.tpot_s for r in late if r.tpot_s is not None]
    return (
        float(np.percentile(ttfts, 90)) if ttfts else None,
        float(np.percentile(tpots, 90)) if tpots else None,
    )


def is_attained(result: dict, slo: dict) -> bool:
    p90_ttft_s, p90_tpot_s = result["second_half_p90_ttft_s"], result["second_half_p90_tpot_s"]
    return (
        result["num_failed"] == 0
        and result.get("is_complete", True)
        and p90_ttft_s is not None
        and p90_ttft_s <= slo["ttft_s"]
        and (p90_tpot_s is None or p90_tpot_s <= slo["tpot_s"])
    )


def next_probe(probes: list[tuple[float, bool]]) -> float | None:
    """The next APS to try from ``(aps, attained)`` probes so far; None when done.

    Doubles after a pass and halves after a failure until a pass and a failure bracket the
    capacity, then bisects until the bracket is within ``BRACKET_TOLERANCE`` (relative to
    its upper end) or ``MAX_PROBES`` were made.
    """
    if not probes or len(probes) >= MAX_PROBES:
        return None
    passed = [aps for aps, ok in probes if ok]
    failed = [aps for aps, ok in probes if not ok]
    if not failed:
        return max(passed) * 2
    if not passed:
        return min(failed) / 2
    low, high = max(passed), min(f for f in failed if f > max(passed))
    if (high - low) / high <= BRACKET_TOLERANCE:
        return None
    return (low + high) / 2


def capacity_of(probes: list[tuple[float, bool]]) -> float | None:
    """The largest APS that attained the SLO below every failing one (None if none did)."""
    failed = [aps for aps, ok in probes if not ok]
    passed = [aps for aps, ok in probes if ok and (not failed or aps < min(failed))]
    return max(passed) if passed else None


def capacity_ratios(results: dict[str, dict]) -> dict[str, float]:
    """``<mode>_vs_basic_capacity`` for every mode that has a capacity when Basic has one.

    When no Basic probe attained the SLO, Basic's capacity is below its lowest probe, so a
    mode with a capacity gets ``<mode>_vs_basic_capacity_at_least`` = its capacity over that
    probe's APS: a lower bound, not a ratio. Nothing is reported where both have none.
    """
    basic = results.get("basic")
    if basic is None:
        return {}
    ratios: dict[str, float] = {}
    for mode, r in results.items():
        if mode == "basic" or not r["capacity_aps"]:
            continue
        if basic["capacity_aps"]:
            ratios[f"{mode}_vs_basic_capacity"] = r["capacity_aps"] / basic["capacity_aps"]
        elif basic.get("capacity_below_aps"):
            ratios[f"{mode}_vs_basic_capacity_at_least"] = (
                r["capacity_aps"] / basic["capacity_below_aps"]
            )
    return ratios


def arrivals(workload: Workload, aps: float, seed: int) -> Workload:
    return workload.with_arrival_offsets(
        poisson_arrival_offsets_s(workload.num_sessions, aps, seed)
    )


def run_online(
    modes: list[str],
    preset_name: str,
    *,
    model_dir: Path,
    seed: int = 0,
    aps: float | None = None,
    find_capacity: bool = False,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    work_dir: Path | None = None,
    transport: str = "nixl",
    read_path: str | None = None,
    trace: Path | None = None,
    length_scale: float | None = None,
    max_sessions: int | None = None,
    max_turns: int | None = None,
    gen_scale: float | None = None,
    max_prompt_tokens: int | None = None,
    replay_gaps: float | None = None,
    max_gap_s: float | None = None,
    min_agents: int = DEFAULT_MIN_AGENTS,
    slo_basis: str = "oracle",
    engine: str = "native",
    vllm_args: dict | None = None,
    kv_cache_gb: float | None = None,
    vllm_prefill_batching: str = "vllm",
    attention_quota_s: float | None = None,
    progress: bool = True,
) -> dict:
    """Every mode at the starting rate (or its capacity search); the report, ``valid`` or not
    (``validity.py``). ``max_sessions`` caps the agents of every run."""
    preset = checked_preset(preset_name, modes)
    check_engine_modes(engine)
    if slo_basis not in SLO_BASES:
        raise ValueError(f"--slo-basis must be one of {SLO_BASES}, got {slo_basis!r}")
    if min_agents < 1:
        raise ValueError(f"--min-agents must be >= 1, got {min_agents}")
    start_aps = preset.aps if aps is None else aps
    if start_aps <= 0:
        raise ValueError(f"--aps must be > 0, got {start_aps}")

    if replay_gaps is not None and replay_gaps < 0:
        raise ValueError(f"--replay-gaps must be >= 0, got {replay_gaps}")
    if max_gap_s is not None and (replay_gaps is None or max_gap_s < 0):
        raise ValueError(f"--max-gap-s must be >= 0 and goes with --replay-gaps, got {max_gap_s}")
    gaps = {"gap_scale": replay_gaps, "max_gap_s": max_gap_s}
    shape = workload_shape(
        preset, trace=trace, length_scale=length_scale, max_turns=max_turns, gen_scale=gen_scale
    )

    def workload_of(num_agents: int | None) -> Workload:
        return load_workload(
            shape,
            model_dir=model_dir,
            seed=seed,
            max_prompt_tokens=max_prompt_tokens,
            num_agents=num_agents,
        )

    # What offline replays (sessions and their clones): the calibration's workload, checked
    # against the model before any server starts.
    calibration_workload = workload_of(max_sessions)
    if preset.snic_bandwidth_gbps is None:
        check_calibration_workload(calibration_workload, f"--preset {preset_name}")
    # Sized on what offline replays: the agents of one probe vary with its rate.
    kv_cache_gb, kv_cache_gb_source = engines_kv_cache_gb(
        preset, calibration_workload, model_dir, engine=engine, kv_cache_gb=kv_cache_gb
    )
    base = oracle_run(
        preset,
        model_dir,
        transport=transport,
        read_path=read_path,
        max_prompt_tokens=max_prompt_tokens,
        engine=engine,
        vllm_args=vllm_args,
        kv_cache_gb=kv_cache_gb,
        vllm_prefill_batching=vllm_prefill_batching,
        attention_quota_s=attention_quota_s,
    )
    report: dict = {
        "benchmark": "online",
        "preset": preset_name,
        "preset_config": asdict(preset),
        "seed": seed,
        "model_dir": str(model_dir),
        "model": kv_facts(read_config(Path(model_dir) / "config.json")),
        **engine_report(base, kv_cache_gb_source),
        "read_path": read_path,
        **workload_report(calibration_workload, shape),
        "replay_gaps": replay_gaps,
        "max_gap_s": max_gap_s,
        "hardware": hardware_info(),
    }
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dualpath-online-") as tmp:
        root = Path(work_dir or tmp)
        # Unloaded: one agent alone on Oracle (uncapped, from memory).
        unloaded = _unloaded(base, workload_of(1), root / "unloaded", progress, gaps, problems)
        if preset.snic_bandwidth_gbps is None:
            assert preset.rho is not None, "a calibrated preset names its rho"
            oracle = run_mode(base, calibration_workload, work_dir=root / "cal")
            problems += mode_problems("calibration (oracle, uncapped)", oracle)
            if problems:  # caps from a broken run would be wrong: no probe
                report["modes"] = {}
                return mark_validity(report, problems)
            calibration = calibrate(oracle, preset.rho, model_dir, kv_cache_gb=base.kv_cache_gb)
            report.update(calibration)
            base = replace(
                base,
                snic_bandwidth_gbps=calibration["snic_caps_gbps"],
                prefill_tokens_per_s=calibration["prompt_tokens_per_busy_s"],
            )
        report["snic_caps_gbps"] = base.snic_bandwidth_gbps
        report["min_agents"] = min_agents
        # One agent alone on Basic with the run's caps: what the SLO basis "basic" uses.
        unloaded_basic = _unloaded(
            replace(base, mode="basic"),
            workload_of(1),
            root / "unloaded-basic",
            progress,
            gaps,
            problems,
        )
        basis = unloaded if slo_basis == "oracle" else unloaded_basic
        slo = {
            "ttft_s": slo_ttft_s or SLO_FACTOR * basis["ttft_s"]["p50"],
            "tpot_s": slo_tpot_s or SLO_FACTOR * (basis["tpot_s"]["p50"] or math.inf),
            "source": "given"
            if slo_ttft_s and slo_tpot_s
            else f"{SLO_FACTOR:g} x {slo_basis}'s unloaded p50",
            "basis": slo_basis,
            "unloaded": unloaded,
            "unloaded_basic": unloaded_basic,
        }
        report["slo"] = slo
        min_duration_s = MIN_RUN_AGENT_JCTS * unloaded["jct_s"]
        results = {}
        for mode in modes:
            run = replace(base, mode=mode)
            probes: list[tuple[float, bool]] = []
            probe_results = []
            rate = start_aps
            while rate is not None:
                num_agents = max(min_agents, math.ceil(rate * min_duration_s))
                if max_sessions is not None:
                    num_agents = min(num_agents, max_sessions)
                workload = arrivals(workload_of(num_agents), rate, seed)
                last_arrival_s = max(s.arrival_s for s in workload.sessions)
                result = run_mode(
                    run,
                    workload,
                    work_dir=root / f"{mode}-{len(probes)}",
                    progress=progress,
                    keep_records=True,
                    stop_after_s=last_arrival_s + OVERLOAD_AGENT_JCTS * unloaded["jct_s"],
                    **gaps,
                )
                result.pop("tokens")
                # A probe stopped for overload is a miss, not a failure: only failed requests.
                if result["num_failed"]:
                    problems += mode_problems(f"{mode} at {rate:.3g} APS", result)
                result["aps"] = rate
                result["num_agents"] = num_agents
                result["second_half_p90_ttft_s"], result["second_half_p90_tpot_s"] = (
                    second_half_p90(result.pop("_records"), last_arrival_s)
                )
                result["slo_attained"] = is_attained(result, slo)
                probes.append((rate, result["slo_attained"]))
                probe_results.append(result)
                rate = next_probe(probes) if find_capacity else None
            summary = dict(probe_results[0])  # the run at the starting rate
            summary["probes"] = [
                {k: r[k] for k in ("aps", "num_agents", "slo_attained", "jct_s", "is_complete")}
                | {
                    "p90_ttft_s": r["second_half_p90_ttft_s"],
                    "p90_tpot_s": r["second_half_p90_tpot_s"],
                    "cpu_cores": (r.get("process_cpu") or {}).get("total_cores"),
                }
                for r in probe_results
            ]
            summary["capacity_aps"] = capacity_of(probes) if find_capacity else None
            # No probe attained: the capacity is below the lowest one tried.
            summary["capacity_below_aps"] = (
                min(aps for aps, _ in probes)
                if find_capacity and summary["capacity_aps"] is None
                else None
            )
            results[mode] = summary
    report["modes"] = results
    report["ratios"] = capacity_ratios(results)
    return mark_validity(report, problems)


def _unloaded(
    run: ModeRun,
    workload: Workload,
    work_dir: Path,
    progress: bool,
    gaps: dict,
    problems: list[str],
) -> dict:
    """JCT, TTFT and TPOT of one agent alone on ``run``; what went wrong into ``problems``."""
    result = run_mode(run, workload, work_dir=work_dir, progress=progress, **gaps)
    problems += mode_problems(f"unloaded agent ({run.mode})", result)
    return {k: result[k] for k in ("jct_s", "ttft_s", "tpot_s")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument(
        "--aps",
        type=positive_float,
        default=None,
        help="agents arriving per second (default: preset's)",
    )
    parser.add_argument(
        "--find-capacity",
        action="store_true",
        help="search the largest APS that attains the SLO (bisection to 5%%, <= 6 probes)",
    )
    parser.add_argument(
        "--min-agents",
        type=positive_int,
        default=DEFAULT_MIN_AGENTS,
        help="agents per run at least (besides arriving over 3 x the unloaded agent's JCT; "
        f"default {DEFAULT_MIN_AGENTS})",
    )
    parser.add_argument(
        "--slo-basis",
        choices=SLO_BASES,
        default="oracle",
        help="whose unloaded p50 TTFT/TPOT the default SLO multiplies by 4: one agent on "
        "Oracle (uncapped), or on Basic with the run's SNIC caps (default oracle)",
    )
    parser.add_argument(
        "--replay-gaps",
        type=non_negative_float,
        nargs="?",
        const=1.0,
        default=None,
        metavar="SCALE",
        help="send each turn no sooner than the trace's gap between the two requests (times "
        "SCALE, default 1) after the previous one was sent (default: right after it ends)",
    )
    parser.add_argument(
        "--max-gap-s",
        type=non_negative_float,
        default=None,
        help="with --replay-gaps: wait at most this many seconds between two requests (real "
        "sessions pause for hours; default: no cap)",
    )
    parser.add_argument(
        "--slo-ttft-s",
        type=positive_float,
        default=None,
        help="TTFT SLO (default 4 x unloaded p50)",
    )
    parser.add_argument(
        "--slo-tpot-s",
        type=positive_float,
        default=None,
        help="TPOT SLO (default 4 x unloaded p50)",
    )


def main(args: argparse.Namespace) -> int:
    from dualpath.model.default import resolve_model_dir

    if args.url is not None:
        raise ValueError("bench online starts its own servers: --url is for bench offline")
    check_url_flags(args)
    modes = [m.strip() for m in (args.modes or "basic,dualpath").split(",") if m.strip()]
    report = run_online(
        modes,
        args.preset,
        model_dir=resolve_model_dir(args.model, tiny=True),
        seed=args.seed,
        aps=args.aps,
        find_capacity=args.find_capacity,
        slo_ttft_s=args.slo_ttft_s,
        slo_tpot_s=args.slo_tpot_s,
        transport=args.transport,
        read_path=args.read_path,
        trace=args.trace,
        length_scale=args.length_scale,
        max_sessions=args.max_sessions,
        max_turns=args.max_turns,
        gen_scale=args.gen_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        replay_gaps=args.replay_gaps,
        max_gap_s=args.max_gap_s,
        min_agents=args.min_agents,
        slo_basis=args.slo_basis,
        kv_cache_gb=args.kv_cache_gb,
        attention_quota_s=args.attention_quota_s,
        **engine_kind_args(args),
    )
    write_outputs(report, json_path=args.json, out_dir=args.out_dir, default_stem="online")
    if report["valid"]:
        return 0
    print(invalid_message(report), file=sys.stderr)
    return 1

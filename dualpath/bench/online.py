"""Online benchmark: agents arrive as a Poisson process; SLO attainment and capacity.

    dualpath bench online --preset ci --modes basic,dualpath --aps 2 --json results/online.json
    dualpath bench online --preset paper-ratio --modes basic,dualpath --find-capacity
    dualpath bench online --preset agentic --modes basic,dualpath --find-capacity

Every probe starts a fresh cluster (``harness.run_mode``): ``dualpath serve``, or with
``--vllm-servers`` DualPath inside vLLM servers, as ``bench offline`` runs them.

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
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from dualpath.bench.agents import TurnRecord
from dualpath.bench.arguments import (
    add_workload_arguments,
    calibration_settings,
    check_url_flags,
)
from dualpath.bench.calibration import (
    calibrated_run,
    calibration_source,
    check_calibration_flags,
    check_calibration_workload,
)
from dualpath.bench.hardware import hardware_info
from dualpath.bench.harness import ModeRun, run_mode
from dualpath.bench.kernel_links import links_testbed
from dualpath.bench.offline import (
    base_run,
    load_workload,
    run_header,
    run_preset,
    workload_report,
)
from dualpath.bench.presets import WorkloadShape
from dualpath.bench.report import finish
from dualpath.bench.spec import (
    DEFAULT_MIN_AGENTS,
    SLO_BASES,
    OnlineSpec,
    RunSpec,
    engine_spec,
    modes_of,
    output_spec,
    workload_spec,
)
from dualpath.bench.validity import mark_validity, mode_problems
from dualpath.flags import non_negative_float, positive_float, positive_int
from dualpath.workload import Workload, poisson_arrival_offsets_s

SLO_FACTOR = 4.0  # SPEC §7's SLO over the unloaded latencies (4 s and 50 ms on the paper's)
MIN_RUN_AGENT_JCTS = 3.0  # the arrival window lasts at least this many unloaded agent JCTs
# A probe still running this many unloaded agent JCTs after its last arrival is overloaded:
# within the SLO an agent takes at most ~4x its unloaded JCT. It is stopped and counts as a
# miss, rather than draining a queue that only grows (the slowest part of a capacity search).
OVERLOAD_AGENT_JCTS = 10.0
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


def run_online(spec: OnlineSpec) -> dict:
    """Every mode at the starting rate (or its capacity search); the report, ``valid`` or not
    (``validity.py``). ``max_sessions`` caps the agents of every run."""
    run = spec.run
    preset = run_preset(run)
    start_aps = preset.aps if spec.aps is None else spec.aps
    # The preset's sessions, every probe taking as many agents as it needs (max_sessions
    # caps them: ``_search_mode``).
    shape = replace(run.workload, max_sessions=None).shape(preset)
    workload_of = _workloads(run, shape)
    # What offline replays (sessions and their clones): the calibration's workload, checked
    # against the model before any server starts; the engines' KV memory is sized on it too
    # (the agents of one probe vary with its rate).
    calibration_workload = workload_of(run.workload.max_sessions)
    check_calibration_flags(run, preset)
    if preset.snic_bandwidth_gbps is None:
        check_calibration_workload(calibration_workload, f"--preset {run.workload.preset}")
    base, kv_cache_gb_source = base_run(run, preset, calibration_workload)
    report: dict = {
        **run_header("online", run, preset, base, kv_cache_gb_source),
        "read_path": run.engine.read_path,
        "links": run.engine.links,
        **workload_report(calibration_workload, shape),
        "replay_gaps": spec.replay_gaps,
        "max_gap_s": spec.max_gap_s,
        "hardware": hardware_info(),
    }
    problems: list[str] = []
    progress = run.output.progress
    with (
        tempfile.TemporaryDirectory(prefix="dualpath-online-") as tmp,
        links_testbed(run.engine.links, base.nodes) as testbed,
    ):
        root = Path(run.output.work_dir or tmp)
        base = replace(base, testbed=testbed)
        # Unloaded: one agent alone on Oracle (uncapped, from memory).
        unloaded = _unloaded(base, workload_of(1), root / "unloaded", spec, problems)
        if preset.snic_bandwidth_gbps is None:
            assert preset.rho is not None, "a calibrated preset names its rho"
            base, calibration, calibration_problems = calibrated_run(
                base,
                preset.rho,
                calibration_workload,
                root / "cal",
                progress=progress,
                **calibration_source(run),
            )
            problems += calibration_problems
            if problems:  # caps from a broken run would be wrong: no probe
                report["modes"] = {}
                return mark_validity(report, problems)
            report.update(calibration)
        report["snic_caps_gbps"] = base.snic_bandwidth_gbps
        report["min_agents"] = spec.min_agents
        # One agent alone on Basic with the run's caps: what the SLO basis "basic" uses.
        unloaded_basic = _unloaded(
            replace(base, mode="basic"), workload_of(1), root / "unloaded-basic", spec, problems
        )
        slo = slo_of(spec, unloaded, unloaded_basic)
        report["slo"] = slo
        results = {
            mode: _search_mode(
                replace(base, mode=mode), spec, start_aps, workload_of, slo, root, problems
            )
            for mode in run.modes
        }
    report["modes"] = results
    report["ratios"] = capacity_ratios(results)
    return mark_validity(report, problems)


def _workloads(run: RunSpec, shape: WorkloadShape) -> Callable[[int | None], Workload]:
    """The shaped workload with a given number of agents (None: as offline replays it)."""

    def workload_of(num_agents: int | None) -> Workload:
        return load_workload(
            shape,
            model_dir=run.model_dir,
            seed=run.workload.seed,
            max_prompt_tokens=run.engine.max_prompt_tokens,
            num_agents=num_agents,
        )

    return workload_of


def slo_of(spec: OnlineSpec, unloaded: dict, unloaded_basic: dict) -> dict:
    """The SLO (the JSON's ``slo``): the given TTFT and TPOT, or ``SLO_FACTOR`` x the basis's
    unloaded p50s, with both unloaded runs' figures."""
    basis = unloaded if spec.slo_basis == "oracle" else unloaded_basic
    return {
        "ttft_s": spec.slo_ttft_s or SLO_FACTOR * basis["ttft_s"]["p50"],
        "tpot_s": spec.slo_tpot_s or SLO_FACTOR * (basis["tpot_s"]["p50"] or math.inf),
        "source": "given"
        if spec.slo_ttft_s and spec.slo_tpot_s
        else f"{SLO_FACTOR:g} x {spec.slo_basis}'s unloaded p50",
        "basis": spec.slo_basis,
        "unloaded": unloaded,
        "unloaded_basic": unloaded_basic,
    }


def _search_mode(
    run: ModeRun,
    spec: OnlineSpec,
    start_aps: float,
    workload_of: Callable[[int | None], Workload],
    slo: dict,
    root: Path,
    problems: list[str],
) -> dict:
    """One mode at the starting rate, then (``find_capacity``) at each rate ``next_probe``
    picks; its summary (the run at the starting rate, its probes, its capacity). What went
    wrong goes into ``problems``."""
    unloaded_jct_s = slo["unloaded"]["jct_s"]
    min_duration_s = MIN_RUN_AGENT_JCTS * unloaded_jct_s
    probes: list[tuple[float, bool]] = []
    probe_results = []
    rate: float | None = start_aps
    while rate is not None:
        num_agents = max(spec.min_agents, math.ceil(rate * min_duration_s))
        if spec.run.workload.max_sessions is not None:
            num_agents = min(num_agents, spec.run.workload.max_sessions)
        workload = arrivals(workload_of(num_agents), rate, spec.run.workload.seed)
        result = _probe(run, workload, spec, slo, root / f"{run.mode}-{len(probes)}", rate)
        # A probe stopped for overload is a miss, not a failure: only failed requests.
        if result["num_failed"]:
            problems += mode_problems(f"{run.mode} at {rate:.3g} APS", result)
        probes.append((rate, result["slo_attained"]))
        probe_results.append(result)
        rate = next_probe(probes) if spec.find_capacity else None
    return _mode_summary(probes, probe_results, spec.find_capacity)


def _probe(
    run: ModeRun, workload: Workload, spec: OnlineSpec, slo: dict, work_dir: Path, rate: float
) -> dict:
    """``run`` on ``workload`` (its agents arriving at ``rate``), stopped for overload
    ``OVERLOAD_AGENT_JCTS`` unloaded agent JCTs after the last arrival (a miss, not a
    failure); its figures, the second half's p90s and whether it attained ``slo``."""
    last_arrival_s = max(s.arrival_s for s in workload.sessions)
    result = run_mode(
        run,
        workload,
        work_dir=work_dir,
        progress=spec.run.output.progress,
        keep_records=True,
        stop_after_s=last_arrival_s + OVERLOAD_AGENT_JCTS * slo["unloaded"]["jct_s"],
        **spec.gaps,
    )
    result.pop("tokens")
    result["aps"] = rate
    result["num_agents"] = workload.num_sessions
    result["second_half_p90_ttft_s"], result["second_half_p90_tpot_s"] = second_half_p90(
        result.pop("_records"), last_arrival_s
    )
    result["slo_attained"] = is_attained(result, slo)
    return result


def _mode_summary(
    probes: list[tuple[float, bool]], probe_results: list[dict], find_capacity: bool
) -> dict:
    """The JSON's ``modes.<mode>``: the run at the starting rate, every probe in brief, and
    the capacity (or, where no probe attained, the rate it is below)."""
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
        min(aps for aps, _ in probes) if find_capacity and summary["capacity_aps"] is None else None
    )
    return summary


def _unloaded(
    run: ModeRun, workload: Workload, work_dir: Path, spec: OnlineSpec, problems: list[str]
) -> dict:
    """JCT, TTFT and TPOT of one agent alone on ``run``; what went wrong into ``problems``."""
    result = run_mode(
        run, workload, work_dir=work_dir, progress=spec.run.output.progress, **spec.gaps
    )
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
    report = run_online(online_spec(args, resolve_model_dir(args.model, tiny=True)))
    return finish(report, args, "online")


def online_spec(args: argparse.Namespace, model_dir: Path) -> OnlineSpec:
    """``bench online``'s command line as one run."""
    return OnlineSpec(
        run=RunSpec(
            model_dir=model_dir,
            workload=workload_spec(args),
            modes=modes_of(args.modes, "basic,dualpath"),
            engine=engine_spec(args),
            output=output_spec(args),
            **calibration_settings(args),
        ),
        aps=args.aps,
        find_capacity=args.find_capacity,
        slo_ttft_s=args.slo_ttft_s,
        slo_tpot_s=args.slo_tpot_s,
        slo_basis=args.slo_basis,
        min_agents=args.min_agents,
        replay_gaps=args.replay_gaps,
        max_gap_s=args.max_gap_s,
    )

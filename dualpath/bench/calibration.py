"""SNIC caps calibrated to a rho (``bench offline``/``online`` with ``paper-ratio`` or ``--rho``).

    base, calibration, problems = calibrated_run(base, 2.0, workload, work_dir, progress=True)

A calibration may be recorded once per machine kind and used by later runs, so that their
ratios are measured under the same caps (``calibration_records.py``).

The paper's regime is a PE whose storage reads, not its compute, limit Basic. Before the timed
runs, a calibration run of ``oracle`` (uncapped) measures the PE: the hit-KV bytes it read over
the PE's busy time give the rate a PE consumes hit KV at its prefill speed, and each node's SNIC
cap is set to that rate / rho; the prompt tokens it got through per busy second set the
scheduler's beta (5 s of work a PE may hold, ``--prefill-tokens-per-s``; the server's fixed
default would let a PE hold a fraction of a second of this workload and idle while reads are in
flight). Every mode, ``oracle`` included, then runs with both.
With 1P2D, Basic puts the whole demand on one SNIC (rho = 2: about 2x slower than Oracle) while
DualPath spreads it over three (rho / 3 < 1: about Oracle's speed); the ideal speedup is
max(1, rho) / max(1, rho / 3).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import replace
from pathlib import Path

from dualpath.bench.calibration_records import (
    calibration_key,
    find_record,
    key_id,
    median_calibration,
    write_record,
)
from dualpath.bench.harness import ModeRun, run_mode
from dualpath.bench.presets import PRESETS, BenchPreset
from dualpath.bench.spec import BLOCK_SIZE_TOKENS, DEFAULT_CALIBRATION_RUNS, KV_DTYPE, RunSpec
from dualpath.bench.stats import ideal_speedup
from dualpath.bench.validity import mode_problems, store_hit_tokens
from dualpath.errors import CalibrationError
from dualpath.model.identity import kv_layout
from dualpath.model.registry import read_config
from dualpath.units import GB, bytes_per_s_to_gbps
from dualpath.workload import Workload, ideal_hit_ratio


def calibrated_run(
    base: ModeRun,
    rho: float,
    workload: Workload,
    work_dir: Path,
    *,
    progress: bool,
    source: str = "recorded",
    num_runs: int = DEFAULT_CALIBRATION_RUNS,
    command: str = "",
) -> tuple[ModeRun, dict, list[str]]:
    """``base`` with the SNIC caps and beta calibrated for ``workload`` (``calibrate``): the run
    with them, the report's calibration keys, and [] for problems; or ``base`` unchanged, {}
    and why a calibration run is not a result.

    ``source`` (``calibration_records``): "recorded" takes a recorded calibration of this
    machine kind, engines and workload if there is one, else runs one; "run" runs one;
    "record" runs ``num_runs``, records the median one (``command`` beside it) and uses it."""
    key = None if source == "run" else calibration_key(base, rho, workload)
    found = find_record(key) if source == "recorded" else None
    if found is not None:
        record, path = found
        calibration = {
            **record["calibration"],
            "calibration_source": "recorded",
            "calibration_record": {
                "path": str(path),
                "key_id": key_id(key),
                "recorded_at": record["recorded_at"],
                "command": record["command"],
            },
        }
    else:
        calibrations = []
        for index in range(num_runs if source == "record" else 1):
            oracle = run_mode(base, workload, work_dir=work_dir / str(index), progress=progress)
            problems = mode_problems("calibration (oracle, uncapped)", oracle)
            if problems:
                return base, {}, problems
            calibrations.append(
                calibrate(oracle, rho, base.model_dir, kv_cache_gb=base.kv_cache_gb)
            )
        if source == "record":
            calibration = median_calibration(calibrations)
            path = write_record(key, calibration, command)
            calibration["calibration_source"] = "recorded by this run"
            calibration["calibration_record"] = {"path": str(path), "key_id": key_id(key)}
        else:
            (calibration,) = calibrations
            calibration["calibration_source"] = "this run"
    calibrated = replace(
        base,
        snic_bandwidth_gbps=calibration["snic_caps_gbps"],
        prefill_tokens_per_s=calibration["prompt_tokens_per_busy_s"],
    )
    return calibrated, calibration, []


def check_calibration_flags(spec: RunSpec, preset: BenchPreset) -> None:
    """``ValueError`` for --calibration with a preset whose caps are fixed."""
    if spec.calibration is not None and preset.snic_bandwidth_gbps is not None:
        raise ValueError(
            f"--calibration {spec.calibration}: preset {spec.workload.preset} has fixed SNIC "
            "caps, nothing is calibrated (give --rho, or a calibrated preset: "
            + ", ".join(n for n, p in PRESETS.items() if p.snic_bandwidth_gbps is None)
            + ")"
        )


def calibration_source(spec: RunSpec) -> dict:
    """``calibrated_run``'s keyword arguments for ``spec``'s calibration flags."""
    return {
        "source": spec.calibration or "recorded",
        "num_runs": spec.calibration_runs,
        "command": shlex.join(["dualpath", *sys.argv[1:]]),
    }


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
        "prefill_tokens_per_s": (oracle["prompt_tokens"] - store_hit_tokens(oracle)) / busy_s,
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

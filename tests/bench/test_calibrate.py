"""SNIC caps from an uncapped calibration run (``calibration.calibrate``): the rho formula, the run
it came from recorded, and a refusal when the prefill engine's own prefix cache (vLLM's) held
the hits, so that no cap could make storage reads the bottleneck."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.bench.calibration import calibrate
from dualpath.errors import CalibrationError


def _oracle(read_bytes: int, held_bytes: int) -> dict:
    return {
        "jct_s": 10.0,
        "pe_busy_fraction": 0.5,
        "prompt_tokens": 10_000,
        "cached_tokens": 8_000,
        "path_bytes": {"pe": read_bytes // 2, "de": read_bytes - read_bytes // 2},
        "engine_cached_bytes": held_bytes,
    }


def test_caps_are_the_read_demand_over_rho_and_say_where_they_came_from(
    tiny_model_dir: Path,
) -> None:
    oracle = _oracle(read_bytes=500_000_000, held_bytes=1_000)
    calibration = calibrate(oracle, 2.0, tiny_model_dir)
    assert calibration["pe_hit_kv_demand_gbps"] == pytest.approx(500_000_000 * 8 / 5 / 1e9)
    assert calibration["snic_caps_gbps"] == pytest.approx(calibration["pe_hit_kv_demand_gbps"] / 2)
    assert calibration["prompt_tokens_per_busy_s"] == pytest.approx(2_000)
    assert calibration["calibration_run"]["engine_cached_bytes"] == 1_000
    assert calibration["calibration_run"]["path_bytes"] == oracle["path_bytes"]


def test_hits_the_prefill_engine_held_cannot_be_calibrated_on(tiny_model_dir: Path) -> None:
    oracle = _oracle(read_bytes=100_000_000, held_bytes=400_000_000)
    with pytest.raises(
        CalibrationError,
        match=r"prefix cache held 80% of the hit KV \(0\.400 GB; 0\.100 GB came from the "
        r"store\).*less KV memory than their 0\.5 GB \(--kv-cache-gb\)",
    ):
        calibrate(oracle, 2.0, tiny_model_dir, kv_cache_gb=0.5)


def test_a_run_that_read_no_hit_kv_cannot_be_calibrated_on(tiny_model_dir: Path) -> None:
    with pytest.raises(CalibrationError, match=r"read 0 bytes of hit KV from the store"):
        calibrate(_oracle(read_bytes=0, held_bytes=0), 2.0, tiny_model_dir)

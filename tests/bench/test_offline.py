"""`dualpath bench offline` on the ci preset: every mode runs a real one-host cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.bench.offline import run_offline

pytest.importorskip("nixl_cu12")


def test_basic_reads_only_on_the_prefill_side_and_dualpath_uses_both(tiny_model_dir: Path) -> None:
    report = run_offline(["basic", "dualpath"], "ci", model_dir=tiny_model_dir, seed=1)
    basic, dualpath = report["modes"]["basic"], report["modes"]["dualpath"]
    for result in (basic, dualpath):
        assert result["num_requests"] == 16
        assert result["jct_s"] > 0 and result["tokens_per_s"] > 0
        assert 0.5 < result["hit_ratio"] < 1.0
        assert result["ttft_s"]["p50"] <= result["ttft_s"]["p99"]
    # Same workload, same hits: the same hit-KV bytes, on different sides.
    assert basic["path_bytes"]["de"] == 0 and basic["path_bytes"]["pe"] > 0
    assert sum(dualpath["path_bytes"].values()) == basic["path_bytes"]["pe"]
    assert dualpath["path_bytes"]["de"] > 0
    assert "dualpath_vs_basic_jct" in report["ratios"]
    assert report["link_caps_emulated"] is True

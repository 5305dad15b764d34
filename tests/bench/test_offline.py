"""`dualpath bench offline` on the ci preset: each mode is a real `dualpath serve` process
(scheduler, 1 PE and 2 DE engine processes) driven over HTTP by the benchmark's agents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.bench.offline import run_offline
from dualpath.bench.spec import OutputSpec, RunSpec, WorkloadSpec
from dualpath.cli import main

pytest.importorskip("nixl_cu12")


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path) -> dict:
    return run_offline(
        RunSpec(
            model_dir=tiny_model_dir,
            workload=WorkloadSpec(preset="ci", seed=1),
            modes=("basic", "dualpath", "oracle"),
            output=OutputSpec(progress=False),
        )
    )


def test_every_mode_replays_the_workload_with_the_same_tokens(report: dict) -> None:
    num_turns = round(report["workload"]["turns"] * report["workload"]["num_sessions"])
    for result in report["modes"].values():
        assert result["num_requests"] == num_turns and result["num_failed"] == 0
        assert result["jct_s"] > 0 and result["tokens_per_s"] > 0
        assert 0.5 < result["hit_ratio"] < 1.0
        for name in ("ttft_s", "ttst_s", "tpot_s"):
            assert result[name]["p50"] <= result[name]["p90"] <= result[name]["p99"]
        assert result["token_mismatches"] == 0
        assert 0 < result["pe_busy_fraction"] < 1
        assert result["snic_load_balance"] >= 1.0
        assert result["snic_read_load_balance"] is None or result["snic_read_load_balance"] >= 1
        assert result["server_exit_code"] == 0
        # The scheduler's stages of each first token lie within the server's TTFT of it.
        stages = dict(result["first_token_stages_s"])
        server_s = stages.pop("server")
        assert set(stages) == {"placement", "decode_ready", "prefill"}
        assert all(s >= 0 for s in stages.values()) and stages["prefill"] > 0
        assert sum(stages.values()) <= server_s + 1e-3  # means rounded to 0.1 ms
    assert set(report["ratios"]) >= {"dualpath_vs_basic_jct", "dualpath_vs_oracle_jct"}
    assert report["link_caps_emulated"] is True


def test_basic_reads_only_on_the_prefill_side_and_dualpath_uses_both(report: dict) -> None:
    basic, dualpath = report["modes"]["basic"], report["modes"]["dualpath"]
    assert basic["path_bytes"]["de"] == 0 and basic["path_bytes"]["pe"] > 0
    assert dualpath["path_bytes"]["de"] > 0
    # The PE never writes (the DEs persist): its node's SNIC carried exactly its reads.
    assert basic["snic_bytes"]["node0.snic"] == basic["path_bytes"]["pe"]
    # Every byte a side read went through that side's nodes' SNICs.
    assert dualpath["snic_bytes"]["node0.snic"] == dualpath["path_bytes"]["pe"]
    de_snics = dualpath["snic_bytes"]["node1.snic"] + dualpath["snic_bytes"]["node2.snic"]
    assert de_snics >= dualpath["path_bytes"]["de"]


def test_oracle_serves_hits_from_memory(report: dict) -> None:
    assert report["modes"]["oracle"]["store_in_memory"] is True
    assert report["modes"]["basic"]["store_in_memory"] is False


def test_forcing_the_de_path_puts_every_hit_read_on_decode_nodes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "forced.json"
    assert (
        main(
            ["bench", "offline", "--preset", "ci", "--modes", "dualpath", "--read-path", "de"]
            + ["--seed", "1", "--model", str(tiny_model_dir), "--json", str(out)]
        )
        == 0
    )
    forced = json.loads(out.read_text())
    result = forced["modes"]["dualpath"]
    assert forced["read_path"] == "de"
    assert result["path_bytes"]["pe"] == 0 and result["path_bytes"]["de"] > 0
    assert result["snic_bytes"].get("node0.snic", 0) == 0
    assert (out.parent / "forced.md").read_text().count("| dualpath |") == 1
    assert (out.parent / "forced_jct.png").stat().st_size > 0
    assert (out.parent / "forced_snic.png").stat().st_size > 0
    assert result["snic_timeline"]["time_s"]

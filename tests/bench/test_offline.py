"""`dualpath bench offline` on the ci preset: every mode runs a real one-host cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.bench.offline import run_offline

pytest.importorskip("nixl_cu12")


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path) -> dict:
    return run_offline(["basic", "dualpath", "oracle"], "ci", model_dir=tiny_model_dir, seed=1)


def test_every_mode_replays_the_workload_with_the_same_tokens(report: dict) -> None:
    for result in report["modes"].values():
        assert result["num_requests"] == 16
        assert result["jct_s"] > 0 and result["tokens_per_s"] > 0
        assert 0.5 < result["hit_ratio"] < 1.0
        assert result["ttft_s"]["p50"] <= result["ttft_s"]["p99"]
        assert result["token_mismatches"] == 0
    assert "dualpath_vs_basic_jct" in report["ratios"]
    assert report["link_caps_emulated"] is True


def test_basic_reads_only_on_the_prefill_side_and_dualpath_uses_both(report: dict) -> None:
    basic, dualpath = report["modes"]["basic"], report["modes"]["dualpath"]
    # Same workload, same tokens, same hits: the same hit-KV bytes, on different sides.
    assert basic["path_bytes"]["de"] == 0 and basic["path_bytes"]["pe"] > 0
    assert sum(dualpath["path_bytes"].values()) == basic["path_bytes"]["pe"]
    assert dualpath["path_bytes"]["de"] > 0
    # The PE node's SNIC carried exactly the PE's reads (the DEs persist; the PE never writes).
    assert basic["link_bytes"]["0"]["node0.snic.kv"] == basic["path_bytes"]["pe"]


def test_oracle_serves_hits_from_memory(report: dict) -> None:
    oracle, basic = report["modes"]["oracle"], report["modes"]["basic"]
    assert oracle["store_in_memory"] is True and basic["store_in_memory"] is False
    assert sum(oracle["path_bytes"].values()) == basic["path_bytes"]["pe"]


def test_forcing_the_de_path_puts_every_hit_read_on_decode_nodes(
    report: dict, tiny_model_dir: Path
) -> None:
    forced = run_offline(["dualpath"], "ci", model_dir=tiny_model_dir, seed=1, read_path="de")
    result = forced["modes"]["dualpath"]
    assert forced["read_path"] == "de"
    assert result["path_bytes"] == {"pe": 0, "de": report["modes"]["basic"]["path_bytes"]["pe"]}
    # Per link: the prefill node's SNIC read nothing; the decode nodes' SNICs read it all.
    link_bytes = result["link_bytes"]
    assert link_bytes["0"]["store_read_bytes"] == link_bytes["0"]["node0.snic.kv"] == 0
    assert (
        link_bytes["1"]["store_read_bytes"] + link_bytes["2"]["store_read_bytes"]
        == (result["path_bytes"]["de"])
    )

"""The ``local`` profile (measured costs) and the fidelity comparison, without the benchmark."""

from __future__ import annotations

import json

import pytest

from dualpath.sim import fidelity
from dualpath.sim.agents import AgentTrace
from dualpath.sim.local import ProfiledCostModel, load_local_profile
from dualpath.sim.runner import RunSpec, run_simulation

PROFILE = {
    "num_layers": 4,
    "kv_bytes_per_token": 2048,
    "prefill": {"fixed_s": 0.01, "per_new_token_s": 1e-4, "per_pair_s": 1e-7},
    "decode": {"fixed_s": 0.004, "per_seq_s": 5e-4, "per_context_token_s": 1e-6},
    "copy_bytes_per_s": 4e9,
}


def _write_profile(tmp_path):
    path = tmp_path / "local.json"
    path.write_text(json.dumps(PROFILE))
    return path


def test_profiled_costs_follow_the_fitted_formulas_and_the_core_sharing():
    cost = ProfiledCostModel(4, 0.01, 1e-4, 1e-7, 0.004, 5e-4, 1e-6, slowdown=1.5)
    # 0.01 + 100 * 1e-4 + 1e-7 * 100 * (1000 + 50) = 0.0305, times 1.5
    assert cost.prefill_s([(1000, 100)]) == pytest.approx(1.5 * 0.0305)
    assert cost.attention_layer_s([(1000, 100)]) == pytest.approx(1.5 * 0.0205 / 4)
    assert cost.decode_step_s(2, 3000) == pytest.approx(1.5 * (0.004 + 0.001 + 0.003))
    assert cost.decode_step_s(0, 0) == 0.0 and cost.prefill_s([]) == 0.0


def test_loading_a_profile_shares_the_cores_and_rejects_a_foreign_file(tmp_path):
    path = _write_profile(tmp_path)
    local = load_local_profile(
        path, snic_bytes_per_s=25e6, kv_cache_bytes=1e9, num_engines=3, num_cores=2
    )
    assert local.cost.slowdown == 1.5
    assert local.cnic_bytes_per_s == 4e9 and local.kv_bytes_per_token == 2048
    alone = load_local_profile(
        path, snic_bytes_per_s=25e6, kv_cache_bytes=1e9, num_engines=3, num_cores=8
    )
    assert alone.cost.slowdown == 1.0
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a local profile"):
        load_local_profile(
            bad, snic_bytes_per_s=1.0, kv_cache_bytes=1.0, num_engines=1, num_cores=1
        )


def test_one_oracle_turn_on_the_local_profile_is_hand_computable(tmp_path):
    local = load_local_profile(
        _write_profile(tmp_path), snic_bytes_per_s=25e6, kv_cache_bytes=1e9, num_engines=1,
        num_cores=1,
    )  # fmt: skip
    agent = AgentTrace(0, 0.0, (640,), (0,), (11,))
    spec = RunSpec(model="tiny", hardware="local", nodes="1P2D", num_agents=1, mode="oracle",
                   agents=(agent,), local=local)  # fmt: skip
    record = run_simulation(spec).records[0]
    prefill_s = 0.01 + 640 * 1e-4 + 1e-7 * 640 * 320
    # Two fetches on the 10 ms grid (PE, then DE) before the prefill starts.
    assert record.first_token_s == pytest.approx(0.02 + prefill_s, abs=1e-9)
    step_s = 0.004 + 5e-4 + 1e-6 * (640 + 11 // 2)
    assert record.finish_s - record.decode_start_s == pytest.approx(10 * step_s)


def test_the_fidelity_comparison_simulates_the_benchmarks_workload(tmp_path):
    bench = {
        "preset": "ci",
        "seed": 1,
        "snic_caps_gbps": 0.2,
        "modes": {"basic": {"jct_s": 10.0}, "dualpath": {"jct_s": 8.0}},
    }
    bench_path = tmp_path / "bench.json"
    bench_path.write_text(json.dumps(bench))
    rows = fidelity.run_fidelity(
        work_dir=tmp_path, bench_json=bench_path, profile_path=_write_profile(tmp_path)
    )
    assert [row["mode"] for row in rows] == ["basic", "dualpath"]
    for row in rows:
        assert row["simulated_s"] > 0
        assert row["error"] == pytest.approx(row["simulated_s"] / row["measured_s"] - 1)

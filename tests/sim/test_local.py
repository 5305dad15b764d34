"""The ``local`` profile (measured costs) and the fidelity comparison, without the benchmark."""

from __future__ import annotations

import json

import pytest

from dualpath.sim import fidelity
from dualpath.sim.agents import AgentTrace
from dualpath.sim.local import ProfiledCostModel, load_local_profile, local_profile_from_dict
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
    # On an idle cluster both fetches (PE, then DE) happen at once, as our coordinator's
    # do; the 10 ms grid is for groups that hold work.
    assert record.first_token_s == pytest.approx(prefill_s, abs=1e-9)
    step_s = 0.004 + 5e-4 + 1e-6 * (640 + 11 // 2)
    assert record.finish_s - record.decode_start_s == pytest.approx(10 * step_s)


def test_only_idle_groups_fetch_at_once_on_the_local_profile(tmp_path):
    local = load_local_profile(
        _write_profile(tmp_path), snic_bytes_per_s=25e6, kv_cache_bytes=1e9, num_engines=1,
        num_cores=1,
    )  # fmt: skip
    # The first turn reads 576 hit tokens (~47 ms at the cap): meanwhile its PE holds it.
    agents = (
        AgentTrace(0, 0.0, (640,), (576,), (11,)),
        AgentTrace(1, 0.001, (64,), (0,), (2,)),
    )
    spec = RunSpec(model="tiny", hardware="local", nodes="1P2D", num_agents=2, mode="dualpath",
                   agents=agents, local=local)  # fmt: skip
    second = next(r for r in run_simulation(spec).records if r.agent_index == 1)
    # The PE is not idle when the second arrives: its fetch waits for the 10 ms tick (the
    # other DE group is idle and fetches at once), and the PE steps as soon as it is ready.
    prefill_s = 0.01 + 64 * 1e-4 + 1e-7 * 64 * 32
    assert second.first_token_s == pytest.approx(0.01 + prefill_s, abs=1e-9)


def test_the_serving_path_delays_the_turn_the_hand_off_and_every_decode_step(tmp_path):
    profile = {
        **PROFILE,
        "serving": {"turn_latency_s": 0.013, "handoff_s": 0.007, "decode_loop_s": 0.002},
    }
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(profile))
    local = load_local_profile(
        path, snic_bytes_per_s=25e6, kv_cache_bytes=1e9, num_engines=1, num_cores=1
    )
    assert (local.turn_latency_s, local.handoff_s, local.cost.decode_loop_s) == (
        0.013,
        0.007,
        0.002,
    )
    agent = AgentTrace(0, 0.0, (640,), (0,), (11,))
    spec = RunSpec(model="tiny", hardware="local", nodes="1P2D", num_agents=1, mode="oracle",
                   agents=(agent,), local=local)  # fmt: skip
    record = run_simulation(spec).records[0]
    assert record.submit_s == 0.0  # the agent's send, not the scheduler's arrival
    prefill_s = 0.01 + 640 * 1e-4 + 1e-7 * 640 * 320
    # The scheduler sees it 13 ms after the agent sent it; the idle groups fetch at once.
    assert record.first_token_s == pytest.approx(0.013 + prefill_s, abs=1e-9)
    assert record.decode_start_s == pytest.approx(record.first_token_s + 0.007, abs=1e-9)
    step_s = 0.004 + 0.002 + 5e-4 + 1e-6 * (640 + 11 // 2)
    assert record.finish_s - record.decode_start_s == pytest.approx(10 * step_s)


def test_fit_serving_finds_what_the_costs_leave_out_of_the_probes():
    base = load_profile_cost(PROFILE)
    # A cluster whose PE spends 3 ms per request and 10 us per hit token around the forward,
    # and 11 ms per turn, 7 ms per hand-off and 2 ms per decode step beyond the simulator.
    truth = {"prefill_request_s": 0.003, "prefill_s_per_hit_token": 1e-5}
    shapes = ((64, 0, 1), (512, 0, 1), (64, 0, 9), (32, 512, 1), (32, 1024, 1))
    simulated = {
        shape: fidelity.simulate_alone({**PROFILE, "serving": truth}, *shape) for shape in shapes
    }
    samples = [
        [new, hit, out, ttft + 0.011 + noise, decode + 0.007 + 0.002 * (out - 1) + noise,
         base.forward_s([(hit, new)]) + 0.003 + 1e-5 * hit + noise / 10]
        for (new, hit, out), (ttft, decode) in simulated.items()
        for noise in (-0.001, 0.0, 0.001)
    ]  # fmt: skip
    fit = fidelity.fit_serving(PROFILE, samples)
    assert fit["prefill_request_s"] == pytest.approx(0.003, abs=1e-4)
    assert fit["prefill_s_per_hit_token"] == pytest.approx(1e-5, rel=0.02)
    assert fit["turn_latency_s"] == pytest.approx(0.011, abs=2e-4)
    assert fit["handoff_s"] == pytest.approx(0.007, abs=1e-6)
    assert fit["decode_loop_s"] == pytest.approx(0.002, abs=1e-6)
    # A cluster as fast as the costs or faster leaves nothing to add.
    bare = {shape: fidelity.simulate_alone(PROFILE, *shape) for shape in shapes}
    faster = [
        [new, hit, out, ttft - 0.005, decode, base.forward_s([(hit, new)]) - 0.001]
        for (new, hit, out), (ttft, decode) in bare.items()
    ]
    fit = fidelity.fit_serving(PROFILE, faster)
    assert {k: v for k, v in fit.items() if k != "simulated"} == {
        "prefill_request_s": 0.0,
        "prefill_s_per_hit_token": 0.0,
        "turn_latency_s": 0.0,
        "handoff_s": 0.0,
        "decode_loop_s": 0.0,
    }


def test_the_engines_work_around_the_model_is_pe_time_and_outside_the_quota():
    cost = ProfiledCostModel(4, 0.01, 1e-4, 1e-7, 0.004, 5e-4, 1e-6, slowdown=1.5,
                             prefill_request_s=0.003, prefill_s_per_hit_token=1e-5)  # fmt: skip
    forward_s = 0.01 + 100 * 1e-4 + 1e-7 * 100 * (1000 + 50)
    assert cost.forward_s([(1000, 100)]) == pytest.approx(forward_s)
    assert cost.prefill_s([(1000, 100)]) == pytest.approx(1.5 * (forward_s + 0.003 + 0.01))
    # The batcher's attention quota predicts the forward's layers only.
    assert cost.attention_layer_s([(1000, 100)]) == pytest.approx(1.5 * (forward_s - 0.01) / 4)


def load_profile_cost(profile: dict) -> ProfiledCostModel:
    return local_profile_from_dict(
        profile, snic_bytes_per_s=1.0, kv_cache_bytes=1e9, num_engines=1, num_cores=1
    ).cost


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
        assert 0 < row["simulated_ttft_p50_s"] < row["simulated_s"]
        assert 0 < row["simulated_tpot_p50_s"] < row["simulated_s"]
        assert row["measured_ttft_p50_s"] is None  # this report has no percentiles

"""The experiments' run memo and records (constant cost model, tiny clusters)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from dualpath.sim import experiments, online
from dualpath.sim.agents import scaled_append_agents, synthetic_agents
from dualpath.sim.efficiency import FROZEN_FACTORS, FROZEN_FACTORS_PER_FORWARD
from dualpath.sim.experiments import ExperimentResult, _Runner
from dualpath.sim.runner import RunSpec, build_simulator
from tests.sim.test_simulator import small_spec


def test_runs_with_different_given_workloads_are_not_memoised_together():
    # RunSpec.agents is left out of the spec's equality; the memo must still tell them apart.
    result = ExperimentResult("t")
    run = _Runner(result, None)
    base = small_spec(num_agents=16 * 8, preset="32k")
    short = tuple(scaled_append_agents("32k", 16, 1, seed=0))
    long = tuple(scaled_append_agents("32k", 16, 3, seed=0))
    first = run(replace(base, agents=short), append_factor=1)
    again = run(replace(base, agents=short), append_factor=1)
    third = run(replace(base, agents=long), append_factor=3)
    assert again is first
    assert third.jct_s > first.jct_s
    assert [r["append_factor"] for r in result.runs] == [1, 3]


def test_copied_agents_repeat_the_trajectories_under_fresh_ids():
    from dualpath.sim.agents import copied_agents, synthetic_agents

    base = synthetic_agents("32k", 3, seed=0, block_size_tokens=64)
    copies = copied_agents(base, 2)
    assert [a.agent_id for a in copies] == [0, 1, 2, 3, 4, 5]
    for original, copy in zip(base + base, copies, strict=True):
        assert copy.prompt_tokens == original.prompt_tokens
        assert copy.hit_tokens == original.hit_tokens
        assert copy.output_tokens == original.output_tokens


def _recording_fake_runs(monkeypatch, seen: list[RunSpec]) -> None:
    """``run_simulation`` replaced by one tiny real run for every spec, the specs kept."""

    def fake_run(spec, **_):
        seen.append(spec)
        simulator = build_simulator(small_spec(num_agents=8, scale_down=8))
        simulator.run()
        return SimpleNamespace(
            spec=spec,
            jct_s=3000.0,
            snic_load_balance=1.0,
            attention_balance=1.0,
            num_requests=1,
            num_events=1,
            wall_s=1.0,
            events_per_s=1.0,
            records=simulator.records,
        )

    monkeypatch.setattr(experiments, "run_simulation", fake_run)


def test_the_quota_read_per_forward_reaches_every_run_of_an_experiment(monkeypatch) -> None:
    # --quota-per-forward: every spec of the experiment, the online probes' base included,
    # runs with that reading and its own fitted factors, and the JSON says so.
    seen: list[RunSpec] = []
    _recording_fake_runs(monkeypatch, seen)
    probed = []
    monkeypatch.setattr(online, "find_capacity", lambda spec, *_, **__: probed.append(spec) or [])
    ablation = experiments.run_experiment("ablation", scale_down=8, quota_per_forward=True)
    experiments.run_experiment("online-capacity", scale_down=8, quota_per_forward=True)
    assert len(seen) >= 4 and len(probed) == 4
    for spec in seen + probed:
        assert spec.quota_per_forward and spec.factors == FROZEN_FACTORS_PER_FORWARD
    assert all(run["quota_per_forward"] for run in ablation.runs)
    seen.clear()
    default = experiments.run_experiment("ablation", scale_down=8)
    assert seen and not any(spec.quota_per_forward for spec in seen)
    assert all(spec.factors == FROZEN_FACTORS for spec in seen)
    assert not any(run["quota_per_forward"] for run in default.runs)


def test_the_quota_read_per_forward_is_300_ms_over_the_layers() -> None:
    per_layer = build_simulator(small_spec()).cluster.scheduler.attention_quota_s
    per_forward = build_simulator(small_spec(quota_per_forward=True))
    assert per_forward.cluster.scheduler.attention_quota_s == per_layer / 61 == 0.3 / 61
    chosen = build_simulator(small_spec(quota_per_forward=True, attention_quota_s=0.01))
    assert chosen.cluster.scheduler.attention_quota_s == 0.01
    # A spec that names no factors gets the ones fitted under its reading.
    assert RunSpec().factors == FROZEN_FACTORS
    assert RunSpec(quota_per_forward=True).factors == FROZEN_FACTORS_PER_FORWARD


def test_an_experiment_runs_every_spec_and_workload_on_its_seed(monkeypatch) -> None:
    # dualpath simulate --experiment NAME --seed N: every run (online probes too) and the
    # workloads the experiments build themselves (scale's copies, append-scaling's) draw on N.
    seen: list[RunSpec] = []
    _recording_fake_runs(monkeypatch, seen)
    probed = []
    monkeypatch.setattr(online, "find_capacity", lambda *search, **_: probed.append(search) or [])
    results = experiments.run_experiments(["scale", "append-scaling"], scale_down=8, seed=3)
    assert {spec.seed for spec in seen} == {3} and {s[0].seed for s in probed} == {3}
    assert all(run["seed"] == 3 for result in results for run in result.runs)
    lengths = {
        spec.nodes if spec.agents[0].prompt_tokens[-1] <= 65_536 else "x3": [
            a.prompt_tokens for a in spec.agents[:256]
        ]
        for spec in seen
        if spec.agents is not None
    }
    for seed, differs in ((3, False), (0, True)):
        copied = synthetic_agents("64k", 256, seed=seed, block_size_tokens=64)
        assert (lengths["8P16D"] != [a.prompt_tokens for a in copied]) is differs
        x3 = scaled_append_agents("64k", 256, 3, seed=seed)
        assert (lengths["x3"] != [a.prompt_tokens for a in x3]) is differs

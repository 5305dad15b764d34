"""The experiments' run memo and records (constant cost model, tiny clusters)."""

from __future__ import annotations

from dataclasses import replace

from dualpath.sim.agents import scaled_append_agents
from dualpath.sim.experiments import ExperimentResult, _Runner
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

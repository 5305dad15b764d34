"""The P/D advisor (``dualpath plan``): every split of the nodes simulated, the best per GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dualpath.sim import plan
from dualpath.sim.efficiency import FROZEN_FACTORS, FROZEN_FACTORS_PER_FORWARD

# Simulated JCTs by shape: with the same requests, 2P2D finishes first per GPU.
JCT_S = {"1P3D": 400.0, "2P2D": 250.0, "3P1D": 300.0}


@pytest.fixture
def simulated(monkeypatch):
    specs = []

    def fake_run(spec, **_):
        specs.append(spec)
        return SimpleNamespace(jct_s=JCT_S[spec.nodes], num_requests=1000)

    monkeypatch.setattr(plan, "run_simulation", fake_run)
    return specs


@pytest.mark.parametrize("quota_per_forward", [False, True])
def test_the_advisor_simulates_every_split_and_recommends_the_best_per_gpu(
    simulated, quota_per_forward
) -> None:
    advice = plan.recommend_pd(
        model="27b",
        hardware="hopper-8x400",
        total_nodes=4,
        num_agents=64,
        preset="64k",
        scale_down=8,
        quota_per_forward=quota_per_forward,
    )
    assert [spec.nodes for spec in simulated] == ["1P3D", "2P2D", "3P1D"]
    assert advice.best_nodes == "2P2D"
    # 1,000 turns / 250 s over 4 one-GPU nodes (8 GPUs / 8).
    assert advice.lines[-1] == "recommended: 2P2D (1.0000 turns/s/GPU)"
    low, high = advice.pd_range
    assert 0 < low < high
    assert all(spec.quota_per_forward == quota_per_forward for spec in simulated)
    factors = FROZEN_FACTORS_PER_FORWARD if quota_per_forward else FROZEN_FACTORS
    assert all(spec.factors == factors for spec in simulated)


def test_the_advisor_needs_a_node_for_each_role(simulated) -> None:
    with pytest.raises(ValueError, match="at least 2 nodes"):
        plan.recommend_pd(
            model="27b", hardware="hopper-8x400", total_nodes=1, num_agents=8, preset="64k"
        )
    assert not simulated

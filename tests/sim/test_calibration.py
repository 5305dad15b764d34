"""The one fitted factor: its target run is the experiments' run, and only it says fitted."""

from __future__ import annotations

from dualpath.sim import experiments
from dualpath.sim.calibration import CALIBRATION_TARGET_JCT_S, FROZEN_FACTORS, calibration_spec
from dualpath.sim.runner import RunSpec


def test_the_calibration_run_is_the_offline_experiments_2048_agent_dualpath_run():
    # offline-jct and scale build this spec at scale-down 1; the fitted check compares it.
    spec = RunSpec(
        model="deepseek-v3.2-660b",
        nodes="2P4D",
        num_agents=2048,
        preset="64k",
        mode="dualpath",
        scale_down=1,
    )
    assert calibration_spec() == spec
    assert spec.factors == FROZEN_FACTORS


def test_only_the_calibration_check_is_marked_fitted():
    check = experiments._calibration_check(3200.0)
    assert check.fitted and check.paper == CALIBRATION_TARGET_JCT_S == 3167.0
    assert check.as_dict()["fitted"] is True
    prediction = experiments.Check(
        "offline_660b_2p4d_64k_2048_dualpath_over_basic", 1.87, 1.9, 0.187
    )
    assert prediction.as_dict()["fitted"] is False

"""The one fitted factor: its target run is the experiments' run, and only it says fitted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dualpath.sim import calibration, experiments
from dualpath.sim.calibration import CALIBRATION_TARGET_JCT_S, calibration_spec
from dualpath.sim.efficiency import FROZEN_FACTORS
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


@pytest.mark.parametrize("fixed_s", [0.0, 900.0])
def test_the_fit_averages_noisy_runs_instead_of_chasing_them(monkeypatch, fixed_s) -> None:
    # A JCT of fixed + K / efficiency (all prefill-bound, or not), each run +-3% off in turn
    # (the real one is not smooth in the factor): the fit lands near the efficiency that
    # meets the target; a secant would chase the noise.
    k = 1300.0 if fixed_s == 0 else 700.0
    noise = iter([1.03, 0.97] * 4)
    tried_specs = []

    def fake_run(spec, **_):
        tried_specs.append(spec)
        jct_s = fixed_s + k / spec.factors.prefill_efficiency
        return SimpleNamespace(jct_s=jct_s * next(noise))

    monkeypatch.setattr(calibration, "run_simulation", fake_run)
    answer, tried = calibration.fit_prefill_efficiency(start=0.5, runs=6)
    assert len(tried) == len(tried_specs) == 6
    assert tried[0][0] == 0.5
    assert all(spec == calibration_spec(spec.factors) for spec in tried_specs)
    assert answer == pytest.approx(k / (CALIBRATION_TARGET_JCT_S - fixed_s), rel=0.02)
    with pytest.raises(ValueError, match="runs"):
        calibration.fit_prefill_efficiency(runs=0)

"""SPEC §7 checks at reduced size (--scale-down 8: 1-GPU nodes, 256 agents), roofline model
with the frozen factors (``calibration.py``; fitted at full size, never at this size).

The same checks run at full size through ``dualpath simulate --experiment ...``; misses are
recorded as strict xfails with the figure, not tuned away. Scale-down is not neutral: the
lockstep PE group shrinks from 16 GPUs to 2, and Basic becomes bound by the PE nodes' SNICs.
"""

from __future__ import annotations

import functools

import pytest

from dualpath.sim.runner import RunSpec, run_simulation


@functools.cache
def _jct_s(mode: str) -> float:
    spec = RunSpec(nodes="2P4D", num_agents=2048, preset="64k", mode=mode, scale_down=8)
    return run_simulation(spec).jct_s


def test_offline_dualpath_over_basic_is_within_10_percent_of_1_87():
    speedup = _jct_s("basic") / _jct_s("dualpath")
    assert abs(speedup - 1.87) <= 0.187, speedup


def test_offline_dualpath_is_within_10_percent_of_oracle():
    assert _jct_s("dualpath") / _jct_s("oracle") <= 1.10


@pytest.mark.xfail(
    strict=True,
    reason="TODO(#7): 51.0% at this size (paper 45.62 +- 5): Basic is SNIC-bound on the two "
    "PE nodes here while the 2-GPU lockstep group makes DualPath's prefill nearly ideal",
)
def test_ablation_full_dualpath_reduction_is_within_5_points_of_45_62():
    reduction = 100 * (1 - _jct_s("dualpath") / _jct_s("basic"))
    assert abs(reduction - 45.62) <= 5.0, reduction


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="TODO(#7): layer-wise alone gains ~1% here vs the paper's 17.21%: Basic and "
    "layer-wise are both bound by the PE nodes' SNICs at this size (docs/simulator.md)",
)
def test_ablation_layerwise_reduction_is_within_5_points_of_17_21():
    reduction = 100 * (1 - _jct_s("layerwise") / _jct_s("basic"))
    assert abs(reduction - 17.21) <= 5.0, reduction

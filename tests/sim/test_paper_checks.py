"""SPEC §7 checks at reduced size (--scale-down 8: 1-GPU nodes, 256 agents), roofline model
with the frozen factors (``calibration.py``; fitted at full size, never at this size).

The same checks run at full size through ``dualpath simulate --experiment ...``; misses are
recorded as strict xfails with the figure, not tuned away. Scale-down is not neutral: the
lockstep PE group shrinks from 16 GPUs to 2, and Basic becomes bound by the PE nodes' SNICs.

An offline JCT is set by the agents with the most turns: at this size the cluster is slow
enough that a few hundred turns of one agent, one after another, can outlast the others'
work (seed 3 below), and small changes of timing move such a JCT by a few percent. So each
check is the mean of its ratio over six workload seeds, not one seed's draw (DualPath /
Oracle 1.142, 1.100, 1.156, 1.097, 1.156, 1.088; DualPath / Basic 2.00, 2.02, 2.00, 1.77,
1.91, 2.01; docs/simulator.md). Three seeds were too few: V3.2's indexer key growing from
128 to 132 B (its FP8 scale) moved their DualPath / Oracle mean from 1.094 to 1.133, and
ten seeds give 1.113 and 1.109.
"""

from __future__ import annotations

import functools
import statistics

import pytest

from dualpath.sim.runner import RunSpec, run_simulation

# Minutes of simulation from the sources: run by `make test-compiled` (compiled, in CI).
pytestmark = pytest.mark.paper

SEEDS = (0, 1, 2, 3, 4, 5)


@functools.cache
def _jct_s(mode: str, seed: int) -> float:
    spec = RunSpec(nodes="2P4D", num_agents=2048, preset="64k", mode=mode, scale_down=8, seed=seed)
    return run_simulation(spec).jct_s


def _mean_ratio(numerator: str, denominator: str) -> float:
    return statistics.fmean(_jct_s(numerator, s) / _jct_s(denominator, s) for s in SEEDS)


def test_offline_dualpath_over_basic_is_within_10_percent_of_1_87():
    speedup = _mean_ratio("basic", "dualpath")
    assert abs(speedup - 1.87) <= 0.187, speedup


@pytest.mark.xfail(
    strict=True,
    reason="DualPath / Oracle is 1.123 over seeds 0-5 at this size (1.109 over seeds 0-9), "
    "just outside 1.10; at full size 1.00 (docs/simulator.md)",
)
def test_offline_dualpath_is_within_10_percent_of_oracle():
    ratio = _mean_ratio("dualpath", "oracle")
    assert ratio <= 1.10, ratio


def test_ablation_full_dualpath_reduction_is_within_5_points_of_45_62():
    reduction = 100 * (1 - _mean_ratio("dualpath", "basic"))
    assert abs(reduction - 45.62) <= 5.0, reduction


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="TODO(#7): layer-wise alone gains ~1% here vs the paper's 17.21%: Basic and "
    "layer-wise are both bound by the PE nodes' SNICs at this size (docs/simulator-analysis.md)",
)
def test_ablation_layerwise_reduction_is_within_5_points_of_17_21():
    reduction = 100 * (1 - _mean_ratio("layerwise", "basic"))
    assert abs(reduction - 17.21) <= 5.0, reduction

"""The frozen efficiency factors (``FROZEN_FACTORS``) and the one fit that produced them.

    dualpath simulate --calibrate          # re-runs the fit below and prints the factor

What was fitted to what (and nothing else was):

* ``prefill_efficiency`` is the only fitted number. Target: Table 3's 2P4D JCT, **3,167 s**
  (SPEC §7, "scale"), read as DualPath on DeepSeek-V3.2 660B, 2P4D, 2,048 agents (the
  48P96D run's 49,152 agents per 2P4D's share of nodes), max length 64K (SPEC gives none
  there; the issue's choice), seed 0. SPEC prints no absolute JCT for the issue's
  calibration point (1,024 agents, Basic and Oracle), so this is the closest printed
  absolute figure. The check that compares with it is marked ``fitted`` in every JSON.
* ``storage_efficiency`` is stated, not fitted: 3FS's published KVCache read peak of
  40 GiB/s per client node over a 400 Gbps (50 GB/s) SNIC = 0.86.
* ``decode_efficiency`` is stated, not fitted: an assumed 50% of HBM bandwidth per decode
  step (memory-bound kernels at small batch).

Every other check (ratios, the ablation, SNIC balance, P/D sweep, online capacity, scale) is
a prediction of the frozen model.

The fit's runs: 0.4650 -> 3,252.7 s, 0.4776 -> 3,103.2 s, 0.4722 -> 3,214.2 s, 0.4745 ->
3,186.8 s, 0.4761 -> 3,094.5 s. The JCT is not smooth in the factor (it is one long agent's
tail, docs/simulator.md): the frozen 0.4745 itself gives 3,131.8 s, so the fit holds to ~2%.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from dualpath.sim.cost import EfficiencyFactors

logger = logging.getLogger(__name__)

FROZEN_FACTORS = EfficiencyFactors(
    prefill_efficiency=0.4745,  # fitted: see CALIBRATION_TARGET_JCT_S, fit_prefill_efficiency
    decode_efficiency=0.5,  # assumed
    storage_efficiency=0.86,  # 3FS: 40 GiB/s per client node / 50 GB/s
)

# Table 3 (SPEC §7): 2P4D JCT, seconds. The run it is compared with: ``calibration_spec()``.
CALIBRATION_TARGET_JCT_S = 3167.0


def calibration_spec(factors: EfficiencyFactors = FROZEN_FACTORS):
    """The one configuration the fit uses (a ``RunSpec``)."""
    from dualpath.sim.runner import RunSpec

    return RunSpec(
        model="deepseek-v3.2-660b",
        nodes="2P4D",
        num_agents=2048,
        preset="64k",
        mode="dualpath",
        seed=0,
        factors=factors,
    )


def fit_prefill_efficiency(
    *, start: float = FROZEN_FACTORS.prefill_efficiency, max_runs: int = 6, tolerance: float = 0.01
) -> list[tuple[float, float]]:
    """Secant search on ``prefill_efficiency`` (others fixed) until the calibration run's JCT
    is within ``tolerance`` (relative) of the target. Returns every (efficiency, JCT s) tried;
    the last is the answer. Each run is a full-size simulation (about a minute)."""
    from dualpath.sim.runner import run_simulation

    def jct_s(efficiency: float) -> float:
        factors = replace(FROZEN_FACTORS, prefill_efficiency=efficiency)
        result = run_simulation(calibration_spec(factors))
        logger.info("prefill_efficiency %.4f -> JCT %.1f s", efficiency, result.jct_s)
        return result.jct_s

    tried = [(start, jct_s(start))]
    # JCT is roughly inversely proportional to the prefill efficiency when prefill-bound.
    guess = start * tried[0][1] / CALIBRATION_TARGET_JCT_S
    while len(tried) < max_runs:
        if abs(tried[-1][1] / CALIBRATION_TARGET_JCT_S - 1) <= tolerance:
            break
        guess = min(1.0, max(0.01, guess))
        tried.append((guess, jct_s(guess)))
        (e0, j0), (e1, j1) = tried[-2], tried[-1]
        if j1 == j0:
            break
        guess = e1 + (CALIBRATION_TARGET_JCT_S - j1) * (e1 - e0) / (j1 - j0)
    return tried

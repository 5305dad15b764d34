"""The frozen efficiency factors (``FROZEN_FACTORS``) and how they were fitted.

Placeholder values until ``dualpath simulate --calibrate`` has run; see docs/simulator.md.
"""

from __future__ import annotations

from dualpath.sim.cost import EfficiencyFactors

FROZEN_FACTORS = EfficiencyFactors(
    prefill_efficiency=0.35,
    decode_efficiency=0.5,
    storage_efficiency=0.86,
)

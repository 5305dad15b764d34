"""Session arrival offsets for online runs (SPEC §7: agents arrive as a Poisson process)."""

from __future__ import annotations

import numpy as np


def poisson_arrival_offsets_s(num_sessions: int, rate_per_s: float, seed: int) -> np.ndarray:
    """Arrival offsets (s) of a Poisson process at ``rate_per_s``, shifted so the first session
    arrives at 0 (a run does not start idle); the gaps are exponential with mean 1/rate, uncapped.
    Use with ``Workload.with_arrival_offsets``."""
    if num_sessions < 1:
        raise ValueError(f"num_sessions must be >= 1, got {num_sessions}")
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    gaps_s = np.random.default_rng(seed).exponential(1.0 / rate_per_s, num_sessions - 1)
    return np.concatenate([[0.0], np.cumsum(gaps_s)])

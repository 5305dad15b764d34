"""The benchmarks' figures from per-turn records and link-counter samples (SPEC §7).

* JCT: from the first request's arrival to the last turn's end (offline: all agents start
  together, so this is when the last agent finishes).
* TTFT, TTST (time to second token), TPOT: per request, as percentiles.
* hit ratio: cached prompt tokens / prompt tokens.
* SNIC load balance: the mean, over 1 s windows in the first 80% of the run, of the busiest
  SNIC's bytes in the window over the mean of all SNICs' bytes (1.0 is perfect). Windows in
  which no SNIC moved a byte are skipped: they have no balance to speak of.
* ideal speedup: DualPath over Basic when only SNICs limit, from rho alone (SPEC §5), the
  yardstick of a rho sweep.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dualpath.bench.agents import TurnRecord

PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """``{"p50": ..., "p90": ..., "p99": ...}``; every value None when there are none."""
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    return {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES}


def summarize_turns(records: Sequence[TurnRecord]) -> dict:
    """JCT, throughput, latency percentiles and hit ratio of one run's turns."""
    if not records:
        raise ValueError("no turns to summarize")
    ok = [r for r in records if r.error is None]
    start_s = min(r.arrival_s for r in records)
    jct_s = max(r.finish_s for r in records) - start_s
    num_prompt = sum(r.num_prompt_tokens for r in ok)
    num_cached = sum(r.num_cached_tokens for r in ok)
    num_output = sum(r.num_output_tokens for r in ok)
    session_to_span_s: dict[int, tuple[float, float]] = {}
    for r in records:
        first_s, last_s = session_to_span_s.get(r.session, (r.arrival_s, r.finish_s))
        session_to_span_s[r.session] = (min(first_s, r.arrival_s), max(last_s, r.finish_s))
    return {
        "jct_s": jct_s,
        # Each agent's own JCT (its first request to its last answer). Offline, the run's JCT
        # is the slowest agent's; the spread tells a throughput-bound run (agents end
        # together) from one whose last agents' chains of turns set the JCT.
        "agent_jct_s": percentiles([last - first for first, last in session_to_span_s.values()]),
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "prompt_tokens": num_prompt,
        "cached_tokens": num_cached,
        "output_tokens": num_output,
        # Tokens the cluster computed (prefill misses and decode steps) per second.
        "tokens_per_s": (num_prompt - num_cached + num_output) / jct_s,
        "output_tokens_per_s": num_output / jct_s,
        "hit_ratio": num_cached / num_prompt if num_prompt else 0.0,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttst_s": percentiles([r.ttst_s for r in ok if r.ttst_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
    }


@dataclass(frozen=True, slots=True)
class LinkSample:
    """Cumulative bytes per SNIC (by name) at ``time_s``: all of them, and the hit-KV reads
    among them (the part the scheduler's read-side choices place)."""

    time_s: float
    snic_bytes: Mapping[str, int]
    snic_read_bytes: Mapping[str, int] = field(default_factory=dict)


def snic_load_balance(
    samples: Sequence[LinkSample],
    *,
    window_s: float = 1.0,
    fraction_of_run: float = 0.8,
    reads_only: bool = False,
    min_mean_bytes_per_s: float = 0.0,
) -> float | None:
    """SPEC §7's SNIC load balance over the samples' span; None if no window moved bytes.

    ``reads_only`` counts only hit-KV reads (``LinkSample.snic_read_bytes``), leaving out
    store writes and the windows with no reads. ``min_mean_bytes_per_s`` keeps only the
    windows whose mean SNIC moved at least that (None if none did). Cumulative counters are
    read at each window's edges by linear interpolation between the samples around it, so the
    sampling period need not divide the window.
    """
    if len(samples) < 2:
        return None

    def counters_of(sample: LinkSample) -> Mapping[str, int]:
        return sample.snic_read_bytes if reads_only else sample.snic_bytes

    names = sorted(counters_of(samples[-1]))
    if not names:
        return None
    times_s = np.array([s.time_s for s in samples])
    counters = np.array([[counters_of(s).get(n, 0) for n in names] for s in samples], dtype=float)
    end_s = times_s[0] + fraction_of_run * (times_s[-1] - times_s[0])
    edges_s = np.arange(times_s[0], end_s + 1e-9, window_s)
    if len(edges_s) < 2:
        edges_s = np.array([times_s[0], end_s])
    at_edges = np.stack([np.interp(edges_s, times_s, counters[:, j]) for j in range(len(names))])
    per_window = np.diff(at_edges, axis=1)  # [snic, window]
    floors = min_mean_bytes_per_s * np.diff(edges_s)  # bytes per window
    ratios = [
        column.max() / column.mean()
        for column, floor in zip(per_window.T, floors, strict=True)
        if column.sum() > 0 and column.mean() >= floor
    ]
    return float(np.mean(ratios)) if ratios else None


def ideal_speedup(rho: float, num_snics: int = 3) -> float:
    """DualPath over Basic when only SNICs limit: Basic's one SNIC carries rho, DualPath's
    ``num_snics`` carry rho / num_snics each (SPEC §5; 1P2D has three)."""
    return max(1.0, rho) / max(1.0, rho / num_snics)

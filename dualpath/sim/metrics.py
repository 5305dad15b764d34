"""Run metrics of SPEC §7: SNIC and attention load balance and the online SLO figures."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from dualpath.sim.cluster import RequestRecord
from dualpath.sim.links import SimLink


def ttfts_and_tpots(records: Iterable[RequestRecord]) -> tuple[list[float], list[float]]:
    """Per finished request: TTFT (submit -> first token) and, for requests of more than one
    output token, TPOT (decode time per output token after the first), in seconds."""
    ttfts, tpots = [], []
    for record in records:
        ttfts.append(record.first_token_s - record.submit_s)
        if record.num_output_tokens > 1:
            tpots.append((record.finish_s - record.first_token_s) / (record.num_output_tokens - 1))
    return ttfts, tpots


def snic_load_balance(
    snic_links: Sequence[tuple[SimLink, SimLink]], jct_s: float, window_s: float
) -> float:
    """Mean over the 1 s windows in the first 80% of the run of (the largest SNIC's bytes) /
    (the mean over all SNICs); a node's SNIC bytes are its reads plus writes. Windows where no
    SNIC moved a byte are skipped; nan if none moved any (e.g. oracle)."""
    num_windows = int(0.8 * jct_s / window_s)
    ratios = []
    for index in range(num_windows):
        per_node = [
            (read.window_bytes[index] if index < len(read.window_bytes) else 0.0)
            + (write.window_bytes[index] if index < len(write.window_bytes) else 0.0)
            for read, write in snic_links
        ]
        mean = sum(per_node) / len(per_node)
        if mean > 0:
            ratios.append(max(per_node) / mean)
    return sum(ratios) / len(ratios) if ratios else math.nan


def attention_balance(
    step_start_s: Sequence[float],
    step_max_s: Sequence[float],
    step_mean_s: Sequence[float],
    until_s: float,
) -> float:
    """SPEC §7's attention balance across an EP group: over the lockstep PE steps that start
    before ``until_s`` (the first 5% of the run), the attention time the group spends (each
    step lasts as long as its slowest PE's attention) over the mean PE's attention work (idle
    PEs count 0); 1.0 is perfect. A step weighs by its length, so a short step does not count
    as much as a long one. nan if no step of a group of several PEs started (a one-PE group
    has no balance to measure)."""
    spent = work = 0.0
    for start_s, max_s, mean_s in zip(step_start_s, step_max_s, step_mean_s, strict=True):
        if start_s < until_s:
            spent += max_s
            work += mean_s
    return spent / work if work > 0 else math.nan


ATTENTION_BALANCE_SHARE = 0.05  # SPEC §7: "the first 5% of the task"

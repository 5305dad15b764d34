"""The benchmarks' figures: latency percentiles, JCT, hit ratio and SNIC load balance."""

from __future__ import annotations

import pytest

from dualpath.bench.agents import TurnRecord
from dualpath.bench.harness import link_figures
from dualpath.bench.stats import (
    LinkSample,
    ideal_speedup,
    percentiles,
    snic_load_balance,
    summarize_turns,
)


def _turn(session, turn, arrival, first, second, finish, prompt, cached, out, error=None):
    return TurnRecord(session, turn, arrival, first, second, finish, prompt, cached, out, error)


def test_turn_latencies_and_run_figures() -> None:
    records = [
        _turn(0, 0, 10.0, 10.5, 10.6, 11.4, 1000, 0, 10),
        _turn(0, 1, 11.5, 11.7, 11.9, 12.5, 1100, 960, 4),
        _turn(1, 0, 10.0, None, None, 10.2, 500, 0, 0, error="HTTP 503: busy"),
    ]
    first = records[0]
    assert first.ttft_s == pytest.approx(0.5)
    assert first.ttst_s == pytest.approx(0.1)
    assert first.tpot_s == pytest.approx(0.9 / 9)
    assert records[2].ttft_s is None and records[2].tpot_s is None
    summary = summarize_turns(records)
    assert summary["jct_s"] == pytest.approx(2.5)
    assert (summary["num_requests"], summary["num_failed"]) == (3, 1)
    # The failed turn counts in the JCT but not in tokens or latencies.
    assert summary["hit_ratio"] == pytest.approx(960 / 2100)
    assert summary["tokens_per_s"] == pytest.approx((2100 - 960 + 14) / 2.5)
    assert summary["ttft_s"]["p50"] == pytest.approx(0.35)
    assert summary["tpot_s"]["p50"] == pytest.approx((0.1 + 0.8 / 3) / 2)
    # Agent 0 ran 10.0 -> 12.5, agent 1 10.0 -> 10.2 (its failed turn still ends it).
    assert summary["agent_jct_s"]["p50"] == pytest.approx((2.5 + 0.2) / 2)


def test_percentiles_of_nothing_are_none() -> None:
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    assert percentiles([3.0])["p90"] == 3.0
    with pytest.raises(ValueError, match="no turns"):
        summarize_turns([])


def _samples(rates: dict[str, list[float]], period_s: float = 0.5) -> list[LinkSample]:
    """Cumulative counters sampled every ``period_s`` from per-period byte counts."""
    totals = dict.fromkeys(rates, 0)
    samples = [LinkSample(0.0, dict(totals))]
    for i in range(len(next(iter(rates.values())))):
        for name in rates:
            totals[name] += rates[name][i]
        samples.append(LinkSample((i + 1) * period_s, dict(totals)))
    return samples


def test_snic_load_balance_is_max_over_mean_per_window() -> None:
    even = _samples({"a": [100.0] * 10, "b": [100.0] * 10})
    assert snic_load_balance(even) == pytest.approx(1.0)
    # One SNIC does all the work: max / mean = 2 with two SNICs.
    lopsided = _samples({"a": [100.0] * 10, "b": [0.0] * 10})
    assert snic_load_balance(lopsided) == pytest.approx(2.0)
    # Idle windows are skipped; only the first 80% of the run counts (here 4 s of 5 s: the
    # lopsided last second is left out).
    mixed = _samples({"a": [0, 0, 50, 50, 50, 50, 50, 50, 90, 90], "b": [0, 0] + [50] * 6 + [0, 0]})
    assert snic_load_balance(mixed, window_s=1.0) == pytest.approx(1.0)
    assert snic_load_balance(mixed, window_s=1.0, fraction_of_run=1.0) == pytest.approx(
        (1.0 + 1.0 + 1.0 + 2.0) / 4
    )
    assert snic_load_balance(even[:1]) is None
    assert snic_load_balance(_samples({"a": [0.0] * 4})) is None


def test_the_read_only_balance_leaves_out_writes_and_read_free_windows() -> None:
    # Two SNICs: a write-only warm-up on "b" (no reads anywhere), then even reads.
    all_bytes = {"a": [0, 0, 50, 50, 50, 50], "b": [80, 80, 60, 60, 60, 60]}
    reads = {"a": [0, 0, 50, 50, 50, 50], "b": [0, 0, 50, 50, 50, 50]}
    samples = [
        LinkSample(t.time_s, t.snic_bytes, r.snic_bytes)
        for t, r in zip(_samples(all_bytes), _samples(reads), strict=True)
    ]
    assert snic_load_balance(samples, fraction_of_run=1.0) == pytest.approx(
        (2.0 + 120 / 110 + 120 / 110) / 3
    )
    assert snic_load_balance(samples, fraction_of_run=1.0, reads_only=True) == pytest.approx(1.0)
    assert snic_load_balance(_samples(all_bytes), reads_only=True) is None  # none recorded
    # Only the windows whose mean SNIC moved >= 100 bytes/s: the even ones (the warm-up's
    # mean is 80 bytes/s); with a floor above every window, none.
    assert snic_load_balance(
        samples, fraction_of_run=1.0, min_mean_bytes_per_s=100.0
    ) == pytest.approx(120 / 110)
    assert snic_load_balance(samples, min_mean_bytes_per_s=1e6) is None


def test_snic_timeline_gives_each_snics_rate_per_interval() -> None:
    from dualpath.bench.harness import snic_timeline

    samples = _samples({"a": [125e6, 0.0], "b": [0.0, 250e6]}, period_s=1.0)  # bytes per second
    timeline = snic_timeline(samples)
    assert timeline["time_s"] == [1.0, 2.0]
    assert timeline["gbps"] == {"a": [1.0, 0.0], "b": [0.0, 2.0]}


def test_ideal_speedup_follows_the_snic_count() -> None:
    assert ideal_speedup(0.5) == 1.0
    assert ideal_speedup(2.0) == 2.0
    assert ideal_speedup(6.0) == 3.0


def test_a_modes_figures_say_how_many_turns_waited_for_their_last_turns_writes() -> None:
    scraped = {
        "dualpath_scheduler_persist_waits_total": [({}, 7.0)],
        "dualpath_scheduler_persist_wait_expired_total": [({}, 2.0)],
    }
    figures = link_figures(scraped, [], jct_s=10.0)
    assert (figures["persist_waits"], figures["persist_wait_expired"]) == (7, 2)
    nothing_scraped = link_figures({}, [], jct_s=10.0)
    assert set(nothing_scraped) == set(figures)  # the same fields, None where not reported
    assert nothing_scraped["persist_waits"] is None

"""The serving-path probes of the ``local`` profile against a real `dualpath serve`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dualpath.bench import sim_profile

pytest.importorskip("nixl_cu12")


def test_serving_probes_time_streamed_requests_on_a_real_cluster(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sim_profile, "SERVING_GRID", ((64, 0, 1), (64, 0, 5), (32, 128, 1)))
    monkeypatch.setattr(sim_profile, "NUM_SERVING_REPEATS", 2)
    monkeypatch.setattr(sim_profile, "NUM_SERVING_WARMUP", 1)
    monkeypatch.setattr(sim_profile, "SERVING_PAUSE_S", 0.05)
    start_s = time.monotonic()
    serving = sim_profile.measure_serving(tiny_model_dir, vocab_size=1024)
    run_s = time.monotonic() - start_s
    assert (serving["nodes"], serving["mode"]) == ("1P2D", "dualpath")
    samples = serving["samples"]
    assert [tuple(s[2:3]) for s in samples] == [(1,)] * 2 + [(5,)] * 2 + [(1,)] * 2
    assert [(new, hit) for new, hit, *_ in samples[:4]] == [(64, 0)] * 4
    # The third probe extends a stored turn of 128 tokens + its 1 output token: the hit is
    # the stored prompt's whole blocks (the block size divides 128).
    for new, hit, *_ in samples[4:]:
        assert hit >= 64 and new + hit == 128 + 1 + 32
    for _, _, num_output, ttft_s, decode_s, pe_busy_s in samples:
        assert 0 < ttft_s < run_s  # seconds, measured within the run: not ms, not a total
        # The last token comes after the first (how long after is the machine's business).
        assert decode_s >= 0 and (num_output == 1 or decode_s > 0)
        # The PE's time in the request's batch, from /metrics: below the TTFT it is part of.
        assert 0 < pe_busy_s < ttft_s
    cpu = serving["frontend_cpu_s_per_request"]
    assert [tuple(row[:3]) for row in cpu] == [(64, 0, 1), (64, 0, 5), (32, 128, 1)]
    assert all(
        server >= 0 and client > 0 for *_, server, client in serving["frontend_cpu_s_per_request"]
    )

"""The scheduler throughput benchmark at a small scale: shape of the result, determinism and
argument checks (the full-size run is ``dualpath bench scheduler``)."""

from __future__ import annotations

import argparse
import json

import pytest

from dualpath.bench.scheduler_bench import add_arguments, main, run_scheduler_bench


@pytest.mark.parametrize("scheduler", ["dualpath", "round_robin"])
def test_small_run_places_the_whole_queue(scheduler):
    result = run_scheduler_bench(num_engines=96, queue_depth=2000, scheduler=scheduler)
    assert result["num_placements"] == 2000
    assert result["num_prefill_engines"] == 32 and result["num_decode_engines"] == 64
    assert result["placements_per_s"] > 0 and result["cpu_s_per_placement"] > 0
    assert "placement" in result and "hardware" in result


def test_placement_counts_are_deterministic_for_a_seed():
    keys = ("num_placements", "num_prefill_fetches", "num_decode_fetches")
    first = run_scheduler_bench(num_engines=48, queue_depth=500, seed=3)
    second = run_scheduler_bench(num_engines=48, queue_depth=500, seed=3)
    assert [first[k] for k in keys] == [second[k] for k in keys]


def test_engine_count_must_fill_whole_groups():
    with pytest.raises(ValueError, match="positive multiple of 48"):
        run_scheduler_bench(num_engines=1000)


def test_main_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--engines", "48", "--queue-depth", "300", "--json", str(out)])
    assert main(args) == 0
    assert json.loads(out.read_text())["num_placements"] == 300
    assert "placements/s" in capsys.readouterr().out

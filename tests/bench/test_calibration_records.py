"""Recorded calibrations (``calibration_records``): a record is found only under the key of
everything the calibrated rate depends on, the user's file before the package's; ``record``
keeps the run of median caps; a recorded calibration is used without any calibration run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dualpath.bench import calibration, calibration_records
from dualpath.bench.calibration_records import (
    calibration_key,
    find_record,
    median_calibration,
    write_record,
)
from dualpath.bench.harness import ModeRun
from dualpath.workload import Session, Turn, Workload


def _workload(first_token: int = 5) -> Workload:
    turns = (Turn(np.array([first_token] * 70, dtype=np.int32), 4), Turn(np.arange(9), 2))
    return Workload((Session("s0", 0.0, turns),), source="test")


def _base(model_dir: Path) -> ModeRun:
    return ModeRun(mode="oracle", model_dir=model_dir, nodes="1P2D", snic_bandwidth_gbps=0.0)


def _calibration(caps_gbps: float) -> dict:
    return {"snic_caps_gbps": caps_gbps, "prompt_tokens_per_busy_s": 1000.0 * caps_gbps}


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUALPATH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(calibration_records, "PACKAGED_RECORDS", tmp_path / "packaged.json")


def test_a_record_is_found_only_under_its_whole_key(tiny_model_dir: Path) -> None:
    base = _base(tiny_model_dir)
    key = calibration_key(base, 2.0, _workload())
    path = write_record(key, _calibration(0.3), "dualpath bench offline ...")
    assert path == calibration_records.user_records_path()
    record, found_in = find_record(key)
    assert found_in == path and record["calibration"]["snic_caps_gbps"] == 0.3
    assert record["command"] == "dualpath bench offline ..."
    # Whatever the rate depends on, changed, finds nothing.
    assert find_record(calibration_key(base, 3.0, _workload())) is None
    assert find_record(calibration_key(base, 2.0, _workload(first_token=6))) is None
    assert find_record(calibration_key(replace(base, nodes="1P1D"), 2.0, _workload())) is None
    assert find_record(calibration_key(replace(base, kv_cache_gb=0.5), 2.0, _workload())) is None
    # What the calibration sets, or what differs between the modes it serves, is not keyed.
    assert find_record(calibration_key(replace(base, mode="basic"), 2.0, _workload())) is not None
    other_machine = {**key, "machine": {**key["machine"], "cpu_count": 999}}
    assert find_record(other_machine) is None


def test_the_users_record_comes_before_the_packages(tiny_model_dir: Path) -> None:
    key = calibration_key(_base(tiny_model_dir), 2.0, _workload())
    write_record(key, _calibration(0.5), "packaged", calibration_records.PACKAGED_RECORDS)
    assert find_record(key)[0]["calibration"]["snic_caps_gbps"] == 0.5
    write_record(key, _calibration(0.3), "mine")
    assert find_record(key)[0]["calibration"]["snic_caps_gbps"] == 0.3


def test_a_broken_records_file_is_named(tiny_model_dir: Path) -> None:
    path = calibration_records.user_records_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    key = calibration_key(_base(tiny_model_dir), 2.0, _workload())
    with pytest.raises(ValueError, match=r"calibrations\.json are not JSON .* fix or remove it"):
        find_record(key)


def test_the_median_run_is_kept_with_every_runs_caps() -> None:
    chosen = median_calibration([_calibration(0.5), _calibration(0.3), _calibration(0.4)])
    assert chosen["snic_caps_gbps"] == 0.4 and chosen["prompt_tokens_per_busy_s"] == 400.0
    assert chosen["calibration_runs_caps_gbps"] == [0.5, 0.3, 0.4]
    assert chosen["calibration_runs_caps_spread"] == pytest.approx((0.5 - 0.3) / 0.4)
    assert median_calibration([_calibration(0.2), _calibration(0.6)])["snic_caps_gbps"] == 0.2


def _oracle(read_bytes: int) -> dict:
    return {
        "jct_s": 10.0, "pe_busy_fraction": 0.5, "prompt_tokens": 10_000, "cached_tokens": 8_000,
        "path_bytes": {"pe": read_bytes}, "engine_cached_bytes": 0, "num_failed": 0,
    }  # fmt: skip


def test_record_then_recorded_calibrates_once_and_then_never(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = iter([500_000_000, 300_000_000, 400_000_000, 100_000_000])
    runs: list[Path] = []

    def run_mode(run, workload, *, work_dir, progress):
        runs.append(work_dir)
        return _oracle(next(reads))

    monkeypatch.setattr(calibration, "run_mode", run_mode)
    monkeypatch.setattr(calibration, "mode_problems", lambda what, result: [])
    base, workload = _base(tiny_model_dir), _workload()
    recorded, report, problems = calibration.calibrated_run(
        base, 2.0, workload, tmp_path, progress=False, source="record", num_runs=3, command="c"
    )
    assert problems == [] and len(runs) == 3
    assert report["calibration_source"] == "recorded by this run"
    assert report["snic_caps_gbps"] == pytest.approx(0.4 * 8 / 5 / 2)  # the median run's
    assert recorded.snic_bandwidth_gbps == report["snic_caps_gbps"]
    records = json.loads(calibration_records.user_records_path().read_text())
    assert [r["command"] for r in records.values()] == ["c"]

    again, report, _ = calibration.calibrated_run(base, 2.0, workload, tmp_path, progress=False)
    assert len(runs) == 3  # no calibration run: the record's caps
    assert (
        report["calibration_source"] == "recorded"
        and report["calibration_record"]["command"] == "c"
    )
    assert again.snic_bandwidth_gbps == recorded.snic_bandwidth_gbps
    assert again.prefill_tokens_per_s == recorded.prefill_tokens_per_s

    _, report, _ = calibration.calibrated_run(
        base, 2.0, workload, tmp_path, progress=False, source="run"
    )
    assert len(runs) == 4 and report["calibration_source"] == "this run"


def test_the_packages_records_are_whole_and_under_their_own_keys() -> None:
    records = json.loads(
        Path(calibration_records.__file__)
        .with_name("data")
        .joinpath("calibrations.json")
        .read_text()
    )
    assert records, "the package records the machine kinds it was measured on"
    for record_id, record in records.items():
        assert calibration_records.key_id(record["key"]) == record_id
        assert record["calibration"]["snic_caps_gbps"] > 0
        assert record["calibration"]["prompt_tokens_per_busy_s"] > 0
        assert record["command"].startswith("dualpath bench ") and record["recorded_at"]

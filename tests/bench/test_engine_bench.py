"""`dualpath bench engine` on the tiny checkpoint: the JSON's fields and refused flags, not
timings (those are the benchmark's business, on the real model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.cli import main

SMALL = [
    "--dtypes",
    "float32",
    "--threads",
    "1",
    "--prompt-tokens",
    "32",
    "--decode-prompt-tokens",
    "8",
    "--decode-tokens",
    "3",
    "--batch-sizes",
    "1,16",
    "--repeats",
    "2",
]
WORKLOADS = {"prefill", "decode@1", "decode@16"}


def test_report_records_config_timings_ratios_and_targets(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "out" / "engine.json"
    assert (
        main(["bench", "engine", "--model", str(tiny_model_dir), *SMALL, "--json", str(path)]) == 0
    )
    report = json.loads(path.read_text())
    config = report["config"]
    assert config["model_dir"] == str(tiny_model_dir)
    assert (config["dtypes"], config["num_threads"], config["seed"]) == (["float32"], 1, 0)
    assert config["batch_sizes"] == [1, 16] and config["num_repeats"] == 2
    assert {"cpu_model", "torch", "transformers"} <= report["hardware"].keys()
    copy = report["copy_bandwidth"]
    assert "read + written" in copy["method"] and len(copy["samples_s"]) == 2
    result = report["results"]["float32"]
    for engine in ("ours", "transformers"):
        assert set(result[engine]["tokens_per_s"]) == WORKLOADS
        for samples in result[engine]["samples"].values():
            assert len(samples["prefill_s"]) == len(samples["decode_s"]) == 2
    assert set(result["ratios"]) == WORKLOADS | {"decode@1_vs_bandwidth_bound"}
    assert result["weight_bytes"] > 0 and result["bandwidth_bound_tokens_per_s"] > 0
    assert set(result["tokens_agree"]) == WORKLOADS
    targets = {(t["name"], t["dtype"]): t for t in report["targets"]}
    assert [t["least"] for t in targets.values()] == [1.0, 3.0, 0.5]
    assert all(isinstance(t["is_met"], bool) for t in targets.values())
    summary = path.with_suffix(".md").read_text()
    assert "decode@16 ours / transformers" in summary and "bound" in summary


def test_two_dtypes_report_their_ratio(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    flags = [*SMALL, "--dtypes", "float32,bfloat16", "--batch-sizes", "2", "--repeats", "1"]
    assert (
        main(["bench", "engine", "--model", str(tiny_model_dir), *flags, "--json", str(path)]) == 0
    )
    report = json.loads(path.read_text())
    assert set(report["results"]) == {"float32", "bfloat16"}
    ratios = report["dtype_ratios"]["bfloat16_vs_float32"]
    assert set(ratios["ours"]) == set(ratios["transformers"]) == {"prefill", "decode@2"}
    assert report["targets"] == []  # no batch 1 or 16 measured: nothing to judge


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-sizes", "0"], "batch sizes must be integers > 0"),
        (["--batch-sizes", "1,x"], "not a comma-separated list"),
        (["--batch-sizes", "4,4"], "batch sizes must be distinct"),
        (["--dtypes", "float16"], "expected a comma-separated list of ('float32', 'bfloat16')"),
        (["--decode-tokens", "1"], "decode_tokens must be >= 2"),
        (["--threads", "0"], "argument --threads: must be > 0"),
        (["--repeats", "0"], "argument --repeats: must be > 0"),
        (["--prompt-tokens", "20000"], "max_position_embeddings 16384"),
        (["--engines", "ours,vllm"], "engines must be ours and transformers, optionally vllm"),
        (["--engines", "ours,transformers,ours"], "each once"),
        (["--engines", "ours,sglang"], "argument --engines"),
    ],
)
def test_bad_flags_are_refused_by_name(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "engine", "--model", str(tiny_model_dir), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

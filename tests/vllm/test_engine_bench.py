"""`dualpath bench engine --engines ours,transformers,vllm` on the embedded checkpoint: vLLM's
engine is measured beside ours and transformers in one run, its figures and its agreement
with ours in the JSON (the timings are the benchmark's business, not the test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm


def test_vllm_is_measured_beside_ours_and_transformers(
    smollm2_model_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "engine.json"
    argv = [
        sys.executable, "-m", "dualpath.cli", "bench", "engine",
        "--model", str(smollm2_model_dir), "--engines", "ours,transformers,vllm",
        "--dtypes", "float32", "--threads", "1", "--prompt-tokens", "256",
        "--decode-prompt-tokens", "32", "--decode-tokens", "8", "--batch-sizes", "1,4",
        "--repeats", "1", "--json", str(path),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads(path.read_text())
    assert report["config"]["engines"] == ["ours", "transformers", "vllm"]
    assert report["hardware"]["vllm"].startswith("0.32")
    result = report["results"]["float32"]
    workloads = {"prefill", "decode@1", "decode@4"}
    assert set(result["vllm"]["tokens_per_s"]) == workloads
    assert all(value > 0 for value in result["vllm"]["tokens_per_s"].values())
    assert set(result["ratios_vs_vllm"]) == set(result["tokens_agree_vllm"]) == workloads
    assert "ours / vllm" in path.with_suffix(".md").read_text()

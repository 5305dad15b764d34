"""A user's own cluster or model as a JSON profile (``profiles.resolve_*``), end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dualpath.cli import main
from dualpath.sim.profiles import HARDWARE, MODELS, resolve_hardware, resolve_model


def _write(path: Path, fields: dict) -> str:
    path.write_text(json.dumps(fields))
    return str(path)


def test_a_profile_file_is_a_base_plus_the_fields_that_differ(tmp_path):
    path = _write(tmp_path / "half_snic.json", {"base": "hopper-8x400", "snic_bandwidth_gbps": 200})
    profile = resolve_hardware(path)
    assert profile.name == "half_snic" and profile.snic_bandwidth_gbps == 200
    base = HARDWARE["hopper-8x400"]
    assert dataclasses.replace(profile, name=base.name, snic_bandwidth_gbps=400.0) == base
    assert resolve_hardware("hopper-8x400") is base and resolve_hardware(profile) is profile


def test_a_whole_model_profile_loads_from_its_fields(tmp_path):
    fields = dataclasses.asdict(MODELS["27b"])
    del fields["name"], fields["source"]
    profile = resolve_model(_write(tmp_path / "my_moe.json", fields | {"num_layers": 40}))
    assert profile.name == "my_moe" and profile.num_layers == 40
    assert profile.source.endswith("my_moe.json")
    assert dataclasses.replace(
        profile, name="27b", num_layers=30, source=""
    ) == dataclasses.replace(MODELS["27b"], source="")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"base": "hopper-8x400", "snic_gbps": 1}, "unknown fields snic_gbps"),
        ({"num_gpus_per_node": 8}, "missing gpu_flops_per_s"),
        ({"base": "h100"}, "unknown base 'h100'"),
        ({"base": "hopper-8x400", "num_gpus_per_node": 0}, "num_gpus_per_node must be > 0"),
        ({"base": "hopper-8x400", "gpu_flops_per_s": "fast"}, "hardware profile"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_a_bad_profile_file_is_named_with_its_problem(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        resolve_hardware(_write(tmp_path / "bad.json", fields))


def test_names_that_are_neither_built_in_nor_json_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware 'h200'; choose from hopper-8x400"):
        resolve_hardware("h200")
    with pytest.raises(ValueError, match="No such file"):
        resolve_model(str(tmp_path / "missing.json"))


def _jct(capsys, tmp_path: Path, hardware: str, *extra: str) -> float:
    out_json = tmp_path / "run.json"
    args = ["simulate", "--model", "27b", "--nodes", "1P1D", "--agents", "64", "--scale-down"]
    args += ["8", "--modes", "basic,dualpath", "--max-len", "32768", "--no-progress"]
    assert main([*args, "--hardware", hardware, "--json", str(out_json), *extra]) == 0
    capsys.readouterr()
    (basic, _) = json.loads(out_json.read_text())["runs"]
    return basic["jct_s"]


def test_a_simulation_and_the_advisor_run_on_a_cluster_from_a_file(capsys, tmp_path):
    slow = _write(tmp_path / "slow_snic.json", {"base": "hopper-8x400", "snic_bandwidth_gbps": 50})
    # Basic reads every hit through the PE node's SNIC: an eighth of it slows the run.
    assert _jct(capsys, tmp_path, slow, "--jobs", "2") > _jct(capsys, tmp_path, "hopper-8x400")
    args = ["plan", "--total-nodes", "3", "--agents", "64", "--scale-down", "8", "--no-progress"]
    advice_json = tmp_path / "plan.json"
    assert main([*args, "--hardware", slow, "--json", str(advice_json)]) == 0
    printed = capsys.readouterr().out
    assert "SPEC §5 bottleneck-free P/D range on slow_snic:" in printed
    advice = json.loads(advice_json.read_text())
    assert (advice["hardware"], advice["model"], advice["agents"]) == ("slow_snic", "27b", 8)
    assert [c["nodes"] for c in advice["candidates"]] == ["1P2D", "2P1D"]
    best = max(advice["candidates"], key=lambda c: c["turns_per_s_per_gpu"])
    assert advice["recommended"] == best["nodes"] and f"recommended: {best['nodes']}" in printed
    with pytest.raises(SystemExit) as stopped:
        main([*args, "--hardware", str(tmp_path / "none.json")])
    assert stopped.value.code == 2
    assert "hardware profile" in capsys.readouterr().err

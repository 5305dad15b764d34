"""The ``dualpath`` command in-process: real argument parsing, real engine, real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_reuses_the_store_across_invocations(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    common = ["--model", str(tiny_model_dir), "--kv-store", str(tmp_path / "kv"), "--json"]
    ids = ",".join(str(i % 1000) for i in range(150))
    code, out, _ = run_cli(
        capsys, "generate", *common, "--prompt-ids", ids, "--max-tokens", "20", "--ignore-eos"
    )
    assert code == 0
    first = json.loads(out)
    assert set(first) >= {"text", "token_ids", "num_prompt_tokens", "num_cached_tokens", "ttft_s"}
    assert first["num_prompt_tokens"] == 150 and first["num_cached_tokens"] == 0
    extended = ids + "," + ",".join(map(str, first["token_ids"])) + ",5,6,7"
    code, out, _ = run_cli(capsys, "generate", *common, "--prompt-ids", extended)
    assert code == 0
    assert json.loads(out)["num_cached_tokens"] == 64 * ((150 + 20 - 1) // 64)


def test_make_model_writes_a_loadable_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run_cli(capsys, "make-model", "--preset", "tiny", "--out", str(tmp_path / "m"))
    assert code == 0 and "wrote" in out
    files = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    code, _, err = run_cli(capsys, "make-model", "--out", str(tmp_path / "m"))
    assert code == 2 and "already exists" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["make-model", "--preset", "huge", "--out", "{tmp}/x"], "unknown preset 'huge'"),
        (["generate", "--model", "{tmp}/missing", "--prompt", "hi"], "not a directory"),
        (["generate", "--model", "{tmp}", "--prompt", "hi"], "no *.safetensors"),
        (["generate", "--model", "{model}", "--prompt", "hi", "--max-tokens", "0"], "max-tokens"),
        (["generate", "--model", "{model}", "--prompt-ids", "1,2,99999"], "outside the vocab"),
        (["generate", "--model", "{model}", "--prompt-ids", "1,x"], "comma-separated"),
        (
            ["generate", "--model", "{model}", "--prompt", "a " * 9000, "--max-model-len", "8192"],
            "longer than the model's context",
        ),
    ],
)
def test_bad_input_gives_a_clear_error(
    capsys: pytest.CaptureFixture[str],
    tiny_model_dir: Path,
    tmp_path: Path,
    args: list[str],
    message: str,
) -> None:
    argv = [a.format(tmp=tmp_path, model=tiny_model_dir) for a in args]
    code, _, err = (
        run_cli(capsys, *argv, "--no-kv-store") if argv[0] == "generate" else run_cli(capsys, *argv)
    )
    assert code == 2
    assert message in err


def test_malformed_checkpoint_is_named(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    (broken / "config.json").write_text("{not json")
    code, _, err = run_cli(capsys, "generate", "--model", str(broken), "--prompt", "x")
    assert code == 2 and "config.json" in err and "JSON" in err
    (broken / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    code, _, err = run_cli(capsys, "generate", "--model", str(broken), "--prompt", "x")
    assert code == 2 and "GPT2LMHeadModel" in err
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    (broken / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", "--model", str(broken), "--prompt", "x")
    assert code == 2 and "dynamic" in err and "rope" in err


def test_demo_runs_on_the_embedded_default(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    smollm2_model_dir: Path,
) -> None:
    """The real default (already converted: linked where the default lives) answers through its
    chat template, and each turn finds the earlier turns' KV in the store."""
    from dualpath.model.default import DEFAULT_MODEL_NAME

    monkeypatch.setenv("DUALPATH_HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / DEFAULT_MODEL_NAME).symlink_to(smollm2_model_dir)
    code, out, _ = run_cli(capsys, "demo", "--turns", "3", "--max-tokens", "8")
    assert code == 0
    rows = [line.split(maxsplit=5) for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert int(rows[0][2]) == 0 and int(rows[2][2]) > 0  # turn 3 finds turn 1-2's blocks
    assert all(len(r) == 6 and "<|im_end|>" not in r[5] for r in rows)  # an answer, no end token
    assert not (tmp_path / "models" / "tiny").exists()


def test_simulate_free_form_writes_runs_and_says_which_build_ran(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from dualpath import compiled

    out_json = tmp_path / "sim.json"
    code, out, err = run_cli(
        capsys,
        "simulate",
        *("--nodes", "2P4D", "--agents", "512", "--scale-down", "8"),
        *("--modes", "basic,dualpath", "--json", str(out_json)),
    )
    assert code == 0
    data = json.loads(out_json.read_text())
    assert [run["mode"] for run in data["runs"]] == ["basic", "dualpath"]
    assert all(run["agents"] == 64 and run["jct_s"] > 0 for run in data["runs"])
    assert data["compiled"] is compiled.is_active()
    build = "compiled build" if data["compiled"] else "Python sources"
    assert f"events/s ({build})" in out
    assert "basic |" in out and "dualpath |" in out
    assert "done: deepseek-v3.2-660b 2P4D basic 64 agents: JCT" in err  # beside the bars
    assert "done:" not in out


def test_simulate_without_progress_writes_nothing_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ("simulate", "--model", "27b", "--nodes", "1P1D", "--agents", "8", "--scale-down", "8")
    code, out, err = run_cli(capsys, *args, "--modes", "dualpath", "--no-progress")
    assert code == 0 and "dualpath |" in out
    assert err == ""


def test_simulate_refuses_free_form_flags_with_an_experiment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(capsys, "simulate", "--experiment", "ablation", "--agents", "512")
    assert code == 2
    assert "--agents shapes free-form runs; --experiment ablation runs its own" in err
    code, _, err = run_cli(capsys, "simulate", "--calibrate", "--hardware", "local")
    assert code == 2 and "--hardware shapes free-form runs; --calibrate" in err
    # A workload seed suits the SPEC experiments, not the one fit nor the fidelity check.
    for what in (("--calibrate",), ("--experiment", "fidelity")):
        code, _, err = run_cli(capsys, "simulate", *what, "--seed", "1")
        assert code == 2 and "--seed shapes free-form runs" in err


def test_the_store_is_bounded_by_default(tmp_path: Path) -> None:
    import shutil

    from dualpath.cli import DEFAULT_STORE_FREE_SPACE_FRACTION, store_config

    root = tmp_path / "not" / "yet" / "kv"  # measured on the file system it will be made on
    free_bytes = shutil.disk_usage(tmp_path).free
    capacity_bytes = store_config(root, None).capacity_bytes
    assert capacity_bytes is not None
    assert capacity_bytes == pytest.approx(DEFAULT_STORE_FREE_SPACE_FRACTION * free_bytes, rel=0.01)
    assert store_config(root, 2.5).capacity_bytes == 2_500_000_000
    assert store_config(None, None).root_dir is None
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="--kv-store-capacity-gb"):
            store_config(root, bad)
    assert not root.exists()  # building the config made nothing


def test_simulate_online_on_a_shaped_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The capacity of each mode on a trace shaped as the benchmarks shape it."""
    from dualpath.workload.mooncake import packaged_trace_path

    out_json = tmp_path / "sim.json"
    code, out, _ = run_cli(
        capsys,
        "simulate",
        *("--model", "27b", "--nodes", "1P1D", "--scale-down", "8", "--agents", "6"),
        *("--trace", str(packaged_trace_path("agentic_coding_dev")), "--max-turns", "4"),
        *("--gen-scale", "0.2", "--modes", "basic,dualpath", "--online", "--no-progress"),
        *("--json", str(out_json)),
    )
    assert code == 0, out
    runs = json.loads(out_json.read_text())["runs"]
    # Offline, the 6 sessions of 4 turns each (and DualPath's first 4 alone: the window).
    offline = [r for r in runs if r.get("aps") is None and r["num_requests"] == 6 * 4]
    assert sorted(r["mode"] for r in offline) == ["basic", "dualpath"]
    probes = [r for r in runs if r.get("aps") is not None]
    assert {r["mode"] for r in probes} == {"basic", "dualpath"}
    assert "basic | " in out and "dualpath / basic capacity: " in out
    code, _, err = run_cli(capsys, "simulate", "--max-turns", "4", "--no-progress")
    assert code == 2 and "--max-turns and --gen-scale shape a --trace" in err

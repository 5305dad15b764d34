"""A user's mistake, in every ``dualpath`` subcommand, is one line: exit 2, no traceback.

Each case runs the command as a user does (``python -m dualpath.cli`` in a subprocess) with a
usual mistake: a path that does not exist, a directory where a file is expected (as root,
a file without read permission is read anyway, so a directory or a missing path stands for
an unreadable one), a folder that is not a checkpoint, a malformed trace or config, flags
that contradict each other, a bad number, a workload the preset cannot calibrate on. Each
must be refused with a single ``dualpath: error:`` line that names the problem, before any
model loads or engine starts. The subprocesses of every case run at once, a few at a time,
before the first assertion (``outcomes``), so the file stays fast on two cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dualpath.cli import build_parser, main

TOKEN = "DUALPATH_CLUSTER_TOKEN"
NUM_WORKERS = 4  # subprocesses at once: mostly interpreter start-up, some of it I/O
TIMEOUT_S = 120  # per command; a case that gets near it started something it should not


@dataclass(frozen=True)
class Case:
    """``dualpath ARGV`` exits 2 with one error line containing ``fragment``. ``{name}`` in
    ``argv`` is a path from ``inputs``; ``env`` sets (or with None, unsets) variables."""

    argv: str
    fragment: str
    env: dict[str, str | None] = field(default_factory=dict)


NO_TOKEN = {TOKEN: None}
# The flags that make `dualpath engine` a complete engine apart from the one mistake.
ENGINE = "engine --role prefill --scheduler tcp://127.0.0.1:1 --engine-id 0 --node-id 0"

CASES = {
    # --- the command itself
    "no-command": Case("", "the following arguments are required: COMMAND"),
    # --- make-model
    "make-model/out-under-a-file": Case("make-model --out {file}/m", "is not a directory"),
    # --- convert-gguf
    "convert-gguf/a-directory": Case(
        "convert-gguf {empty_dir} --out {tmp}/c", "is a directory, not a GGUF file"
    ),
    "convert-gguf/not-gguf": Case("convert-gguf {file} --out {tmp}/c", "not a GGUF file"),
    "convert-gguf/out-exists": Case(
        "convert-gguf {file} --out {empty_dir}", "already exists; pass --force"
    ),
    # --- generate
    "generate/model-bad-config": Case(
        "generate --no-kv-store --prompt hi --model {bad_checkpoint}", "cannot be parsed as JSON"
    ),
    "generate/kv-store-is-a-file": Case(
        "generate --prompt hi --model {model} --kv-store {file}/kv",
        "is not a directory; pass another --kv-store",
    ),
    "generate/capacity-without-store": Case(
        "generate --prompt hi --model {model} --no-kv-store --kv-store-capacity-gb 1",
        "--kv-store-capacity-gb sizes the KV store, and --no-kv-store has none",
    ),
    "generate/vllm-arg-without-vllm-engine": Case(
        "generate --no-kv-store --prompt hi --model {model} --vllm-arg max_num_seqs=2",
        "give it with --engine vllm",
    ),
    "generate/vllm-engine-on-a-device": Case(
        "generate --no-kv-store --prompt hi --model {model} --engine vllm --device cuda:0",
        "--device cuda:0 is the native engine's",
    ),
    "generate/vllm-prefill-batching": Case(
        "generate --no-kv-store --prompt hi --model {model} --engine vllm "
        "--vllm-prefill-batching quota",
        "--vllm-prefill-batching is a prefill engine's",
    ),
    "demo/vllm-engine": Case("demo --no-kv-store --engine vllm", "demo runs the native engine"),
    "generate/no-such-cuda-device": Case(
        "generate --no-kv-store --prompt hi --model {model} --device cuda:99",
        "device 'cuda:99' is not available",
    ),
    # --- demo
    "demo/too-many-turns": Case("demo --no-kv-store --model {model} --turns 9", "--turns must"),
    # --- engine (the cluster token is set unless a case says otherwise)
    "engine/no-token": Case(f"{ENGINE} --model {{model}}", f"set ${TOKEN}", NO_TOKEN),
    "engine/config-missing": Case("engine --config {missing}.json", "cannot be read"),
    "engine/config-a-directory": Case("engine --config {empty_dir}", "Is a directory"),
    "engine/config-not-json": Case("engine --config {bad_jsonl}", "not JSON"),
    "engine/config-incomplete": Case(
        "engine --config {partial_config}", "missing engine_id, node_id, scheduler_endpoint"
    ),
    "engine/bad-scheduler-endpoint": Case(
        "engine --role prefill --scheduler localhost --engine-id 0 --node-id 0",
        "expected tcp://HOST:PORT or ipc://PATH",
    ),
    "engine/negative-engine-id": Case(
        "engine --role prefill --scheduler tcp://h:5 --engine-id -1 --node-id 0",
        "argument --engine-id: must be >= 0",
    ),
    "engine/kv-cache-gb-0": Case(
        f"{ENGINE} --model {{model}} --kv-cache-gb 0", "argument --kv-cache-gb"
    ),
    "engine/model-not-a-checkpoint": Case(
        f"{ENGINE} --no-kv-store --model {{empty_dir}}", "is this a checkpoint directory?"
    ),
    # --- vllm-config
    "vllm-config/bad-url": Case(
        "vllm-config --role decode --engine-id 1 --node-id 1 --scheduler tcp://h:5 --url h:8000",
        "expected http://HOST:PORT",
    ),
    "vllm-config/no-role": Case(
        "vllm-config --engine-id 1 --node-id 1 --scheduler tcp://h:5 --url http://h:8000",
        "the following arguments are required: --role",
    ),
    # --- serve
    "serve/config-missing": Case("serve --config {missing}.yaml", "cannot be read"),
    "serve/config-not-yaml": Case("serve --config {bad_yaml}", "not valid YAML at line 2"),
    "serve/model-missing": Case(
        "serve --no-kv-store --model {missing}", "is this a checkpoint directory?"
    ),
    "serve/buffer-gb-infinite": Case("serve --buffer-gb inf", "argument --buffer-gb"),
    "serve/external-engines-without-token": Case(
        "serve --no-kv-store --model {model} --external-engines", f"needs ${TOKEN}", NO_TOKEN
    ),
    "serve/kv-store-is-a-file": Case(
        "serve --model {model} --kv-store {file}", "is not a directory; pass another --kv-store"
    ),
    "serve/log-dir-is-a-file": Case(
        "serve --no-kv-store --model {model} --engine-log-dir {file}", "--engine-log-dir"
    ),
    "serve/no-such-cuda-device": Case(
        "serve --no-kv-store --model {model} --device cuda:99", "device 'cuda:99' is not"
    ),
    # --- bench
    "bench/no-benchmark": Case("bench", "the following arguments are required: BENCHMARK"),
    "bench-store/num-blocks-0": Case("bench store --num-blocks 0", "argument --num-blocks"),
    "bench-store/json-a-directory": Case(
        "bench store --json {empty_dir}", "is a directory; name a file"
    ),
    "bench-scheduler/engines-per-node-0": Case(
        "bench scheduler --engines-per-node 0", "argument --engines-per-node"
    ),
    "bench-transfer/total-mib-0": Case("bench transfer --total-mib 0", "argument --total-mib"),
    "bench-engine/model-not-a-checkpoint": Case(
        "bench engine --model {empty_dir}", "is this a checkpoint directory?"
    ),
    "bench-offline/trace-missing": Case(
        "bench offline --model {model} --trace {missing}.jsonl",
        "cannot be read: No such file or directory",
    ),
    "bench-offline/trace-a-directory": Case(
        "bench offline --model {model} --trace {empty_dir}", "cannot be read: Is a directory"
    ),
    "bench-offline/trace-not-json": Case(
        "bench offline --model {model} --trace {bad_jsonl}", "bad.jsonl:2: not valid JSON"
    ),
    "bench-offline/calibrated-preset-without-reuse": Case(
        "bench offline --model {model} --preset paper-ratio --trace {no_reuse}",
        "--preset paper-ratio calibrates the SNIC caps on the hit KV",
    ),
    "bench-offline/rho-without-reuse": Case(
        "bench offline --model {model} --rho 2 --trace {no_reuse}",
        "--rho 2 calibrates the SNIC caps",
    ),
    "bench-offline/rho-0": Case("bench offline --model {model} --rho 0", "argument --rho"),
    "bench-offline/calibration-with-fixed-caps": Case(
        "bench offline --model {model} --calibration run",
        "--calibration run: preset ci has fixed SNIC caps",
    ),
    "bench-offline/calibration-runs-without-record": Case(
        "bench offline --model {model} --preset paper-ratio --calibration-runs 2",
        "--calibration-runs: only with --calibration record",
    ),
    "bench-offline/calibration-with-url": Case(
        "bench offline --model {model} --url http://127.0.0.1:9 --calibration run",
        "--vllm-servers, --calibration, --calibration-runs or --links",
    ),
    "bench-offline/kernel-links-with-vllm-servers": Case(
        "bench offline --model {model} --links kernel --vllm-servers", "not --vllm-servers"
    ),
    "bench-online/calibration-with-fixed-caps": Case(
        "bench online --model {model} --calibration record", "--calibration record: preset ci"
    ),
    "bench-offline/model-bad-config": Case(
        "bench offline --model {bad_checkpoint}", "cannot be parsed as JSON"
    ),
    "bench-offline/api-key-without-url": Case(
        "bench offline --model {model} --api-key k", "--api-key: only for a server of your own"
    ),
    "bench-offline/json-under-a-file": Case(
        "bench offline --model {model} --json {file}/x.json", "is not a directory"
    ),
    "bench-offline/out-dir-is-a-file": Case(
        "bench offline --model {model} --out-dir {file}", "is a file; name a directory"
    ),
    "bench-online/calibrated-preset-without-reuse": Case(
        "bench online --model {model} --preset paper-ratio --trace {no_reuse}",
        "--preset paper-ratio calibrates",
    ),
    "bench-online/aps-0": Case("bench online --model {model} --aps 0", "argument --aps"),
    "bench-online/vllm-engine-without-vllm": Case(
        "bench online --model {model} --engine vllm --modes basic", "needs vLLM"
    ),
    "bench-offline/vllm-engine-without-vllm": Case(
        "bench offline --model {model} --engine vllm --modes basic,dualpath", "needs vLLM"
    ),
    "bench-offline/vllm-arg-without-vllm-engine": Case(
        "bench offline --model {model} --vllm-arg max_num_seqs=4", "give it with --engine vllm"
    ),
    "bench-offline/vllm-prefill-batching-without-vllm-engine": Case(
        "bench offline --model {model} --vllm-prefill-batching quota",
        "--vllm-prefill-batching is what a vLLM prefill engine hands vLLM",
    ),
    "serve/vllm-prefill-batching-without-vllm-engine": Case(
        "serve --model {model} --vllm-prefill-batching quota",
        "--vllm-prefill-batching is what a vLLM prefill engine hands vLLM",
    ),
    "serve/local-prefill-without-vllm-engine": Case(
        "serve --model {model} --local-prefill-tokens 256",
        "--local-prefill-tokens: our own engine's decode engines do not prefill",
    ),
    "bench-offline/engine-with-url": Case(
        "bench offline --model {model} --url http://127.0.0.1:1 --engine vllm",
        "do not give --engine",
    ),
    "bench-vs-vllm/unknown-system": Case(
        "bench vs-vllm --model {model} --systems vllm-single,dualpath-9P9D",
        "--systems: unknown dualpath-9P9D",
    ),
    "bench-vs-vllm/regime-and-kv-cache": Case(
        "bench vs-vllm --model {model} --regime small --kv-cache-gb 1",
        "--kv-cache-gb: --regime sizes every system's KV memory",
    ),
    "bench-vs-vllm/unknown-regime": Case(
        "bench vs-vllm --model {model} --regime huge", "invalid choice: 'huge'"
    ),
    "bench-vs-vllm/reserved-vllm-arg": Case(
        "bench vs-vllm --model {model} --vllm-arg block_size=16", "block_size"
    ),
    # --- simulate
    "simulate/trace-missing": Case("simulate --trace {missing}.jsonl", "cannot be read"),
    "simulate/model-profile-missing": Case(
        "simulate --model {missing}.json", "missing.json: cannot be read"
    ),
    "simulate/bench-json-without-fidelity": Case(
        "simulate --bench-json {file}", "only for --experiment fidelity"
    ),
    "simulate/fidelity-bench-json-missing": Case(
        "simulate --experiment fidelity --bench-json {missing}.json", "cannot be read"
    ),
    "simulate/calibrate-and-experiment": Case(
        "simulate --calibrate --experiment scale", "--calibrate runs the fit alone"
    ),
    "simulate/full-without-experiment": Case("simulate --full", "--full runs an experiment"),
    "simulate/png-under-a-file": Case("simulate --png {file}/x.png", "is not a directory"),
    # --- plan
    "plan/one-node": Case("plan --total-nodes 1 --no-progress", "need at least 2 nodes"),
    "plan/json-a-directory": Case("plan --json {empty_dir}", "is a directory; name a file"),
}
if importlib.util.find_spec("vllm") is None:  # the ordinary venv: --engine vllm cannot run here
    CASES["serve/vllm-engine-without-vllm"] = Case(
        "serve --no-kv-store --model {model} --engine vllm", "needs vLLM"
    )
    CASES["generate/vllm-engine-without-vllm"] = Case(
        "generate --no-kv-store --prompt hi --model {model} --engine vllm", "needs vLLM"
    )
    CASES["bench-vs-vllm/without-vllm"] = Case(
        "bench vs-vllm --model {model} --systems vllm-single", "needs vLLM"
    )

# Every subcommand, nested ones included: each prints its help and exits 0.
HELP_COMMANDS = [
    "",
    "make-model",
    "convert-gguf",
    "generate",
    "demo",
    "engine",
    "serve",
    "vllm-config",
    "bench",
    "bench store",
    "bench scheduler",
    "bench transfer",
    "bench engine",
    "bench offline",
    "bench online",
    "bench vs-vllm",
    "simulate",
    "plan",
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """The paths the cases name: valid ones, and one of each kind of mistake."""
    tmp = tmp_path_factory.mktemp("mistakes")
    (tmp / "empty").mkdir()
    (tmp / "file.txt").write_text("not what any flag wants\n")
    bad_checkpoint = tmp / "bad-checkpoint"  # the tiny checkpoint, but its config.json cut
    bad_checkpoint.mkdir()
    for path in tiny_model_dir.iterdir():
        (bad_checkpoint / path.name).symlink_to(path)
    (bad_checkpoint / "config.json").unlink()
    (bad_checkpoint / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    # Six one-turn sessions (the Mooncake format with the agentic extension): no reuse.
    no_reuse = [
        {"session_id": f"s{i}", "turn": 0, "timestamp": 0, "input_length": 600,
         "output_length": 10, "hash_ids": [2 * i, 2 * i + 1]}
        for i in range(6)
    ]  # fmt: skip
    (tmp / "no_reuse.jsonl").write_text("".join(json.dumps(row) + "\n" for row in no_reuse))
    (tmp / "bad.jsonl").write_text(json.dumps(no_reuse[0]) + "\n{oops\n")
    (tmp / "partial.json").write_text('{"role": "prefill"}')
    (tmp / "bad.yaml").write_text("port: [1\n")
    return {
        "tmp": tmp,
        "model": tiny_model_dir,
        "missing": tmp / "missing",
        "empty_dir": tmp / "empty",
        "file": tmp / "file.txt",
        "bad_checkpoint": bad_checkpoint,
        "no_reuse": tmp / "no_reuse.jsonl",
        "bad_jsonl": tmp / "bad.jsonl",
        "partial_config": tmp / "partial.json",
        "bad_yaml": tmp / "bad.yaml",
    }


def run_dualpath(argv: list[str], env_changes: dict[str, str | None], home: Path):
    env = {**os.environ, "DUALPATH_HOME": str(home), TOKEN: "test-token"}
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run(
        [sys.executable, "-m", "dualpath.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def outcomes(inputs: dict[str, Path]) -> dict[str, subprocess.CompletedProcess]:
    """Every case's finished command, run a few at a time."""
    home = inputs["tmp"] / "home"  # nothing may fall back on the user's own data directory
    with ThreadPoolExecutor(NUM_WORKERS) as pool:
        futures = {
            name: pool.submit(run_dualpath, case.argv.format(**inputs).split(), case.env, home)
            for name, case in CASES.items()
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", CASES)
def test_a_mistake_is_one_error_line(
    name: str, outcomes: dict[str, subprocess.CompletedProcess]
) -> None:
    result = outcomes[name]
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dualpath: error: "), result.stderr
    assert CASES[name].fragment in lines[0]
    assert result.returncode == 2


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """In-process: help is parsing alone, and a subprocess per command costs a second each."""
    with pytest.raises(SystemExit) as exit_info:
        main([*command.split(), "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: dualpath {command}".rstrip())


def test_every_subcommand_is_swept() -> None:
    """A new subcommand gets its mistakes and its help checked here too."""
    commands = set(_subcommands(build_parser()))
    assert commands == set(HELP_COMMANDS) - {""}
    swept = {_command_of(case.argv, commands) for case in CASES.values()}
    assert commands <= swept


def _command_of(argv: str, commands: set[str]) -> str:
    """The longest run of ``argv``'s first words that names a subcommand ("" for none)."""
    words = argv.split()
    prefixes = (" ".join(words[:n]) for n in range(len(words), 0, -1))
    return next((prefix for prefix in prefixes if prefix in commands), "")


def test_the_parser_builds_without_torch() -> None:
    """Every command, a refused flag included, starts in about a second: torch (about 3 s to
    import) is imported only where a model runs."""
    code = "import sys; from dualpath.cli import build_parser; build_parser(); "
    code += "sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=TIMEOUT_S).returncode == 0


def test_a_benchmark_module_is_imported_only_for_its_own_subcommand() -> None:
    """Every other command (an engine process among them) starts without the benchmarks'
    imports: the HTTP client, the cluster, numpy."""
    code = (
        "import sys; from dualpath.cli import build_parser; parser = build_parser(); "
        "bench = lambda: sorted(m for m in sys.modules if m.startswith('dualpath.bench.')); "
        "assert bench() == [], bench(); "
        "parser.parse_args(['bench', 'store']); "
        "assert 'dualpath.bench.store_bench' in bench(), bench(); "
        "assert 'dualpath.bench.offline' not in bench(), bench()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    names = []
    for action in parser._actions:  # argparse has no public list of a parser's subcommands
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                names.append(f"{prefix}{name}")
                names += _subcommands(sub, f"{prefix}{name} ")
    return names


def test_a_run_that_cannot_calibrate_is_one_error_line(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A calibration run whose prefill engine's own prefix cache held the hits (vLLM's, given
    KV memory for every agent's context) gives no SNIC caps: one line naming --kv-cache-gb,
    exit 2, no traceback. NOTE: the calibration run's figures are canned (``run_mode``
    replaced): a real one starts a cluster of vLLM engines for minutes; the rest is the
    command as a user runs it."""
    import dualpath.bench.calibration as calibration

    held_the_hits = {
        "jct_s": 10.0, "pe_busy_fraction": 0.5, "prompt_tokens": 10_000, "cached_tokens": 8_000,
        "path_bytes": {"pe": 0, "de": 0}, "engine_cached_bytes": 16_384_000, "num_failed": 0,
    }  # fmt: skip
    monkeypatch.setattr(calibration, "run_mode", lambda *args, **kwargs: dict(held_the_hits))
    argv = "bench offline --preset paper-ratio --max-sessions 2 --modes basic,dualpath"
    with pytest.raises(SystemExit) as exit_info:
        main([*argv.split(), "--model", str(tiny_model_dir), "--kv-cache-gb", "0.5"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dualpath: error: "), lines
    assert "prefix cache held 100% of the hit KV" in lines[0]
    assert "less KV memory than their 0.5 GB (--kv-cache-gb)" in lines[0]

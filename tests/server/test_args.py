"""`dualpath serve` settings: flags, a YAML or JSON config file under them, and refusals."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dualpath.cli import build_parser
from dualpath.cli.serve_settings import resolve
from dualpath.vllm.args import engine_kind_args


def serve_settings(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", *argv])
    return resolve(args, args.serve_options)


def test_defaults_are_the_embedded_default() -> None:
    s = serve_settings()
    assert (s.host, s.port, s.nodes, s.threads) == ("127.0.0.1", 8000, "1P2D", 1)
    assert (s.model, s.kv_store, s.no_kv_store, s.api_key) == (None, None, False, None)
    assert s.max_waiting_requests >= 512
    assert (s.snic_gbps, s.cnic_gbps) == (0.0, 0.0)


def test_config_file_sets_values_and_flags_win(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9001\nkv-store: /data/kv\nmax_waiting_requests: 1024\nnodes: 2P4D\n")
    s = serve_settings("--config", str(config), "--port", "9002")
    assert s.port == 9002  # the flag wins
    assert s.kv_store == Path("/data/kv") and s.max_waiting_requests == 1024
    assert s.nodes == "2P4D"


def test_json_config_and_on_off_flags(tmp_path: Path) -> None:
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"no-kv-store": True, "external_engines": True}))
    s = serve_settings("--config", str(config))
    assert s.no_kv_store and s.external_engines
    # A store given on the command line beats the file's "no store".
    s = serve_settings("--config", str(config), "--kv-store", "/x")
    assert s.kv_store == Path("/x") and not s.no_kv_store


def test_vllm_arguments_from_a_config_section_under_the_flags(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "engine: vllm\nvllm-args:\n  max_num_seqs: 32\n  enable-chunked-prefill: false\n"
    )
    s = serve_settings("--config", str(config), "--vllm-arg", "max_num_seqs=16")
    assert engine_kind_args(s) == {  # the flag wins key by key
        "engine": "vllm",
        "vllm_args": {"max_num_seqs": 16, "enable_chunked_prefill": False},
        "vllm_prefill_batching": "vllm",
    }
    config.write_text("engine: vllm\nvllm-arg: [max_num_seqs=8]\n")
    assert engine_kind_args(serve_settings("--config", str(config)))["vllm_args"] == {
        "max_num_seqs": 8
    }
    config.write_text("engine: vllm\nvllm-args: {block_size: 32}\n")  # ours to set
    with pytest.raises(ValueError, match="block_size"):
        engine_kind_args(serve_settings("--config", str(config)))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prot: 9000\n", "unknown key 'prot'"),
        ("port: 70000\n", "port: must be in"),
        ("port: [1, 2]\n", "expected a single value"),
        ("max-waiting-requests: 0\n", "must be > 0"),
        ("mode: fastest\n", "expected one of"),
        ("no-kv-store: 1\n", "expected true or false"),
        ("- port\n", "expected a mapping"),
        ("config: other.yaml\n", "unknown key 'config'"),
        ("port: [\n", "not valid YAML"),
        ("vllm-args: 3\n", "vllm-args: expected a mapping of vLLM engine arguments"),
        ("vllm-arg: [max_num_seqs]\n", "vllm-arg: expected KEY=VALUE"),
    ],
)
def test_bad_config_files_are_refused_naming_file_and_key(
    tmp_path: Path, text: str, message: str
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match="serve.yaml") as info:
        serve_settings("--config", str(config))
    assert message in str(info.value)


def test_every_flag_is_documented_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    args = parser.parse_args(["serve"])
    for action in args.serve_options.actions.values():
        assert action.help, f"{action.option_strings} has no help"
        for option in action.option_strings:
            assert option in text


def test_prefill_rate_sets_the_schedulers_beta_and_must_be_positive() -> None:
    from dualpath.bench.harness import ModeRun, serve_args

    assert serve_settings("--prefill-tokens-per-s", "31000").prefill_tokens_per_s == 31000.0
    run = ModeRun("dualpath", Path("m"), "1P2D", 0.2, prefill_tokens_per_s=31153.86)
    args = serve_args(run, Path("kv"), Path("logs"))
    assert args[args.index("--prefill-tokens-per-s") + 1] == "31153.9"
    assert "--prefill-tokens-per-s" not in serve_args(
        ModeRun("dualpath", Path("m"), "1P2D", 0.2), Path("kv"), Path("logs")
    )
    with pytest.raises(SystemExit):
        serve_settings("--prefill-tokens-per-s", "0")


def test_a_benchmarks_engine_kind_reaches_its_servers_as_serve_reads_it() -> None:
    from dualpath.bench.harness import ModeRun, serve_args

    run = ModeRun(
        "basic",
        Path("m"),
        "1P1D",
        0.0,
        read_path="pe",
        engine="vllm",
        vllm_args=(("max_num_seqs", 16), ("enable_chunked_prefill", False)),
        vllm_prefill_batching="quota",
        attention_quota_s=0.01,
    )
    s = serve_settings(*serve_args(run, Path("kv"), Path("logs")))
    assert engine_kind_args(s) == {
        "engine": "vllm",
        "vllm_args": {"max_num_seqs": 16, "enable_chunked_prefill": False},
        "vllm_prefill_batching": "quota",
    }
    assert s.attention_quota_s == 0.01
    assert "--engine" not in serve_args(
        ModeRun("basic", Path("m"), "1P1D", 0.0), Path("kv"), Path("l")
    )

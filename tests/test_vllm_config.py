"""``dualpath vllm-config``: the ``--kv-transfer-config`` of a vLLM server that is one engine of
a cluster, and the engine configuration the server's connector makes of it (no vLLM here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath.protocol import DECODE
from dualpath.vllm.args import SERVED_CONNECTOR, served_engine_config
from tests.test_cli import run_cli

FLAGS = (
    "vllm-config", "--role", "decode", "--engine-id", "2", "--node-id", "2",
    "--scheduler", "tcp://10.0.0.1:5557", "--url", "http://10.0.0.3:8000/",
)  # fmt: skip


def _printed(capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    code, out, err = run_cli(capsys, *FLAGS, *flags)
    assert code == 0, err
    assert out.count("\n") == 1  # one line: what `--kv-transfer-config "$(...)"` takes
    return json.loads(out)


def test_it_names_our_connector_and_carries_the_engine(capsys, tmp_path: Path) -> None:
    printed = _printed(capsys, "--kv-store", str(tmp_path), "--snic-gbps", "2", "--mode", "basic")
    assert (printed["kv_connector"], printed["kv_connector_module_path"]) == SERVED_CONNECTOR
    assert printed["kv_role"] == "kv_both"
    config = printed["kv_connector_extra_config"]["dualpath"]
    assert "model_dir" not in config  # vLLM's --model
    # No --block-size: the server takes its model's when it starts.
    assert config["engine"] == {"dtype": "float32", "engine": "vllm"}
    assert "block_size_tokens" not in config["scheduler"]
    assert config["url"] == "http://10.0.0.3:8000"
    assert config["store"]["root_dir"] == str(tmp_path)
    assert config["cluster"]["traffic"]["snic_bandwidth_gbps"] == 2.0


def test_the_connector_takes_the_model_and_context_from_vllm(capsys, tiny_model_dir) -> None:
    extra = _printed(capsys)["kv_connector_extra_config"]
    model = str(tiny_model_dir)
    config = served_engine_config(extra, model=model, dtype="float32", max_model_len=4160)
    assert (config.role, config.engine_id, config.node_id) == (DECODE, 2, 2)
    assert config.model_dir == tiny_model_dir
    assert (config.engine.engine, config.engine.max_model_len) == ("vllm", 4160)
    assert config.scheduler_endpoint == "tcp://10.0.0.1:5557"


def test_a_vllm_dtype_other_than_the_stores_is_refused_naming_the_flag(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    extra = _printed(capsys, "--block-size", "64")["kv_connector_extra_config"]
    with pytest.raises(ValueError, match="pass --dtype float32 to vLLM"):
        served_engine_config(extra, model=str(tmp_path), dtype="bfloat16", max_model_len=4160)


def test_what_vllm_decides_is_refused_by_name(capsys, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    extra = _printed(capsys, "--block-size", "64")["kv_connector_extra_config"]
    extra["dualpath"]["engine"]["num_threads"] = 4
    with pytest.raises(ValueError, match="num_threads"):
        served_engine_config(extra, model=str(tmp_path), dtype="float32", max_model_len=4160)
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        served_engine_config(
            _printed(capsys)["kv_connector_extra_config"],
            model="HuggingFaceTB/SmolLM2-135M",
            dtype="float32",
            max_model_len=4160,
        )


def test_without_block_size_the_server_takes_its_models(
    capsys, tiny_model_dir: Path, tiny_deepseek_v3_dir: Path
) -> None:
    """64 for a dense model, 16 for an MLA one (vLLM's CPU_MLA pages); a given size is kept."""
    extra = _printed(capsys)["kv_connector_extra_config"]
    for model_dir, block_size in ((tiny_model_dir, 64), (tiny_deepseek_v3_dir, 16)):
        config = served_engine_config(
            extra, model=str(model_dir), dtype="float32", max_model_len=4160
        )
        assert config.engine.block_size_tokens == block_size
        assert config.scheduler.block_size_tokens == block_size
    extra = _printed(capsys, "--block-size", "32")["kv_connector_extra_config"]
    config = served_engine_config(
        extra, model=str(tiny_deepseek_v3_dir), dtype="float32", max_model_len=4160
    )
    assert config.engine.block_size_tokens == 32  # refused where the engine is checked


@pytest.mark.parametrize(
    ("flag", "value"), [("--url", "10.0.0.3:8000"), ("--scheduler", "http://x:1")]
)
def test_a_bad_address_is_a_usage_error(capsys, flag: str, value: str) -> None:
    flags = list(FLAGS)
    flags[flags.index(flag) + 1] = value
    code, _, err = run_cli(capsys, *flags)
    assert code == 2 and "expected" in err, err


def test_serve_and_engine_resolve_the_block_size_where_the_configs_are_built(
    tiny_model_dir: Path, tiny_deepseek_v3_dir: Path
) -> None:
    """No --block-size: 64 on our engine and on vLLM for a dense model, 16 for MLA on vLLM's
    CPU build; an explicit other size there is still refused by name."""
    from dualpath.cli.configs import resolve_block_size
    from dualpath.config import ClusterConfig, EngineConfig
    from dualpath.model.registry import read_config
    from dualpath.vllm.args import check_engine_kind

    assert resolve_block_size(None, "native", tiny_deepseek_v3_dir) == 64
    assert resolve_block_size(None, "vllm", tiny_model_dir) == 64
    assert resolve_block_size(None, "vllm", tiny_deepseek_v3_dir) == 16
    assert resolve_block_size(32, "vllm", tiny_deepseek_v3_dir) == 32
    mla = read_config(tiny_deepseek_v3_dir / "config.json")
    check_engine_kind(ClusterConfig(), EngineConfig(engine="vllm", block_size_tokens=16), mla)
    with pytest.raises(ValueError, match="--block-size 64 is refused"):
        check_engine_kind(ClusterConfig(), EngineConfig(engine="vllm"), mla)

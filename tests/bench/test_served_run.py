"""A mode's run on DualPath inside vLLM servers (``bench offline --vllm-servers``,
``served_run.py``): every ``ModeRun`` field reaches the front door, ``dualpath vllm-config`` and
the vLLM servers as they read it, and what the servers cannot take is refused by name before
anything starts. Nothing is started here (no vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from dualpath.bench.harness import ModeRun, serve_args
from dualpath.bench.offline import main as offline_main
from dualpath.bench.offline import run_preset, run_spec
from dualpath.bench.process_cpu import ProcessCpu
from dualpath.bench.spec import EngineSpec
from dualpath.cli import build_parser
from dualpath.cli.serve_settings import resolve
from dualpath.vllm.bench.served_cluster import ServedCluster, ServedShape
from dualpath.vllm.bench.served_run import served_shape
from tests.test_cli import run_cli

TINY_FULL_BLOCK_BYTES = 64 * 2048  # 64 tokens x 4 layers x (64 + 64) float32 values
TINY_CONTEXT_TOKENS = 16_384


def _run(model_dir: Path, **fields) -> ModeRun:
    return ModeRun(
        mode="dualpath",
        model_dir=model_dir,
        nodes="1P2D",
        snic_bandwidth_gbps=0.75,
        cnic_bandwidth_gbps=3.0,
        read_path="de",
        transport="shm",
        prefill_tokens_per_s=31153.86,
        max_prompt_tokens=9000,
        engine="vllm-servers",
        kv_cache_gb=0.2,
        attention_quota_s=0.3,
        **fields,
    )


def test_a_mode_run_becomes_the_deployment_serve_engine_vllm_would_be(
    tiny_model_dir: Path,
) -> None:
    assert served_shape(_run(tiny_model_dir)) == ServedShape(
        nodes="1P2D",
        mode="dualpath",
        read_path="de",
        block_size=64,
        dtype="float32",  # the checkpoint's, as serve's
        max_model_len=TINY_CONTEXT_TOKENS,
        kv_cache_gib=1,
        num_gpu_blocks=200_000_000 // TINY_FULL_BLOCK_BYTES,  # 0.2 GB of Full Blocks: 1525
        snic_gbps=0.75,
        cnic_gbps=3.0,
        transport="shm",
        serve_args=(
            "--max-waiting-requests", "100000", "--prefill-tokens-per-s", "31153.9",
            "--max-prompt-tokens", "9000", "--attention-quota-s", "0.3",
        ),
    )  # fmt: skip
    # No --kv-cache-gb: serve's 1 GB, which its vLLM engines get as blocks too.
    default = served_shape(ModeRun("basic", tiny_model_dir, "1P1D", 0.0, engine="vllm-servers"))
    assert (default.num_gpu_blocks, default.kv_cache_gib) == (10**9 // TINY_FULL_BLOCK_BYTES, 1)
    assert default.serve_args == ("--max-waiting-requests", "100000")


def test_the_front_door_reads_every_setting_of_the_run(tiny_model_dir: Path, tmp_path) -> None:
    cluster = ServedCluster(tiny_model_dir, tmp_path, served_shape(_run(tiny_model_dir)))
    args = build_parser().parse_args(["serve", *cluster.front_door_args()])
    s = resolve(args, args.serve_options)
    assert (s.external_engines, s.engine, s.scheduler_endpoint) == (
        True,
        "vllm",
        cluster.scheduler,
    )
    assert (s.nodes, s.mode, s.read_path, s.transport) == ("1P2D", "dualpath", "de", "shm")
    assert (s.snic_gbps, s.cnic_gbps) == (0.75, 3.0)
    assert (s.max_model_len, s.dtype, s.block_size) == (TINY_CONTEXT_TOKENS, "float32", 64)
    assert (s.prefill_tokens_per_s, s.max_prompt_tokens, s.attention_quota_s) == (
        31153.9,
        9000,
        0.3,
    )
    assert s.max_waiting_requests == 100_000
    assert s.kv_store == tmp_path / "kv"


def test_each_vllm_config_and_vllm_server_get_their_engines_settings(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    cluster = ServedCluster(tiny_model_dir, tmp_path, served_shape(_run(tiny_model_dir)))
    decode = cluster.engines[2]
    argv = decode.vllm_config_argv(8123)
    assert argv[:4] == [sys.executable, "-m", "dualpath.cli", "vllm-config"]
    code, out, err = run_cli(capsys, *argv[3:])
    assert code == 0, err
    config = json.loads(out)["kv_connector_extra_config"]["dualpath"]
    assert (config["role"], config["engine_id"], config["node_id"]) == ("decode", 2, 2)
    assert (config["cluster"]["mode"], config["transport"]) == ("dualpath", "shm")
    assert config["cluster"]["traffic"]["snic_bandwidth_gbps"] == 0.75
    assert config["cluster"]["traffic"]["cnic_bandwidth_gbps"] == 3.0
    assert config["engine"] == {"block_size_tokens": 64, "dtype": "float32", "engine": "vllm"}
    assert config["store"]["root_dir"] == str(tmp_path / "kv")
    assert config["url"] == "http://127.0.0.1:8123"
    server = decode.server_argv(8123)
    assert server[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    after = {flag: server[i + 1] for i, flag in enumerate(server[:-1]) if flag.startswith("--")}
    assert after["--num-gpu-blocks-override"] == str(200_000_000 // TINY_FULL_BLOCK_BYTES)
    assert after["--max-model-len"] == str(TINY_CONTEXT_TOKENS)
    assert (after["--dtype"], after["--block-size"]) == ("float32", "64")
    assert decode.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def _spec(tiny_model_dir: Path, flags: str):
    args = build_parser().parse_args(f"bench offline --vllm-servers {flags}".split())
    return run_spec(args, tiny_model_dir)


def test_the_flag_names_the_engine_and_keeps_the_other_engine_flags(tiny_model_dir) -> None:
    spec = _spec(tiny_model_dir, "--kv-cache-gb 0.2 --transport shm --read-path pe")
    assert spec.engine == EngineSpec(
        engine="vllm-servers", kv_cache_gb=0.2, transport="shm", read_path="pe"
    )


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        ("--vllm-arg max_num_seqs=4", r"--vllm-servers: --vllm-arg \(max_num_seqs\)"),
        ("--vllm-prefill-batching quota", "--vllm-servers: --vllm-prefill-batching quota"),
    ],
)
def test_what_the_vllm_servers_cannot_take_is_refused_before_anything_starts(
    tiny_model_dir: Path, flags: str, refusal: str
) -> None:
    spec = _spec(tiny_model_dir, flags)
    with pytest.raises(ValueError, match=refusal):
        run_preset(spec)
    # The same refusal for any caller of the mapping.
    run = ModeRun(
        "basic",
        tiny_model_dir,
        "1P2D",
        0.0,
        engine="vllm-servers",
        vllm_args=spec.engine.vllm_args,
        vllm_prefill_batching=spec.engine.vllm_prefill_batching,
    )
    with pytest.raises(ValueError, match=refusal):
        served_shape(run)


def test_url_and_the_vllm_servers_exclude_each_other(tiny_model_dir: Path) -> None:
    args = build_parser().parse_args(
        ["bench", "offline", "--vllm-servers", "--url", "http://x", "--model", str(tiny_model_dir)]
    )
    with pytest.raises(ValueError, match="do not give --engine, --vllm-servers"):
        offline_main(args)


def test_serve_args_are_not_the_vllm_servers() -> None:
    with pytest.raises(RuntimeError, match="caller bug"):
        serve_args(ModeRun("basic", Path("m"), "1P2D", 0.0, engine="vllm-servers"), Path(), Path())


def test_named_process_trees_label_their_roots_and_what_runs_below() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        cpu = ProcessCpu({"front door": os.getpid()}).start()
        cores = cpu.stop()["cores"]
        child_name = psutil.Process(child.pid).name()
    finally:
        child.kill()
        child.wait()
    assert {"front door", f"front door/{child_name}"} <= set(cores)

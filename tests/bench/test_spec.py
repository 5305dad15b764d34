"""A benchmark's command line becomes one run specification (``bench/spec.py``), every flag
in its field: a flag that does not arrive would silently run with the default."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from dualpath.bench.offline import run_spec
from dualpath.bench.online import online_spec
from dualpath.bench.spec import EngineSpec, OnlineSpec, OutputSpec, RunSpec, WorkloadSpec
from dualpath.cli import build_parser

WORKLOAD_FLAGS = (
    "--preset paper-ratio --seed 3 --max-sessions 5 --length-scale 0.2 --max-turns 4 "
    "--gen-scale 0.5 --max-prompt-tokens 9000 --transport shm --read-path de --engine vllm "
    "--vllm-arg max_num_seqs=4 --vllm-prefill-batching quota --kv-cache-gb 0.2 "
    "--attention-quota-s 0.3 --json /tmp/x.json"
)
ENGINE = EngineSpec(
    engine="vllm",
    vllm_args=(("max_num_seqs", 4),),
    kv_cache_gb=0.2,
    vllm_prefill_batching="quota",
    attention_quota_s=0.3,
    transport="shm",
    read_path="de",
    max_prompt_tokens=9000,
)
WORKLOAD = WorkloadSpec(
    preset="paper-ratio", seed=3, max_sessions=5, length_scale=0.2, max_turns=4, gen_scale=0.5
)


def _args(argv: str):
    return build_parser().parse_args(argv.split())


def test_bench_offline_flags_arrive_in_the_run_spec() -> None:
    args = _args(f"bench offline {WORKLOAD_FLAGS} --modes basic,dualpath --clones 2")
    assert run_spec(args, Path("m")) == RunSpec(
        model_dir=Path("m"),
        workload=replace(WORKLOAD, clones=2),
        modes=("basic", "dualpath"),
        engine=ENGINE,
        output=OutputSpec(json_path=Path("/tmp/x.json")),
    )


def test_bench_online_flags_arrive_in_the_online_spec() -> None:
    args = _args(
        f"bench online {WORKLOAD_FLAGS} --aps 0.5 --find-capacity --min-agents 8 "
        "--slo-basis basic --replay-gaps 2 --max-gap-s 9 --slo-ttft-s 1 --slo-tpot-s 0.1"
    )
    assert online_spec(args, Path("m")) == OnlineSpec(
        run=RunSpec(
            model_dir=Path("m"),
            workload=WORKLOAD,
            modes=("basic", "dualpath"),  # online's default
            engine=ENGINE,
            output=OutputSpec(json_path=Path("/tmp/x.json")),
        ),
        aps=0.5,
        find_capacity=True,
        slo_ttft_s=1.0,
        slo_tpot_s=0.1,
        slo_basis="basic",
        min_agents=8,
        replay_gaps=2.0,
        max_gap_s=9.0,
    )


def test_an_online_spec_refuses_a_gap_cap_without_gaps() -> None:
    with pytest.raises(ValueError, match="--max-gap-s must be >= 0 and goes with --replay-gaps"):
        OnlineSpec(RunSpec(Path("m")), max_gap_s=5.0)

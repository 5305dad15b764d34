"""``bench vs-vllm --regime``: the memory rule on a workload, and the targets' judgement."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath.bench.presets import PRESETS, shaped_workload, workload_shape
from dualpath.bench.regimes import (
    REGIMES,
    RUNNING_REQUESTS,
    best_of_ours,
    cpu_seconds,
    regime_memory,
    regime_targets,
)
from dualpath.workload import Session, Turn, Workload

BLOCK = 64
BLOCK_BYTES = 1000


def _session(name: str, appends: list[int], output: int) -> Session:
    turns = [Turn(np.arange(n) + 1, output) for n in appends]
    return Session(name, 0.0, tuple(turns))


def test_the_memory_rule_counts_final_contexts_and_the_longest_request_in_whole_blocks() -> None:
    # Session a: prompts 100, then 100 + 10 + 50 = 160; its final context 170 -> 3 blocks.
    # Session b: one turn of 600 + 10 = 610 -> 10 blocks, also the longest request.
    workload = Workload((_session("a", [100, 50], 10), _session("b", [600], 10)), "test")
    small = regime_memory(
        REGIMES["small"], workload, full_block_bytes=BLOCK_BYTES, block_size_tokens=BLOCK
    )
    assert small.contexts_kv_bytes == 13 * BLOCK_BYTES
    assert small.running_kv_bytes == RUNNING_REQUESTS * 10 * BLOCK_BYTES
    # 1.5 x the contexts' 13 blocks is under the running batch's 40: the batch's, so that an
    # engine's share holds the longest request.
    assert small.total_kv_bytes == small.running_kv_bytes
    assert small.per_engine_bytes(3) == small.total_kv_bytes // 3
    assert small.max_model_len_tokens == 11 * BLOCK  # the longest request and one block
    # Half the contexts' 13 blocks is under four of the longest request's 10: not this regime.
    with pytest.raises(ValueError, match="not between the running requests' need"):
        regime_memory(
            REGIMES["beyond-memory"],
            workload,
            full_block_bytes=BLOCK_BYTES,
            block_size_tokens=BLOCK,
        )


def test_the_small_regime_gives_one_and_a_half_times_the_contexts_need() -> None:
    workload = Workload(tuple(_session(f"s{i}", [100, 50], 10) for i in range(20)), "test")
    memory = regime_memory(
        REGIMES["small"], workload, full_block_bytes=BLOCK_BYTES, block_size_tokens=BLOCK
    )
    assert memory.contexts_kv_bytes == 20 * 3 * BLOCK_BYTES
    assert memory.total_kv_bytes == int(1.5 * memory.contexts_kv_bytes)  # above the batch's


def test_the_beyond_memory_sessions_need_more_than_the_memory_and_fit_the_running_batch() -> None:
    regime = REGIMES["beyond-memory"]
    shape = workload_shape(
        PRESETS["agentic"],
        max_sessions=regime.max_sessions,
        max_turns=regime.max_turns,
        length_scale=regime.length_scale,
        clones=0,
    )
    workload = shaped_workload(shape, seed=0, vocab_size=49152)
    memory = regime_memory(
        regime, workload, full_block_bytes=46080 * BLOCK, block_size_tokens=BLOCK
    )
    assert memory.running_kv_bytes <= memory.total_kv_bytes < memory.contexts_kv_bytes
    assert memory.total_kv_bytes == int(memory.contexts_kv_bytes / 2)


def _result(jct_s: float, ttft_p50_s: float, hit_ratio: float = 0.8) -> dict:
    return {
        "jct_s": jct_s,
        "ttft_s": {"p50": ttft_p50_s},
        "hit_ratio": hit_ratio,
        "token_mismatches": 0,
    }


def test_the_regime_targets_judge_ours_best_system_against_vllm_alone() -> None:
    results = {
        "vllm-single": _result(100.0, 1.0, hit_ratio=0.1),
        "dualpath-1P1D": _result(50.0, 3.0, hit_ratio=0.79),
        "dualpath-1P2D": _result(40.0, 2.5, hit_ratio=0.78),
    }
    assert best_of_ours(results) == "dualpath-1P2D"
    ratios, targets = regime_targets("beyond-memory", results, ideal_hit_ratio=0.80)
    assert ratios["dualpath-1P2D_vs_vllm-single_jct"] == 2.5
    assert ratios["dualpath-1P1D_over_vllm-single_ttft_p50"] == 3.0
    assert targets == {
        "same_tokens_on_every_system": True,
        "best_2.2x_faster_than_vllm-single": True,
        "best_hits_within_2_points_of_bound": True,  # 0.78 of 0.80
    }
    _, targets = regime_targets("beyond-memory", results, ideal_hit_ratio=0.81)
    assert targets["best_hits_within_2_points_of_bound"] is False  # 3 points below
    _, targets = regime_targets("small", results, ideal_hit_ratio=0.8)
    # 0.4x vLLM alone's JCT passes; 2.5x its TTFT p50 does not.
    assert targets == {
        "same_tokens_on_every_system": True,
        "best_within_1.05x_vllm-single_jct": True,
        "best_ttft_p50_within_2x_vllm-single": False,
    }
    results["dualpath-1P1D"]["token_mismatches"] = 1  # one turn parted from vLLM alone's
    _, targets = regime_targets("beyond-memory", results, ideal_hit_ratio=0.80)
    assert targets["same_tokens_on_every_system"] is False


def test_cpu_seconds_are_each_processes_cores_over_the_wall_time() -> None:
    cpu = {"cores": {"serve": 0.5, "engine-0": 1.25}, "client_cores": 0.1, "wall_s": 10.0}
    assert cpu_seconds(cpu) == {"serve": 5.0, "engine-0": 12.5, "client": 1.0}
    assert cpu_seconds(None) is None


def test_a_regime_run_plots_each_systems_first_token_latency_and_hits(tmp_path) -> None:
    from dualpath.bench.report import write_plots

    modes = {
        name: {**_result(jct, ttft), "ttft_s": {"p50": ttft, "p90": 2 * ttft}}
        for name, jct, ttft in (("vllm-single", 100.0, 4.0), ("dualpath-1P2D", 40.0, 1.0))
    }
    report = {
        "benchmark": "vs-vllm",
        "regime": "beyond-memory",
        "workload": {"ideal_hit_ratio": 0.8},
        "modes": modes,
    }
    written = write_plots(report, tmp_path, "vs_vllm_beyond-memory")
    assert [p.name for p in written] == [
        "vs_vllm_beyond-memory_jct.png",
        "vs_vllm_beyond-memory_latency.png",
    ]
    assert all(p.stat().st_size > 0 for p in written)

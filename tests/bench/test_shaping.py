"""Traces shaped like presets, the workload check before any server starts, the packaged
``agentic`` preset, and the online replay of a trace's gaps between turns."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest

from dualpath.bench.agents import run_agents
from dualpath.bench.offline import load_workload
from dualpath.bench.presets import PRESETS, shaped_workload, workload_shape
from dualpath.workload import Session, Turn, first_misfit, workload_stats
from tests.bench.fake_server import fake_completions_server

TRACE = Path(__file__).parents[1] / "workload" / "data" / "agentic_head.jsonl"
TINY_CONTEXT_TOKENS = 16_384  # the tiny preset's max_position_embeddings


def test_a_trace_takes_the_presets_shaping_unless_overridden() -> None:
    preset = PRESETS["paper-ratio"]
    shape = workload_shape(preset, trace=TRACE)
    assert (shape.trace, shape.trajectory_preset, shape.turn_scale) == (str(TRACE), None, None)
    assert (shape.length_scale, shape.max_turns, shape.gen_scale) == (0.1, 16, 0.2)
    assert (shape.num_sessions, shape.clones) == (preset.num_agents, 0)
    given = workload_shape(
        preset, trace=TRACE, length_scale=0.05, max_turns=3, gen_scale=0.5, clones=2
    )
    assert (given.length_scale, given.max_turns, given.gen_scale, given.clones) == (
        0.05,
        3,
        0.5,
        2,
    )
    workload = shaped_workload(given, seed=0, vocab_size=1000)
    originals, clones = workload.sessions[:2], workload.sessions[2:]
    assert [s.session_id for s in originals] == ["trace_0008", "trace_0182"]
    assert len(clones) == 4 and all(s.num_turns == 4 for s in clones)
    assert all(s.num_turns == 3 and s.arrival_s == 0 for s in originals)
    unscaled = shaped_workload(
        workload_shape(preset, trace=TRACE, gen_scale=1.0, length_scale=0.05),
        seed=0,
        vocab_size=1000,
    )
    for shaped, full in zip(originals, unscaled.sessions, strict=False):
        assert [t.output_tokens for t in shaped.turns] == [
            max(1, round(t.output_tokens * 0.5)) for t in full.turns[:3]
        ]


def test_online_agents_are_the_trace_sessions_then_clones() -> None:
    shape = workload_shape(PRESETS["paper-ratio"], trace=TRACE)
    one = shaped_workload(shape, seed=0, vocab_size=1000, num_agents=1)
    five = shaped_workload(shape, seed=0, vocab_size=1000, num_agents=5)
    assert [s.session_id for s in one.sessions] == ["trace_0008"]
    assert [s.session_id for s in five.sessions] == [
        "trace_0008",
        "trace_0182",
        "trace_0008+clone0",
        "trace_0182+clone0",
        "trace_0008+clone1",
    ]


def test_a_prompt_that_cannot_fit_is_refused_naming_session_turn_and_flag(
    tiny_model_dir: Path,
) -> None:
    too_long = workload_shape(PRESETS["paper-ratio"], trace=TRACE, length_scale=1.0)
    with pytest.raises(ValueError) as refused:
        load_workload(too_long, model_dir=tiny_model_dir, seed=0)
    message = str(refused.value)
    assert "session trace_0008 turn 0 has a 17,670-token prompt" in message
    assert "no server was started" in message
    scale = float(re.search(r"--length-scale ([0-9.]+)", message).group(1))
    assert 0.1 < scale < 0.3
    fitted = load_workload(
        workload_shape(PRESETS["paper-ratio"], trace=TRACE, length_scale=scale),
        model_dir=tiny_model_dir,
        seed=0,
    )
    assert first_misfit(fitted, max_model_len=TINY_CONTEXT_TOKENS) is None
    # --max-prompt-tokens is checked too, and named.
    with pytest.raises(ValueError, match=r"session trace_0008 turn \d+ .* 1,000-token prompt"):
        load_workload(
            workload_shape(PRESETS["paper-ratio"], trace=TRACE),
            model_dir=tiny_model_dir,
            seed=0,
            max_prompt_tokens=1000,
        )


def test_the_agentic_preset_replays_packaged_real_sessions() -> None:
    preset = PRESETS["agentic"]
    shape = workload_shape(preset)
    assert shape.trace.endswith("dualpath/workload/data/agentic_coding_dev.jsonl")
    assert (preset.nodes, preset.rho, preset.snic_bandwidth_gbps) == ("1P2D", 2.0, None)
    workload = shaped_workload(shape, seed=0, vocab_size=1000)
    assert workload.num_sessions == preset.num_agents * (1 + preset.clones)
    assert max(s.num_turns for s in workload.sessions) == preset.max_turns + 1  # clones
    assert first_misfit(workload, max_model_len=TINY_CONTEXT_TOKENS) is None
    stats = workload_stats(workload, block_size_tokens=64)
    assert 0.85 < stats.ideal_hit_ratio < 0.95  # real sessions' reuse, at 64-token blocks


class StepClock:
    """Agent time that moves only when an agent sleeps: a sleep of d moves it by d at once."""

    def __init__(self) -> None:
        self.time_s = 0.0

    def now_s(self) -> float:
        return self.time_s

    async def sleep(self, seconds: float) -> None:
        self.time_s += seconds
        await asyncio.sleep(0)  # still a turn of the event loop, as a real sleep is


def test_online_agents_can_keep_the_traces_gaps_between_turns() -> None:
    session = Session(
        "s", 0.0, (Turn(np.arange(8), 2), Turn(np.arange(3), 2, gap_s=10.0), Turn([9], 1))
    )

    def sent_s(**gaps) -> list[float]:
        # Time moves only when an agent waits, so each turn's send time is exact.
        records = asyncio.run(run_agents(server.url, "m", [session], clock=StepClock(), **gaps))
        assert [r.error for r in records] == [None] * 3
        return [r.arrival_s for r in records]

    with fake_completions_server(max_prompt_tokens=100) as server:
        # 0.1 x the trace's 10 s after turn 0 was sent; turn 2 has no gap: as soon as 1 ends.
        assert sent_s(gap_scale=0.1) == [0.0, 1.0, 1.0]
        assert sent_s() == [0.0, 0.0, 0.0]  # without gap_scale, back to back
        assert sent_s(gap_scale=1, max_gap_s=1) == [0.0, 1.0, 1.0]  # 10 s, capped at 1 s
        # A pause after each answer (the agent's tools), alone and beside the trace's gaps.
        assert sent_s(pause_s=2.0) == [0.0, 2.0, 4.0]
        assert sent_s(gap_scale=0.1, pause_s=0.5) == [0.0, 1.0, 1.5]
    assert len(server.requests) == 15  # each turn reached the server


def test_the_servers_get_the_prompt_limit_the_workload_was_checked_against() -> None:
    from dualpath.bench.harness import ModeRun, serve_args
    from dualpath.cli import build_parser

    args = serve_args(
        ModeRun("dualpath", Path("m"), "1P2D", 0.2, max_prompt_tokens=8000), Path("kv"), Path("l")
    )
    assert args[args.index("--max-prompt-tokens") + 1] == "8000"
    assert build_parser().parse_args(["serve", *args]).command == "serve"

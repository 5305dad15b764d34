"""`dualpath bench online`: the capacity search, the SLO rule, and one real run."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.bench.agents import TurnRecord
from dualpath.bench.online import (
    MAX_PROBES,
    capacity_of,
    capacity_ratios,
    is_attained,
    next_probe,
    run_online,
    second_half_p90,
)
from dualpath.bench.spec import OnlineSpec, OutputSpec, RunSpec, WorkloadSpec


def _search(capacity_aps: float, start_aps: float) -> list[tuple[float, bool]]:
    probes: list[tuple[float, bool]] = []
    rate = start_aps
    while rate is not None:
        probes.append((rate, rate <= capacity_aps))
        rate = next_probe(probes)
    return probes


def test_capacity_search_brackets_then_bisects_within_six_probes() -> None:
    probes = _search(capacity_aps=3.0, start_aps=1.0)
    assert [aps for aps, _ in probes] == [1.0, 2.0, 4.0, 3.0, 3.5, 3.25]
    assert len(probes) == MAX_PROBES
    assert capacity_of(probes) == 3.0
    # Starting above the capacity halves first.
    down = _search(capacity_aps=0.3, start_aps=1.0)
    assert [aps for aps, _ in down][:3] == [1.0, 0.5, 0.25]
    assert capacity_of(down) is not None and 0.25 <= capacity_of(down) <= 0.3
    # Stops as soon as the bracket is within 5%.
    assert next_probe([(1.0, True), (1.04, False)]) is None
    assert capacity_of([(1.0, False), (0.5, False)]) is None


def test_capacity_ratio_is_a_lower_bound_when_basic_never_attains() -> None:
    both = {
        "basic": {"capacity_aps": 0.5, "capacity_below_aps": None},
        "dualpath": {"capacity_aps": 1.5, "capacity_below_aps": None},
    }
    assert capacity_ratios(both) == {"dualpath_vs_basic_capacity": pytest.approx(3.0)}
    basic_none = {
        "basic": {"capacity_aps": None, "capacity_below_aps": 0.25},
        "dualpath": {"capacity_aps": 1.0, "capacity_below_aps": None},
        "oracle": {"capacity_aps": None, "capacity_below_aps": 0.5},
    }
    assert capacity_ratios(basic_none) == {
        "dualpath_vs_basic_capacity_at_least": pytest.approx(4.0)
    }
    assert capacity_ratios({"dualpath": {"capacity_aps": 1.0}}) == {}


def _turn(arrival, first, finish, out=4, error=None) -> TurnRecord:
    return TurnRecord(0, 0, arrival, first, first + 0.01, finish, 100, 0, out, error)


def test_slo_is_judged_on_the_second_half_of_the_arrival_window() -> None:
    # Agents arrive over 8 s. The ramp-up (TTFT 5 s, sent at 0) and the drain after the last
    # arrival (TTFT 0.01 s, sent at 9 and 10 s) do not count; the steady half's p90 TTFT is 0.2 s.
    records = (
        [_turn(0.0, 5.0, 6.0)]
        + [_turn(t, t + 0.2, t + 0.5) for t in (4.0, 6.0, 7.0, 8.0)]
        + [_turn(t, t + 0.01, t + 0.5) for t in (9.0, 10.0) * 5]
    )
    p90_ttft_s, p90_tpot_s = second_half_p90(records, arrival_window_s=8.0)
    assert p90_ttft_s == pytest.approx(0.2)
    assert p90_tpot_s == pytest.approx(0.1)
    assert second_half_p90(records, arrival_window_s=20.0)[0] < 0.2  # the drain, if judged
    result = {"num_failed": 0, "second_half_p90_ttft_s": 0.2, "second_half_p90_tpot_s": 0.1}
    assert is_attained(result, {"ttft_s": 0.25, "tpot_s": 0.2})
    assert not is_attained(result, {"ttft_s": 0.15, "tpot_s": 0.2})
    assert not is_attained(result, {"ttft_s": 0.25, "tpot_s": 0.05})
    assert not is_attained(result | {"num_failed": 1}, {"ttft_s": 1.0, "tpot_s": 1.0})


@pytest.mark.slow
def test_an_online_run_reports_slo_attainment(tiny_model_dir: Path) -> None:
    pytest.importorskip("nixl_cu12")
    run = RunSpec(
        model_dir=tiny_model_dir,
        workload=WorkloadSpec(preset="ci", max_sessions=4),
        modes=("dualpath",),
        output=OutputSpec(progress=False),
    )
    report = run_online(OnlineSpec(run, aps=2.0))
    result = report["modes"]["dualpath"]
    assert report["slo"]["ttft_s"] > 0 and report["slo"]["tpot_s"] > 0
    assert result["num_failed"] == 0 and result["probes"][0]["aps"] == 2.0
    assert isinstance(result["slo_attained"], bool)


def test_agents_stop_when_told_and_keep_what_finished() -> None:
    import asyncio

    from dualpath.bench.agents import run_agents
    from dualpath.workload import PRESETS, generate_trajectories

    sessions = generate_trajectories(
        PRESETS["64k"], 2, seed=0, vocab_size=512, length_scale=0.01, turn_scale=0.05
    ).sessions

    async def main() -> list:
        async def never_answer(reader, writer) -> None:  # a server that hangs every request
            await reader.read(1 << 16)
            await asyncio.Event().wait()

        server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            # No answer and an hour's request timeout: stop_after_s is the only way out. The
            # guard (60 s) ends a run that ignores it instead of hanging the suite.
            agents = run_agents(
                f"http://127.0.0.1:{port}", "m", sessions, stop_after_s=0.5, timeout_s=3600
            )
            return await asyncio.wait_for(agents, 60)

    assert asyncio.run(main()) == []

"""Online capacity: the probe's SLO figures and the capacity search (constant cost model)."""

from __future__ import annotations

import math

import pytest

from dualpath.sim import online
from dualpath.sim.online import OnlineProbe, capacity_aps, next_aps
from dualpath.sim.runner import build_simulator
from tests.sim.test_simulator import small_spec


def _probe(aps: float, is_attained: bool) -> OnlineProbe:
    ttft_s = 1.0 if is_attained else 10.0
    return OnlineProbe(aps, 10, 100, ttft_s, 0.01, 0, 0.0)


def test_the_search_doubles_until_a_failure_then_bisects_to_five_percent():
    capacity = 0.33  # a hidden threshold the probes reveal
    probes: list[OnlineProbe] = []
    while (aps := next_aps(probes, start_aps=0.1)) is not None:
        probes.append(_probe(aps, aps <= capacity))
    assert [round(p.aps, 4) for p in probes] == [0.1, 0.2, 0.4, 0.3, 0.35, 0.325]
    assert capacity_aps(probes) == pytest.approx(0.325)
    assert len(probes) <= online.MAX_PROBES


def test_the_search_stops_once_the_bracket_is_within_tolerance():
    probes = [_probe(1.0, True), _probe(1.04, False)]
    assert next_aps(probes, start_aps=1.0) is None  # (1.04 - 1.0) / 1.04 < 5%
    assert capacity_aps(probes) == 1.0


def test_a_pass_above_a_failure_does_not_count_and_nothing_passing_gives_zero():
    probes = [_probe(1.0, True), _probe(2.0, False), _probe(3.0, True)]
    assert capacity_aps(probes) == 1.0
    assert capacity_aps([_probe(1.0, False)]) == 0.0
    assert next_aps([_probe(1.0, False)], start_aps=1.0) == 0.5


def test_a_light_load_holds_the_slo_and_an_overload_does_not():
    light = online.run_probe(small_spec(), aps=0.02, window_s=400.0)
    assert light.is_attained, light
    assert light.num_requests > 0
    heavy = online.run_probe(small_spec(), aps=4.0, window_s=20.0)
    assert not heavy.is_attained, heavy
    assert heavy.p90_ttft_s > online.SLO_TTFT_S


def test_a_stopped_run_keeps_its_unfinished_requests_in_flight():
    spec = small_spec(num_agents=8 * 8, arrivals_s=tuple(float(i) for i in range(8)))
    simulator = build_simulator(spec)
    simulator.run(until_s=5.0)
    in_flight = simulator.requests_in_flight
    assert in_flight and all(r.finish_s < 0 for r in in_flight)
    assert all(r.finish_s <= 5.0 for r in simulator.records)
    assert not any(math.isinf(r.submit_s) for r in in_flight)


def test_the_window_covers_lifetimes_at_the_slos_pace():
    # 100 s alone and 10 turns: each turn may take half the TTFT bound longer near capacity.
    assert online.window_s(100.0, 10) == online.WINDOW_AGENT_LIFETIMES * (100.0 + 10 * 2.0)


def test_a_probe_of_copies_replays_the_smaller_probe_copies_times(monkeypatch):
    # The scale experiment's big cluster: a probe at APS a with 4 copies holds 4 copies of the
    # probe at a / 4 (same agents and arrivals), copy c arriving c / a after the original.
    built = []
    real_build = online.build_simulator
    monkeypatch.setattr(
        online, "build_simulator", lambda spec: built.append(spec) or real_build(spec)
    )
    single = online.run_probe(small_spec(), aps=0.05, window_s=200.0)
    copied = online.run_probe(small_spec(nodes="8P16D"), aps=0.2, window_s=200.0, copies=4)
    original = build_simulator(built[0]).agents
    copies = built[1].agents
    assert copied.num_agents == 4 * single.num_agents == len(copies) == 4 * len(original)
    for index, agent in enumerate(copies):
        copy, of = divmod(index, len(original))
        assert agent.agent_id == index
        assert agent.arrival_s == pytest.approx(original[of].arrival_s + copy / 0.2)
        assert agent.prompt_tokens == original[of].prompt_tokens
        assert agent.output_tokens == original[of].output_tokens


def test_a_probe_draws_a_given_workloads_agents_in_order_and_round_robin(monkeypatch):
    # A trace's sessions (RunSpec.agents): the probe's agents are them in order, then copies
    # from the first again, each with a fresh id and the probe's Poisson arrival.
    from dualpath.sim.agents import AgentTrace

    pool = tuple(
        AgentTrace(i, 0.0, (100 * (i + 1), 300 * (i + 1)), (0, 64), (4, 4)) for i in range(3)
    )
    built = []
    real_build = online.build_simulator
    monkeypatch.setattr(
        online, "build_simulator", lambda spec: built.append(spec) or real_build(spec)
    )
    probe = online.run_probe(small_spec(agents=pool), aps=0.1, window_s=70.0)
    agents = built[0].agents
    assert probe.num_agents == len(agents) == 7
    assert [a.agent_id for a in agents] == list(range(7))
    assert [a.prompt_tokens for a in agents] == [pool[i % 3].prompt_tokens for i in range(7)]
    arrivals = [a.arrival_s for a in agents]
    assert arrivals == sorted(arrivals) and arrivals[-1] > arrivals[0] == 0.0
    with pytest.raises(ValueError, match="at least one agent"):
        online.drawn_agents((), [0.0])

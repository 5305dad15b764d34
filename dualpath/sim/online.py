"""Online capacity on the simulator (SPEC §7, Fig. 10): Poisson agent arrivals, the SLO, and
the largest APS (agents per second) that holds it.

    dualpath simulate --experiment online-capacity

A probe at ``aps`` replays ``aps x window_s`` agents whose arrivals are a Poisson process
(``dualpath.workload.poisson_arrival_offsets_s``: exponential gaps, uncapped): trajectories
of the preset, or a given workload's agents (``RunSpec.agents``, e.g. a trace's sessions)
drawn in order and round robin (``drawn_agents``). It stops
``DRAIN_S`` after the window. Its steady state is the second half of the window: the SLO
holds when the p90 TTFT and the p90 TPOT of the requests submitted in ``[window/2, window]``
are within ``SLO_TTFT_S`` and ``SLO_TPOT_S``; a request of that half still without its first
token (or its last) at the stop counts as a violation of that figure.

The window is ``WINDOW_AGENT_LIFETIMES`` agent lifetimes *at the SLO's pace*: an unloaded
lifetime plus, per turn, half the TTFT bound (a mean TTFT near capacity). The population of
agents in flight ramps up over one such lifetime, so it has settled by the window's middle;
with unloaded lifetimes alone the second half would over-represent early, short-context turns
(where a turn takes 0.3 s unloaded, as on the 27B model, it takes several seconds near
capacity). The search
starts at half the offline throughput (agents / JCT of an offline run), doubles or halves
until a pass and a failure bracket the capacity, then bisects until the bracket is within
``BRACKET_TOLERANCE`` of its upper end or ``MAX_PROBES`` probes were made (the rule of
``dualpath bench online --find-capacity``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from dualpath.sim.agents import AgentTrace, copied_agents, synthetic_agents
from dualpath.sim.metrics import ttfts_and_tpots
from dualpath.sim.runner import BLOCK_SIZE_TOKENS, RunSpec, build_simulator, progress_bar
from dualpath.workload import poisson_arrival_offsets_s

SLO_TTFT_S = 4.0  # SPEC §7
SLO_TPOT_S = 0.050  # SPEC §7
MAX_PROBES = 6
BRACKET_TOLERANCE = 0.05
WINDOW_AGENT_LIFETIMES = 2.0


def window_s(unloaded_lifetime_s: float, num_turns: int) -> float:
    """The probe window for agents of ``num_turns`` turns (module docstring)."""
    return WINDOW_AGENT_LIFETIMES * (unloaded_lifetime_s + num_turns * SLO_TTFT_S / 2)


DRAIN_S = 120.0  # after the window: in-flight turns of the second half finish


@dataclass(frozen=True, slots=True)
class OnlineProbe:
    """One online run at ``aps`` and its steady-state p90s (inf = a violation by timeout)."""

    aps: float
    num_agents: int
    num_requests: int  # submitted in the second half of the window
    p90_ttft_s: float
    p90_tpot_s: float
    num_events: int
    wall_s: float

    @property
    def is_attained(self) -> bool:
        return self.p90_ttft_s <= SLO_TTFT_S and self.p90_tpot_s <= SLO_TPOT_S


def run_probe(
    base: RunSpec, aps: float, window_s: float, copies: int = 1, *, progress: bool = False
) -> OnlineProbe:
    """Simulate ``base`` (its mode, cluster, seed) under Poisson arrivals at ``aps``
    (``progress``: a progress bar on stderr). With ``copies`` > 1 the agents are that many
    copies of the probe at ``aps / copies`` (the same agents, arrivals and seed), copy c
    arriving c / ``aps`` after the original: a cluster ``copies`` times larger sees exactly
    ``copies`` times the smaller one's load (the scale experiment)."""
    import time

    num_agents = max(2, round(aps / copies * window_s))
    arrivals_s = [float(t) for t in poisson_arrival_offsets_s(num_agents, aps / copies, base.seed)]
    if base.agents is None:
        agents = synthetic_agents(
            base.preset,
            num_agents,
            seed=base.seed,
            block_size_tokens=BLOCK_SIZE_TOKENS,
            arrivals_s=arrivals_s,
        )
    else:
        agents = drawn_agents(base.agents, arrivals_s)
    copied = copied_agents(agents, copies, arrival_step_s=1 / aps)  # one copy: the agents
    # RunSpec divides num_agents by scale_down; the probe's count is already final.
    spec = replace(base, num_agents=len(copied) * base.scale_down, agents=tuple(copied))
    simulator = build_simulator(spec)
    start_s = time.perf_counter()
    until_s = window_s + DRAIN_S
    label = f"{base.nodes} {base.mode} at {aps:.4g} APS"
    with progress_bar(simulator, label, enabled=progress, until_s=until_s) as on_progress:
        simulator.run(until_s, on_progress)
    wall_s = time.perf_counter() - start_s
    half_s = window_s / 2
    ttfts, tpots = ttfts_and_tpots(
        record for record in simulator.records if half_s <= record.submit_s <= window_s
    )
    for request in simulator.requests_in_flight:
        if half_s <= request.submit_s <= window_s:
            has_first = request.first_token_s >= 0
            ttfts.append(request.first_token_s - request.submit_s if has_first else math.inf)
            tpots.append(math.inf)
    return OnlineProbe(
        aps=aps,
        num_agents=num_agents * copies,
        num_requests=len(ttfts),
        p90_ttft_s=_p90(ttfts),
        p90_tpot_s=_p90(tpots),
        num_events=simulator.queue.num_events,
        wall_s=wall_s,
    )


def drawn_agents(pool: Sequence[AgentTrace], arrivals_s: Sequence[float]) -> list[AgentTrace]:
    """One agent per arrival from a given workload's agents (a trace's sessions), in order
    and round robin when there are more arrivals, each with a fresh id: copies are
    cache-disjoint, which hits within an agent already are (``agents.copied_agents``)."""
    if not pool:
        raise ValueError("an online probe needs at least one agent to draw from")
    return [
        dataclasses.replace(pool[i % len(pool)], agent_id=i, arrival_s=arrival_s)
        for i, arrival_s in enumerate(arrivals_s)
    ]


def _p90(values: list[float]) -> float:
    if not values:
        return math.inf  # nothing measured in the steady state: not attained
    return float(np.percentile(np.array(values), 90, method="higher"))


def next_aps(probes: list[OnlineProbe], start_aps: float) -> float | None:
    """The next APS to probe; None when the bracket is narrow enough or probes ran out."""
    if not probes:
        return start_aps
    if len(probes) >= MAX_PROBES:
        return None
    passed = [p.aps for p in probes if p.is_attained]
    failed = [p.aps for p in probes if not p.is_attained]
    if not failed:
        return max(passed) * 2
    if not passed:
        return min(failed) / 2
    low = max(passed)
    above = [aps for aps in failed if aps > low]
    if not above:
        return low * 2  # a failure below a pass (noise): look above the best pass
    high = min(above)
    if (high - low) / high <= BRACKET_TOLERANCE:
        return None
    return (low + high) / 2


def capacity_aps(probes: list[OnlineProbe]) -> float:
    """The largest attaining APS below every failing one (0.0 if none attained)."""
    failed = [p.aps for p in probes if not p.is_attained]
    ceiling = min(failed) if failed else math.inf
    passed = [p.aps for p in probes if p.is_attained and p.aps < ceiling]
    return max(passed) if passed else 0.0


def find_capacity(
    base: RunSpec, start_aps: float, window_s: float, copies: int = 1, *, progress: bool = False
) -> list[OnlineProbe]:
    """Every probe of the search, in order (``capacity_aps`` reads the answer from them);
    ``copies`` as for ``run_probe``."""
    probes: list[OnlineProbe] = []
    while (aps := next_aps(probes, start_aps)) is not None:
        probes.append(run_probe(base, aps, window_s, copies, progress=progress))
    return probes

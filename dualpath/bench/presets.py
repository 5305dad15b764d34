"""Benchmark presets: a workload, a cluster shape and its emulated link caps.

Workloads are SPEC §7's synthetic agent trajectories (``dualpath.workload``) scaled down for
one host: ``length_scale`` multiplies every length, ``turn_scale`` keeps each trajectory's first
turns, ``max_turns`` caps them, and ``gen_scale`` shortens the generations (see ``paper-ratio``
for why).

Link caps emulate a cluster's SNICs on one host (SPEC §4); every figure measured with caps
depends on them, and the JSON records them. ``snic_bandwidth_gbps = None`` means "fixed by
calibration before the timed runs" (``paper-ratio``: SNIC cap = hit-KV consumption / rho).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.workload import PRESETS as TRAJECTORY_PRESETS
from dualpath.workload import Session, Turn, Workload, generate_trajectories


@dataclass(frozen=True, slots=True)
class BenchPreset:
    description: str
    trajectory_preset: str  # a dualpath.workload.PRESETS key: "32k", "48k", "64k"
    num_agents: int
    length_scale: float
    turn_scale: float
    gen_scale: float  # generations are this fraction of the trajectory's (>= 1 token)
    nodes: str  # cluster shape, e.g. "1P2D"
    snic_bandwidth_gbps: float | None  # per node; None: calibrated to ``rho``
    rho: float | None = None  # SPEC §5's hit-KV demand over one SNIC (calibrated presets)
    max_turns: int | None = None  # each trajectory keeps at most its first max_turns turns
    # Online runs: the agent arrival rate (agents per second) when --aps is not given.
    aps: float = 1.0


PRESETS = {
    "ci": BenchPreset(
        description="4 agents of ~8 short turns on 1P2D with the tiny model; under 2 minutes "
        "for three modes",
        trajectory_preset="64k",
        num_agents=4,
        length_scale=0.05,
        turn_scale=0.05,
        gen_scale=1.0,
        nodes="1P2D",
        snic_bandwidth_gbps=0.2,
        aps=2.0,
    ),
    "default": BenchPreset(
        description="16 agents, 64K trajectories at 1/10 length and 1/10 of their turns",
        trajectory_preset="64k",
        num_agents=16,
        length_scale=0.1,
        turn_scale=0.1,
        gen_scale=1.0,
        nodes="1P2D",
        snic_bandwidth_gbps=0.5,
        aps=1.0,
    ),
    # The paper's regime on one host: the PE is the bottleneck and its storage reads are
    # what limit Basic. 1P2D has the paper's (P+D)/P = 3. Generations are cut to a fifth so
    # that the two decode engines (sharing 2 cores with the PE) stay light: on a CPU, long
    # generations over long contexts would make decode, not prefill, the bottleneck. Many
    # agents of at most 16 turns, as the paper's 1,024 agents of ~157 turns are many against
    # their turns: with few agents of up to 47 turns, the longest agent's chain of turns
    # (each waiting for its own reads) sets the JCT instead of the cluster's throughput.
    "paper-ratio": BenchPreset(
        description="64 agents of <= 16 turns, 64K trajectories at 1/10 length, short "
        "generations; SNIC caps calibrated so that rho = 2",
        trajectory_preset="64k",
        num_agents=64,
        length_scale=0.1,
        turn_scale=0.1,
        gen_scale=0.2,
        nodes="1P2D",
        snic_bandwidth_gbps=None,
        rho=2.0,
        aps=1.0,
        max_turns=16,
    ),
}


def preset_workload(
    preset: BenchPreset,
    *,
    seed: int,
    vocab_size: int,
    avoid_token_ids: tuple[int, ...] = (),
    num_agents: int | None = None,
    length_scale: float | None = None,
) -> Workload:
    """The preset's trajectories (every agent arrives at 0: offline), generations shaped."""
    workload = generate_trajectories(
        TRAJECTORY_PRESETS[preset.trajectory_preset],
        num_agents or preset.num_agents,
        seed=seed,
        vocab_size=vocab_size,
        avoid_token_ids=avoid_token_ids,
        length_scale=length_scale or preset.length_scale,
        turn_scale=preset.turn_scale,
        max_turns=preset.max_turns,
    )
    return scale_generations(workload, preset.gen_scale)


def scale_generations(workload: Workload, gen_scale: float) -> Workload:
    """Every turn generates ``max(1, round(g * gen_scale))`` tokens instead of g."""
    if gen_scale <= 0:
        raise ValueError(f"gen_scale must be > 0, got {gen_scale}")
    if gen_scale == 1.0:
        return workload
    sessions = [
        Session(
            s.session_id,
            s.arrival_s,
            tuple(
                Turn(
                    t.append_token_ids,
                    max(1, round(t.output_tokens * gen_scale)),
                    t.keep_prefix_tokens,
                )
                for t in s.turns
            ),
        )
        for s in workload.sessions
    ]
    return Workload(tuple(sessions), f"{workload.source} gen_scale={gen_scale}")

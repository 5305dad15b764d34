"""Workloads (SPEC §7): synthetic agent trajectories and Mooncake-format traces, one shape.

Every source yields a ``Workload`` of ``Session``s (an arrival offset and turns); a client
replays a session turn by turn with ``Session.first_prompt`` / ``Session.next_prompt`` and
``Session.sampling_params`` (exact output lengths). No torch.
"""

from dualpath.workload.arrival import poisson_arrival_offsets_s
from dualpath.workload.clone import DEFAULT_CLONE_PREFIX_TOKENS, clone_sessions
from dualpath.workload.mooncake import (
    TRACE_BLOCK_SIZE_TOKENS,
    TraceFormatError,
    TraceRow,
    load_mooncake_trace,
    packaged_trace_path,
    read_trace_rows,
)
from dualpath.workload.replay import (
    next_prompt,
    prompt_lengths_tokens,
    replay_session,
    sampling_params_for_turn,
)
from dualpath.workload.shape import Misfit, cap_turns, first_misfit, scale_generations
from dualpath.workload.stats import WorkloadStats, ideal_hit_ratio, workload_stats
from dualpath.workload.synthetic import (
    PRESETS,
    TrajectoryFit,
    TrajectoryLengths,
    TrajectoryTargets,
    fit_trajectories,
    generate_trajectories,
)
from dualpath.workload.types import Session, Turn, Workload

__all__ = [
    "DEFAULT_CLONE_PREFIX_TOKENS",
    "PRESETS",
    "Misfit",
    "TRACE_BLOCK_SIZE_TOKENS",
    "Session",
    "TraceFormatError",
    "TraceRow",
    "TrajectoryFit",
    "TrajectoryLengths",
    "TrajectoryTargets",
    "Turn",
    "Workload",
    "WorkloadStats",
    "cap_turns",
    "clone_sessions",
    "first_misfit",
    "fit_trajectories",
    "generate_trajectories",
    "ideal_hit_ratio",
    "load_mooncake_trace",
    "next_prompt",
    "packaged_trace_path",
    "poisson_arrival_offsets_s",
    "prompt_lengths_tokens",
    "read_trace_rows",
    "replay_session",
    "sampling_params_for_turn",
    "scale_generations",
    "workload_stats",
]

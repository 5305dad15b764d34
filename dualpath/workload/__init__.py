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
    read_trace_rows,
)
from dualpath.workload.replay import (
    next_prompt,
    prompt_lengths_tokens,
    replay_session,
    sampling_params_for_turn,
)
from dualpath.workload.stats import WorkloadStats, workload_stats
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
    "clone_sessions",
    "fit_trajectories",
    "generate_trajectories",
    "load_mooncake_trace",
    "next_prompt",
    "poisson_arrival_offsets_s",
    "prompt_lengths_tokens",
    "read_trace_rows",
    "replay_session",
    "sampling_params_for_turn",
    "workload_stats",
]

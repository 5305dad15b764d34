"""dualpath.scheduler: PE/DE placement, read-path choice and PE batching as pure policy (SPEC §6).

Plain data in, plain data out: no torch, no I/O, no clock, no threads, so the runtime (group
leaders over a control channel) and the cluster simulator run the same code. The policy needs
no time at all: callers pace fetches (``SchedulerConfig.fetch_interval_s``). One full cycle::

    scheduler = make_scheduler(config, topology)      # "dualpath" or "round_robin"
    scheduler.submit(SchedulerRequest(7, num_prompt_tokens=33_000, num_cached_tokens=32_576,
                                      max_num_output_tokens=256))
    placed = scheduler.fetch_prefill(prefill_group_snapshot)   # Algorithm 1
    # placed.request_ids[i] -> placed.prefill_engine_ids[i]; reads have not started yet
    final = scheduler.fetch_decode(decode_group_snapshot)      # phase 1, phase 2, LoadPlan
    for assignment in final.assignments():                     # or the columns directly
        start_reads(assignment.prefill_engine_id, assignment.decode_engine_id,
                    assignment.load_plan)                      # the mover executes the plan

On each PE, a ``PrefillBatcher`` (with a fitted ``AttentionTimePredictor``) packs the
assigned prefills into batches under the attention quota, chunking the one that overflows.
"""

from dualpath.config import READ_PATHS, SCHEDULER_NAMES, SchedulerConfig
from dualpath.scheduler.attention_predictor import (
    AttentionProfileSample,
    AttentionTimePredictor,
    ConstantAttentionTimePredictor,
    FittedAttentionTimePredictor,
)
from dualpath.scheduler.batching import (
    PrefillBatch,
    PrefillBatcher,
    PrefillChunk,
    PrefillWork,
    pack_prefill_batch,
)
from dualpath.scheduler.dualpath_policy import DualPathScheduler
from dualpath.scheduler.factory import Scheduler, make_scheduler
from dualpath.scheduler.fetching import FetchDriver, FetchingGroup
from dualpath.scheduler.load_planner import (
    FixedSideLoadPlanner,
    LoadPlan,
    LoadPlanner,
    RoundRobinLoadPlanner,
    ShorterQueueLoadPlanner,
    SplitLoadPlanner,
    make_load_planner,
)
from dualpath.scheduler.message import (
    DecodeAssignment,
    DecodeFetchResult,
    EngineSnapshot,
    GroupSnapshot,
    NodeSnapshot,
    PrefillAssignment,
    PrefillFetchResult,
    SchedulerRequest,
)
from dualpath.scheduler.round_robin import RoundRobinScheduler
from dualpath.scheduler.thresholds import resolve_alpha_tokens, resolve_beta_tokens
from dualpath.scheduler.topology import (
    ClusterTopology,
    EngineGroupSpec,
    EngineRole,
    NodeSpec,
    make_cluster_topology,
    storage_read_tokens_per_s,
)

__all__ = [
    "READ_PATHS",
    "SCHEDULER_NAMES",
    "AttentionProfileSample",
    "AttentionTimePredictor",
    "ClusterTopology",
    "ConstantAttentionTimePredictor",
    "DecodeAssignment",
    "DecodeFetchResult",
    "DualPathScheduler",
    "EngineGroupSpec",
    "EngineRole",
    "EngineSnapshot",
    "FetchDriver",
    "FetchingGroup",
    "FittedAttentionTimePredictor",
    "GroupSnapshot",
    "LoadPlan",
    "LoadPlanner",
    "NodeSnapshot",
    "NodeSpec",
    "PrefillAssignment",
    "PrefillBatch",
    "PrefillBatcher",
    "PrefillFetchResult",
    "PrefillChunk",
    "FixedSideLoadPlanner",
    "PrefillWork",
    "RoundRobinLoadPlanner",
    "RoundRobinScheduler",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerRequest",
    "ShorterQueueLoadPlanner",
    "SplitLoadPlanner",
    "make_cluster_topology",
    "make_load_planner",
    "make_scheduler",
    "pack_prefill_batch",
    "resolve_alpha_tokens",
    "resolve_beta_tokens",
    "storage_read_tokens_per_s",
]

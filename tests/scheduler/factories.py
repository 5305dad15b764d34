"""Small builders for scheduler tests: tiny clusters, requests and group snapshots."""

from __future__ import annotations

from collections.abc import Sequence

from dualpath.scheduler import (
    ClusterTopology,
    EngineSnapshot,
    GroupSnapshot,
    NodeSnapshot,
    SchedulerConfig,
    SchedulerRequest,
    make_cluster_topology,
)

BLOCK_SIZE_TOKENS = 16  # small blocks keep hand-computed numbers small


def make_config(**overrides: object) -> SchedulerConfig:
    """α = 100 tokens, β = 1,000 tokens and 16-token blocks unless overridden."""
    fields: dict[str, object] = {
        "alpha_tokens": 100,
        "beta_tokens": 1000,
        "block_size_tokens": BLOCK_SIZE_TOKENS,
    }
    fields.update(overrides)
    return SchedulerConfig(**fields)  # type: ignore[arg-type]


def make_topology(
    *,
    num_prefill_nodes: int = 1,
    num_decode_nodes: int = 1,
    engines_per_node: int = 2,
    nodes_per_group: int = 1,
    storage_read_tokens_per_s: float = 1000.0,
) -> ClusterTopology:
    """Prefill nodes first; node n holds engines n*engines_per_node, ... (see
    ``make_cluster_topology``)."""
    return make_cluster_topology(
        num_prefill_nodes=num_prefill_nodes,
        num_decode_nodes=num_decode_nodes,
        storage_read_tokens_per_s=storage_read_tokens_per_s,
        engines_per_node=engines_per_node,
        nodes_per_group=nodes_per_group,
    )


def make_request(
    request_id: int,
    *,
    num_prompt_tokens: int = 100,
    num_cached_tokens: int = 0,
    max_num_output_tokens: int = 0,
    preferred_decode_engine_id: int | None = None,
) -> SchedulerRequest:
    return SchedulerRequest(
        request_id=request_id,
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=num_cached_tokens,
        max_num_output_tokens=max_num_output_tokens,
        preferred_decode_engine_id=preferred_decode_engine_id,
    )


def make_engine(
    engine_id: int, *, num_seqs: int = 0, num_tokens: int = 0, num_free_kv_blocks: int = 0
) -> EngineSnapshot:
    return EngineSnapshot(
        engine_id=engine_id,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        num_free_kv_blocks=num_free_kv_blocks,
    )


def make_group_snapshot(
    topology: ClusterTopology,
    group_id: int,
    *,
    engines: Sequence[EngineSnapshot] | None = None,
    read_queue_tokens: Sequence[int] | None = None,
) -> GroupSnapshot:
    """A report for ``group_id``; idle engines and empty read queues unless given."""
    (group,) = (g for g in topology.groups if g.group_id == group_id)
    if engines is None:
        engines = [make_engine(engine_id) for engine_id in group.engine_ids]
    if read_queue_tokens is None:
        read_queue_tokens = [0] * len(group.node_ids)
    return GroupSnapshot(
        group_id=group_id,
        engines=tuple(engines),
        nodes=tuple(
            NodeSnapshot(node_id, tokens)
            for node_id, tokens in zip(group.node_ids, read_queue_tokens, strict=True)
        ),
    )

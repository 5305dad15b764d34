"""Boundary objects: SchedulerConfig (validation, α/β), the cluster topology, requests, fetch
results."""

from __future__ import annotations

import pytest

from dualpath.scheduler import (
    ClusterTopology,
    DecodeFetchResult,
    EngineRole,
    LoadPlan,
    NodeSpec,
    PrefillFetchResult,
    SchedulerConfig,
    SchedulerRequest,
    make_cluster_topology,
    resolve_alpha_tokens,
    resolve_beta_tokens,
    storage_read_tokens_per_s,
)


def test_alpha_is_three_seconds_of_storage_reads_unless_overridden():
    assert resolve_alpha_tokens(SchedulerConfig(), 1_000_000.5) == 3_000_001
    assert resolve_alpha_tokens(SchedulerConfig(alpha_tokens=7), 1_000_000.0) == 7


def test_beta_is_five_seconds_of_prefill_unless_overridden():
    assert resolve_beta_tokens(SchedulerConfig(prefill_tokens_per_s=20_000.0)) == 100_000
    assert resolve_beta_tokens(SchedulerConfig(beta_tokens=9, prefill_tokens_per_s=1.0)) == 9
    with pytest.raises(ValueError, match="beta_tokens or a profiled prefill_tokens_per_s"):
        resolve_beta_tokens(SchedulerConfig())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_size_tokens": 0}, "block_size_tokens must be > 0"),
        ({"alpha_window_s": 0.0}, "alpha_window_s must be > 0"),
        ({"beta_tokens": -1}, "beta_tokens must be >= 0"),
        ({"prefill_tokens_per_s": 0.0}, "prefill_tokens_per_s must be > 0"),
        ({"z_factor": 0.9}, "z_factor must be >= 1.0"),
        ({"attention_quota_s": 0.0}, "attention_quota_s must be > 0"),
        ({"min_prefill_chunk_tokens": 0}, "min_prefill_chunk_tokens must be > 0"),
    ],
)
def test_config_rejects_bad_values(fields, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**fields)


def test_storage_read_rate_in_tokens():
    # 400 Gbps = 50e9 bytes/s; at 40,000 bytes per token that is 1.25M tokens/s.
    assert storage_read_tokens_per_s(400.0, 40_000) == 1_250_000.0


def test_cluster_numbering_and_groups():
    topology = make_cluster_topology(
        num_prefill_nodes=2,
        num_decode_nodes=4,
        storage_read_tokens_per_s=1.0,
        engines_per_node=3,
        nodes_per_group=2,
    )
    assert [(g.group_id, g.role, g.node_ids) for g in topology.groups] == [
        (0, EngineRole.PREFILL, (0, 1)),
        (1, EngineRole.DECODE, (2, 3)),
        (2, EngineRole.DECODE, (4, 5)),
    ]
    assert topology.groups[0].engine_ids == (0, 1, 2, 3, 4, 5)
    assert [g.group_id for g in topology.groups_of(EngineRole.DECODE)] == [1, 2]


def test_cluster_needs_whole_groups():
    with pytest.raises(ValueError, match="num_decode_nodes must be a positive multiple"):
        make_cluster_topology(
            num_prefill_nodes=2, num_decode_nodes=3, storage_read_tokens_per_s=1.0
        )


def _node(node_id, role, group_id, engine_ids):
    return NodeSpec(node_id, role, group_id, engine_ids, storage_read_tokens_per_s=1.0)


def test_topology_rejects_inconsistent_nodes():
    prefill = _node(0, EngineRole.PREFILL, 0, (0,))
    with pytest.raises(ValueError, match="mixes roles"):
        ClusterTopology((prefill, _node(1, EngineRole.DECODE, 0, (1,))))
    with pytest.raises(ValueError, match="engine ids must be unique"):
        ClusterTopology((prefill, _node(1, EngineRole.DECODE, 1, (0,))))
    with pytest.raises(ValueError, match="node ids must be unique"):
        ClusterTopology((prefill, _node(0, EngineRole.DECODE, 1, (1,))))
    with pytest.raises(ValueError, match="at least one decode node"):
        ClusterTopology((prefill,))
    with pytest.raises(ValueError, match="has no engines"):
        _node(0, EngineRole.PREFILL, 0, ())


def test_request_counts_and_validation():
    request = SchedulerRequest(
        1, num_prompt_tokens=100, num_cached_tokens=64, max_num_output_tokens=20
    )
    assert (request.num_new_tokens, request.num_decode_tokens) == (36, 120)
    with pytest.raises(ValueError, match=r"num_cached_tokens must be in \[0, 100\]"):
        SchedulerRequest(1, num_prompt_tokens=100, num_cached_tokens=128, max_num_output_tokens=0)
    with pytest.raises(ValueError, match="num_prompt_tokens must be > 0"):
        SchedulerRequest(1, num_prompt_tokens=0, num_cached_tokens=0, max_num_output_tokens=0)
    with pytest.raises(ValueError, match="max_num_output_tokens must be >= 0"):
        SchedulerRequest(1, num_prompt_tokens=10, num_cached_tokens=0, max_num_output_tokens=-1)


def test_fetch_results_need_one_entry_per_request_in_every_column():
    plan = LoadPlan(0, 4)
    assert len(PrefillFetchResult((7, 8), (2, 3))) == 2
    with pytest.raises(ValueError, match="2 request ids, 1 prefill engine ids"):
        PrefillFetchResult((7, 8), (2,))
    assert len(DecodeFetchResult((7,), (2,), (5,), (plan,))) == 1
    for columns in (((2, 2), (5,), (plan,)), ((2,), (), (plan,)), ((2,), (5,), (plan, plan))):
        with pytest.raises(ValueError, match="1 request ids"):
            DecodeFetchResult((7,), *columns)

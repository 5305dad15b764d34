"""The static shape of a cluster as the scheduler sees it: nodes, engines, engine groups.

A node holds ``engines_per_node`` engines of one role and one storage NIC (SPEC §1). An engine
group is one or several whole nodes of one role that fetch work together through a leader
(SPEC §6); only a group of several nodes can hold both short-queue (A) and long-queue (B)
engines. What changes at run time (``seq_e``, ``tok_e``, free memory, ``read_q``) is reported
in snapshots (``dualpath.scheduler.message``), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from dualpath.units import gbps_to_bytes_per_s


class EngineRole(IntEnum):
    PREFILL = 0
    DECODE = 1


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node: its engines (in snapshot order), its role, its group and its storage read rate."""

    node_id: int
    role: EngineRole
    group_id: int
    engine_ids: tuple[int, ...]
    # Storage reads through this node's SNIC, in KV tokens per second: the SNIC cap, or the
    # measured store read rate when uncapped (SPEC §6). Sets α and the split-read balance.
    storage_read_tokens_per_s: float

    def __post_init__(self) -> None:
        if not self.engine_ids:
            raise ValueError(f"node {self.node_id} has no engines")
        if not self.storage_read_tokens_per_s > 0:
            raise ValueError(
                f"node {self.node_id}: storage_read_tokens_per_s must be > 0, "
                f"got {self.storage_read_tokens_per_s}"
            )


@dataclass(frozen=True, slots=True)
class EngineGroupSpec:
    """Engines that fetch together; a snapshot lists them in ``engine_ids`` order."""

    group_id: int
    role: EngineRole
    node_ids: tuple[int, ...]
    engine_ids: tuple[int, ...]  # node by node, in NodeSpec order; engine_ids[0] leads


@dataclass(frozen=True, slots=True)
class ClusterTopology:
    """Every node of the cluster; groups are derived (in order of first appearance)."""

    nodes: tuple[NodeSpec, ...]
    groups: tuple[EngineGroupSpec, ...] = field(init=False)

    def __post_init__(self) -> None:
        node_ids = [node.node_id for node in self.nodes]
        if len(set(node_ids)) != len(node_ids):
            raise ValueError(f"node ids must be unique, got {node_ids}")
        engine_ids = [engine_id for node in self.nodes for engine_id in node.engine_ids]
        if len(set(engine_ids)) != len(engine_ids):
            raise ValueError("engine ids must be unique across nodes")
        group_id_to_nodes: dict[int, list[NodeSpec]] = {}
        for node in self.nodes:
            group_id_to_nodes.setdefault(node.group_id, []).append(node)
        groups = []
        for group_id, nodes in group_id_to_nodes.items():
            roles = sorted({node.role for node in nodes})
            if len(roles) != 1:
                raise ValueError(f"group {group_id} mixes roles {[r.name for r in roles]}")
            groups.append(
                EngineGroupSpec(
                    group_id=group_id,
                    role=roles[0],
                    node_ids=tuple(node.node_id for node in nodes),
                    engine_ids=tuple(e for node in nodes for e in node.engine_ids),
                )
            )
        for role in EngineRole:
            if not any(group.role == role for group in groups):
                raise ValueError(f"the cluster needs at least one {role.name.lower()} node")
        object.__setattr__(self, "groups", tuple(groups))

    def groups_of(self, role: EngineRole) -> tuple[EngineGroupSpec, ...]:
        return tuple(group for group in self.groups if group.role == role)


def storage_read_tokens_per_s(snic_bandwidth_gbps: float, kv_bytes_per_token: int) -> float:
    """A node's storage read rate in KV tokens/s from its SNIC line rate (1e9 bit/s)."""
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token}")
    return gbps_to_bytes_per_s(snic_bandwidth_gbps) / kv_bytes_per_token


def make_cluster_topology(
    *,
    num_prefill_nodes: int,
    num_decode_nodes: int,
    storage_read_tokens_per_s: float,
    engines_per_node: int = 8,
    nodes_per_group: int = 2,
) -> ClusterTopology:
    """A homogeneous cluster, numbered in order: prefill nodes first, then decode nodes.

    Node i holds engines ``i*engines_per_node ...``; groups take ``nodes_per_group``
    consecutive nodes of one role, so each role's node count must be a multiple of it.
    """
    if engines_per_node <= 0 or nodes_per_group <= 0:
        raise ValueError(
            f"engines_per_node and nodes_per_group must be > 0, "
            f"got {engines_per_node} and {nodes_per_group}"
        )
    for name, count in (
        ("num_prefill_nodes", num_prefill_nodes),
        ("num_decode_nodes", num_decode_nodes),
    ):
        if count <= 0 or count % nodes_per_group:
            raise ValueError(
                f"{name} must be a positive multiple of nodes_per_group={nodes_per_group}, "
                f"got {count}"
            )
    roles = [EngineRole.PREFILL] * num_prefill_nodes + [EngineRole.DECODE] * num_decode_nodes
    nodes = tuple(
        NodeSpec(
            node_id=node_id,
            role=role,
            group_id=node_id // nodes_per_group,
            engine_ids=tuple(range(node_id * engines_per_node, (node_id + 1) * engines_per_node)),
            storage_read_tokens_per_s=storage_read_tokens_per_s,
        )
        for node_id, role in enumerate(roles)
    )
    return ClusterTopology(nodes=nodes)

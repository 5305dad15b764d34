"""What the scheduler believes about the cluster between two reports (internal, mutable).

Both placement policies share it: the topology's lookup tables, each node's storage read
and write queues and the read-path decision, with the one piece of read-path state: per (PE
node, DE node) pair, how many requests with a hit were planned on it (the turn of the
``"round_robin"`` read path; the planners themselves are pure). A node's ``read_q`` is the value its group leader last
reported plus every read the scheduler has planned on that node since, so that decisions in
one fetch, and fetches of other groups before the next report, see the reads already planned
(our choice; SPEC §6 says only "the latest read_q"). A node not yet reported counts as idle.

The read-side choice compares each node's SNIC queue, ``read_q + write_q``, not ``read_q``
alone (our extension of SPEC §6): a node's SNIC also carries its DE's persistence writes (SPEC
§2), which ``read_q`` does not count. Without them a DE node busy writing the first turns'
prompts looked idle and drew the next turns' reads, which then queued behind those writes
while the PE node's SNIC idled (``paper-ratio``: seconds of DE nodes at their caps with
``read_q`` = 0). ``write_q`` is the last reported value: the scheduler plans no writes. PE
nodes write nothing, so Algorithm 1's categories, which see only PE nodes, keep SPEC's
``read_q``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import SchedulerConfig
from dualpath.scheduler.load_planner import LoadPlan, LoadPlanner
from dualpath.scheduler.message import GroupSnapshot, SchedulerRequest
from dualpath.scheduler.thresholds import resolve_alpha_tokens
from dualpath.scheduler.topology import ClusterTopology, EngineGroupSpec, EngineRole


@dataclass(frozen=True, slots=True)
class GroupIndex:
    """A group's lookup tables: position i in a snapshot is engine ``engine_ids[i]``."""

    spec: EngineGroupSpec
    index: int  # position among the groups of its role, 0-based
    node_indices: tuple[int, ...]  # per engine position: index into ClusterView's node lists
    spec_node_indices: tuple[int, ...]  # the same per node of ``spec.node_ids``


class ClusterView:
    """Node read queues and topology lookups; owned by one scheduler instance."""

    def __init__(
        self, topology: ClusterTopology, config: SchedulerConfig, load_planner: LoadPlanner
    ) -> None:
        self.topology = topology
        self.block_size_tokens = config.block_size_tokens
        self._load_planner = load_planner
        self._node_id_to_index = {node.node_id: i for i, node in enumerate(topology.nodes)}
        # Per node index: read_q as last reported plus planned since (tokens), write_q as last
        # reported (tokens), read rate, α.
        self.read_queue_tokens: list[int] = [0] * len(topology.nodes)
        self.write_queue_tokens: list[int] = [0] * len(topology.nodes)
        self.read_tokens_per_s = [node.storage_read_tokens_per_s for node in topology.nodes]
        # Per (PE node, DE node) pair, at prefill_node_index * num_nodes + decode_node_index:
        # requests with a hit planned on it so far.
        self._num_plans_by_pair = [0] * (len(topology.nodes) ** 2)
        self.alpha_tokens = [
            resolve_alpha_tokens(config, node.storage_read_tokens_per_s) for node in topology.nodes
        ]
        self.engine_id_to_node_index = {
            engine_id: self._node_id_to_index[node.node_id]
            for node in topology.nodes
            for engine_id in node.engine_ids
        }
        self.prefill_groups = self._index_groups(EngineRole.PREFILL)
        self.decode_groups = self._index_groups(EngineRole.DECODE)
        self._group_id_to_index = {
            group.spec.group_id: group for group in self.prefill_groups + self.decode_groups
        }
        # Each DE's (group index, position in its group): where a preferred DE is found.
        self.decode_engine_id_to_place = {
            engine_id: (group.index, position)
            for group in self.decode_groups
            for position, engine_id in enumerate(group.spec.engine_ids)
        }

    def _index_groups(self, role: EngineRole) -> tuple[GroupIndex, ...]:
        return tuple(
            GroupIndex(
                spec=spec,
                index=index,
                node_indices=tuple(self.engine_id_to_node_index[e] for e in spec.engine_ids),
                spec_node_indices=tuple(self._node_id_to_index[n] for n in spec.node_ids),
            )
            for index, spec in enumerate(self.topology.groups_of(role))
        )

    def group(self, group_id: int, role: EngineRole) -> GroupIndex:
        """The group ``group_id`` of ``role``; ``ValueError`` for an unknown group or another
        role."""
        group = self._group_id_to_index.get(group_id)
        if group is None:
            raise ValueError(f"unknown group {group_id}")
        spec = group.spec
        if spec.role != role:
            raise ValueError(
                f"group {spec.group_id} is a {spec.role.name.lower()} group, "
                f"not {role.name.lower()}"
            )
        return group

    def accept(self, snapshot: GroupSnapshot, role: EngineRole) -> GroupIndex:
        """Validate a leader's report against the topology and record its nodes' ``read_q``
        and ``write_q``."""
        group = self.group(snapshot.group_id, role)
        spec = group.spec
        # (Compared entry by entry rather than as tuples of ids: every fetch runs this, and
        # compiled, any() over a generator is a loop that reads each field in C.)
        engines = snapshot.engines
        engine_ids = spec.engine_ids
        if len(engines) != len(engine_ids) or any(
            engine.engine_id != engine_ids[i] for i, engine in enumerate(engines)
        ):
            got = tuple(engine.engine_id for engine in engines)
            raise ValueError(f"group {spec.group_id}: snapshot engines {got} must be {engine_ids}")
        nodes = snapshot.nodes
        node_ids = spec.node_ids
        if len(nodes) != len(node_ids) or any(
            node.node_id != node_ids[i] for i, node in enumerate(nodes)
        ):
            got = tuple(node.node_id for node in nodes)
            raise ValueError(f"group {spec.group_id}: snapshot nodes {got} must be {node_ids}")
        read_queue_tokens = self.read_queue_tokens
        write_queue_tokens = self.write_queue_tokens
        node_indices = group.spec_node_indices
        for position, node in enumerate(nodes):
            node_index = node_indices[position]
            read_queue_tokens[node_index] = node.read_queue_tokens
            write_queue_tokens[node_index] = node.write_queue_tokens
        return group

    def plan_load(
        self, request: SchedulerRequest, prefill_node_index: int, decode_node_index: int
    ) -> LoadPlan:
        """Fix the request's read plan from both nodes' SNIC queues, ``read_q + write_q``
        (module docstring), and the pair's turn, and queue its reads there."""
        block_size_tokens = self.block_size_tokens
        read_queue_tokens = self.read_queue_tokens
        write_queue_tokens = self.write_queue_tokens
        num_hit_blocks = request.num_cached_tokens // block_size_tokens
        pair = prefill_node_index * len(read_queue_tokens) + decode_node_index
        num_earlier_plans = self._num_plans_by_pair[pair]
        if num_hit_blocks:
            self._num_plans_by_pair[pair] = num_earlier_plans + 1
        plan = self._load_planner.plan(
            num_hit_blocks,
            read_queue_tokens[prefill_node_index] + write_queue_tokens[prefill_node_index],
            read_queue_tokens[decode_node_index] + write_queue_tokens[decode_node_index],
            self.read_tokens_per_s[prefill_node_index],
            self.read_tokens_per_s[decode_node_index],
            num_earlier_plans=num_earlier_plans,
        )
        read_queue_tokens[prefill_node_index] += plan.num_prefill_side_blocks * block_size_tokens
        read_queue_tokens[decode_node_index] += plan.num_decode_side_blocks * block_size_tokens
        return plan

    def check_request(self, request: SchedulerRequest) -> None:
        """``ValueError`` unless the request's hit is whole Full Blocks (SPEC §3) and its
        preferred DE, if any, is a decode engine of the topology."""
        if request.num_cached_tokens % self.block_size_tokens:
            raise ValueError(
                f"request {request.request_id}: num_cached_tokens {request.num_cached_tokens} "
                f"is not a multiple of block_size_tokens {self.block_size_tokens}"
            )
        preferred = request.preferred_decode_engine_id
        if preferred is not None and preferred not in self.decode_engine_id_to_place:
            raise ValueError(
                f"request {request.request_id}: preferred_decode_engine_id {preferred} is not "
                "a decode engine"
            )

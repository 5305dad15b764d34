"""RoundRobinScheduler: the load-oblivious baseline (our reading of the paper's Basic, SPEC §7).

Each submitted request takes the next PE in cluster order; when its PE's group fetches it, it
takes the next DE in cluster order. Neither choice looks at load. Fitted into the pull model:

* a PE group's fetch returns every request waiting for one of its engines, FIFO (Basic has no
  admission gate; the engine queues work locally);
* a DE group's fetch places its requests FIFO while the chosen DE has room for the head request
  (``len_r`` in Full Blocks, as SPEC §6's memory gate); the first that does not fit ends the
  fetch and everything behind it waits (head-of-line blocking, as a Basic DE queue would);
* a request with a preferred DE in service (its agent session's: ``SchedulerRequest``) takes
  that DE instead, out of turn, and waits for its room as any other;
* the read plan is fixed at DE placement by the configured planner; Basic uses ``read_path="pe"``,
  the ablation's "+dual path" step ``read_path="round_robin"`` (PE side, DE side, in turn per
  node pair, ignoring the queues: ``load_planner.py``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from dualpath.config import SchedulerConfig
from dualpath.scheduler.cluster_view import ClusterView
from dualpath.scheduler.load_planner import LoadPlanner, make_load_planner
from dualpath.scheduler.message import (
    DecodeFetchResult,
    GroupSnapshot,
    PrefillFetchResult,
    SchedulerRequest,
)
from dualpath.scheduler.topology import ClusterTopology, EngineRole


class RoundRobinScheduler:
    """Round-robin PE and DE choice; same interface and contracts as ``DualPathScheduler``."""

    def __init__(
        self,
        config: SchedulerConfig,
        topology: ClusterTopology,
        load_planner: LoadPlanner | None = None,
    ) -> None:
        if load_planner is None:
            load_planner = make_load_planner(
                config.read_path, block_size_tokens=config.block_size_tokens
            )
        self._cluster = ClusterView(topology, config, load_planner)
        # Engines in cluster order (group by group), each with its group's index.
        self._prefill_engines = [
            (engine_id, group.index)
            for group in self._cluster.prefill_groups
            for engine_id in group.spec.engine_ids
        ]
        self._decode_engines = [
            (engine_id, group.index)
            for group in self._cluster.decode_groups
            for engine_id in group.spec.engine_ids
        ]
        self._next_prefill = 0
        self._next_decode = 0
        # Per group, FIFO: (request, prefill_engine_id) / (request, prefill_engine_id,
        # decode_engine_id).
        self._prefill_group_queues: list[deque[tuple[SchedulerRequest, int]]] = [
            deque() for _ in self._cluster.prefill_groups
        ]
        self._decode_group_queues: list[deque[tuple[SchedulerRequest, int, int]]] = [
            deque() for _ in self._cluster.decode_groups
        ]
        self._waiting_request_ids: dict[int, None] = {}
        self._dead_engine_ids: set[int] = set()

    @property
    def num_waiting_prefill(self) -> int:
        return sum(map(len, self._prefill_group_queues))

    @property
    def num_waiting_decode(self) -> int:
        return sum(map(len, self._decode_group_queues))

    def submit(self, request: SchedulerRequest) -> None:
        """Queue the request for the next PE in turn; ``ValueError`` if its id is waiting."""
        if request.request_id in self._waiting_request_ids:
            raise ValueError(f"request {request.request_id} is already waiting")
        self._cluster.check_request(request)
        self._waiting_request_ids[request.request_id] = None
        index, _ = self._next_live(self._prefill_engines, self._next_prefill)
        engine_id, group_index = self._prefill_engines[index]
        self._next_prefill = (index + 1) % len(self._prefill_engines)
        self._prefill_group_queues[group_index].append((request, engine_id))

    def withdraw_engine(self, engine_id: int) -> list[SchedulerRequest]:
        """See ``Scheduler.withdraw_engine``: the turn skips the lost engine from now on."""
        self._dead_engine_ids.add(engine_id)
        withdrawn: list[SchedulerRequest] = []
        # (PE queues hold (request, PE) entries, DE queues (request, PE, DE): one loop for both.)
        role_queues: tuple[list[deque[Any]], ...] = (
            self._prefill_group_queues,
            self._decode_group_queues,
        )
        for queues in role_queues:
            for index, queue in enumerate(queues):
                kept: deque[Any] = deque()
                for entry in queue:
                    if engine_id in entry[1:]:
                        withdrawn.append(entry[0])
                    else:
                        kept.append(entry)
                queues[index] = kept
        for request in withdrawn:
            del self._waiting_request_ids[request.request_id]
        return withdrawn

    def restore_engine(self, engine_id: int) -> None:
        """See ``Scheduler.restore_engine``: the turn takes the engine again."""
        self._dead_engine_ids.discard(engine_id)

    def _next_live(self, engines: list[tuple[int, int]], position: int) -> tuple[int, int]:
        """(index into ``engines`` of the next live engine at or after ``position``, engine)."""
        for step in range(len(engines)):
            index = (position + step) % len(engines)
            if engines[index][0] not in self._dead_engine_ids:
                return index, engines[index][0]
        raise RuntimeError("caller bug: every engine of a role was withdrawn")

    def fetch_prefill(self, snapshot: GroupSnapshot) -> PrefillFetchResult:
        """Every request waiting for this group's PEs; each then takes the next DE."""
        group = self._cluster.accept(snapshot, EngineRole.PREFILL)
        queue = self._prefill_group_queues[group.index]
        request_ids, prefill_engine_ids = [], []
        while queue:
            request, prefill_engine_id = queue.popleft()
            preferred = request.preferred_decode_engine_id
            if preferred is not None and preferred not in self._dead_engine_ids:
                # Its session's DE, out of turn (the turn does not move).
                decode_engine_id = preferred
                decode_group_index = self._cluster.decode_engine_id_to_place[preferred][0]
            else:
                index, _ = self._next_live(self._decode_engines, self._next_decode)
                decode_engine_id, decode_group_index = self._decode_engines[index]
                self._next_decode = (index + 1) % len(self._decode_engines)
            self._decode_group_queues[decode_group_index].append(
                (request, prefill_engine_id, decode_engine_id)
            )
            request_ids.append(request.request_id)
            prefill_engine_ids.append(prefill_engine_id)
        return PrefillFetchResult(tuple(request_ids), tuple(prefill_engine_ids))

    def decode_fetch_may_place(self, group_id: int) -> bool:
        """See ``Scheduler.decode_fetch_may_place``: a request waits for the group's DEs."""
        group = self._cluster.group(group_id, EngineRole.DECODE)
        return bool(self._decode_group_queues[group.index])

    def report_decode_load(self, group_id: int, num_tokens: int) -> None:
        """See ``Scheduler.report_decode_load``: round robin never reads ``tok_e``."""
        self._cluster.group(group_id, EngineRole.DECODE)  # (ValueError for a wrong group)

    def fetch_decode(self, snapshot: GroupSnapshot) -> DecodeFetchResult:
        """FIFO over this group's requests while the chosen DE has room; fixes read plans."""
        group = self._cluster.accept(snapshot, EngineRole.DECODE)
        queue = self._decode_group_queues[group.index]
        cluster = self._cluster
        engine_id_to_free_blocks = {
            engine.engine_id: engine.num_free_kv_blocks for engine in snapshot.engines
        }
        request_ids, prefill_engine_ids, decode_engine_ids, load_plans = [], [], [], []
        while queue:
            request, prefill_engine_id, decode_engine_id = queue[0]
            num_blocks = -(-request.num_decode_tokens // cluster.block_size_tokens)
            if engine_id_to_free_blocks[decode_engine_id] < num_blocks:
                break  # head-of-line: the chosen DE is full
            queue.popleft()
            engine_id_to_free_blocks[decode_engine_id] -= num_blocks
            del self._waiting_request_ids[request.request_id]
            request_ids.append(request.request_id)
            prefill_engine_ids.append(prefill_engine_id)
            decode_engine_ids.append(decode_engine_id)
            load_plans.append(
                cluster.plan_load(
                    request,
                    cluster.engine_id_to_node_index[prefill_engine_id],
                    cluster.engine_id_to_node_index[decode_engine_id],
                )
            )
        return DecodeFetchResult(
            tuple(request_ids),
            tuple(prefill_engine_ids),
            tuple(decode_engine_ids),
            tuple(load_plans),
        )

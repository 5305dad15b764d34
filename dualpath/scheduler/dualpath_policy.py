"""DualPathScheduler: the paper's placement (SPEC §6) as pure policy.

Order of decisions (SPEC §6, our choice where the paper leaves it open)::

    submit -> prefill FIFO --PE fetch: Algorithm 1--> DE global queue
           --any DE fetch: phase 1--> one DE group's private queue
           --that group's fetch: phase 2--> (PE, DE) pair final, LoadPlan fixed, reads start

Choices SPEC leaves open, made here:

* A PE's ``tok_e`` counts whole prompts (hit + new tokens): hit KV passes through the PE's GPU
  layer by layer whichever side reads it. β must be profiled in the same unit.
* Placing a request on a PE does not change ``read_q``: its reads are planned at DE placement,
  so an engine leaves Algorithm 1's categories only by exceeding β.
* Phase 1 moves the whole global queue, FIFO, each request to the DE group with the smallest
  Σ``tok_e`` + Σ``len_r`` already waiting in its private queue (without the queued part, one
  fetch would send every request to the same group). A group's Σ``tok_e`` is its last report
  plus what phase 2 placed since; a group that has not reported yet counts as idle.
* A DE's ``tok_e`` grows by ``len_r`` (prompt + max output), the same ``len_r`` as Z and the
  memory gate. Phase 2 computes R and Z once per fetch.
* A request with a preferred DE (its agent session's: ``SchedulerRequest``) goes in phase 1
  to that DE's group while the DE is in service, and in phase 2 to that DE if its memory
  gate admits it, whatever Z says (the session's KV stays on the DE's store); otherwise step
  (3) chooses in the group, and if no DE of the group has room, the request goes back to the
  front of the global queue without its preference (a group of one DE must not hold it
  while others have room), for the next fetch's phase 1.
* Ties: Algorithm 1 gives equal ``tok_e`` to the engine listed first; phase 2 prefers min
  ``seq_e``, then min ``tok_e``, then the engine listed first; its fallback min ``tok_e``,
  then the engine listed first; phase 1 the group listed first.

Cost per placement: Algorithm 1 and phase 2 one pass over the fetching group's E engines,
phase 1 one pass over the G DE groups' loads; nothing is proportional to the cluster's engine
count. Plain passes over lists of ints beat heaps and sorted lists of tuples at these sizes
(E = 16 on 8-GPU nodes, G = 48 at 48P96D): compiled, a pass compares machine integers, where
every heap step compares two tuples through the interpreter's generic comparison.
"""

from __future__ import annotations

from collections import deque

from dualpath.config import SchedulerConfig
from dualpath.scheduler.cluster_view import ClusterView, GroupIndex
from dualpath.scheduler.load_planner import LoadPlanner, make_load_planner
from dualpath.scheduler.message import (
    EMPTY_DECODE_FETCH_RESULT,
    EMPTY_PREFILL_FETCH_RESULT,
    DecodeFetchResult,
    EngineSnapshot,
    GroupSnapshot,
    PrefillFetchResult,
    SchedulerRequest,
)
from dualpath.scheduler.thresholds import resolve_beta_tokens
from dualpath.scheduler.topology import ClusterTopology, EngineRole

# A request between its PE and DE placement: (request, prefill_engine_id, the PE's node
# index, len_r = num_decode_tokens, the DE memory it needs in Full Blocks).
_PlacedOnPrefill = tuple[SchedulerRequest, int, int, int, int]

# Phase 1's load of a DE group whose engines are all lost: no request goes there again.
_DEAD_GROUP_TOKENS = 1 << 62


class DualPathScheduler:
    """Algorithm 1 for PEs, the two-phase DE placement and the read-path choice (SPEC §6).

    Pure policy: no I/O, no clock, no threads. One instance owns its queues; calls must not
    interleave (the runtime serialises fetches, the simulator is single-threaded). A request
    that cannot be placed stays queued, in order, for a later fetch.
    """

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
        self._beta_tokens = resolve_beta_tokens(config)
        self._z_factor = config.z_factor
        self._prefill_queue: deque[SchedulerRequest] = deque()
        self._decode_global_queue: deque[_PlacedOnPrefill] = deque()
        num_decode_groups = len(self._cluster.decode_groups)
        self._decode_group_queues: list[deque[_PlacedOnPrefill]] = [
            deque() for _ in range(num_decode_groups)
        ]
        # Per DE group: Σ len_r waiting in its private queue, and Σ tok_e (last report +
        # placed since). Their sum is phase 1's load.
        self._decode_group_queued_tokens = [0] * num_decode_groups
        self._decode_group_tokens = [0] * num_decode_groups
        # Submitted and not yet DE-placed; rejects a second submit of a waiting id.
        self._waiting_request_ids: dict[int, None] = {}
        self._dead_engine_ids: set[int] = set()

    @property
    def num_waiting_prefill(self) -> int:
        """Requests in the FIFO, not placed on a PE yet."""
        return len(self._prefill_queue)

    @property
    def num_waiting_decode(self) -> int:
        """Requests placed on a PE, waiting in the global or a private DE queue."""
        return len(self._decode_global_queue) + sum(map(len, self._decode_group_queues))

    def submit(self, request: SchedulerRequest) -> None:
        """Append a request to the prefill FIFO; ``ValueError`` if its id is still waiting."""
        if request.request_id in self._waiting_request_ids:
            raise ValueError(f"request {request.request_id} is already waiting")
        self._cluster.check_request(request)
        self._waiting_request_ids[request.request_id] = None
        self._prefill_queue.append(request)

    def withdraw_engine(self, engine_id: int) -> list[SchedulerRequest]:
        """See ``Scheduler.withdraw_engine``. A lost PE's requests waiting for a DE are
        returned; a DE group whose engines are all lost gets no more requests (phase 1 sees
        it as infinitely loaded) and its private queue goes back to the global queue."""
        self._dead_engine_ids.add(engine_id)
        withdrawn: list[SchedulerRequest] = []

        def keep(entry: _PlacedOnPrefill) -> bool:
            if entry[1] == engine_id:
                withdrawn.append(entry[0])
                return False
            return True

        self._decode_global_queue = deque(filter(keep, self._decode_global_queue))
        for index, queue in enumerate(self._decode_group_queues):
            kept = deque(filter(keep, queue))
            self._decode_group_queued_tokens[index] = sum(entry[3] for entry in kept)
            self._decode_group_queues[index] = kept
        for group in self._cluster.decode_groups:
            if all(e in self._dead_engine_ids for e in group.spec.engine_ids):
                queue = self._decode_group_queues[group.index]
                self._decode_global_queue.extendleft(reversed(queue))
                queue.clear()
                self._decode_group_queued_tokens[group.index] = 0
                self._decode_group_tokens[group.index] = _DEAD_GROUP_TOKENS
        for request in withdrawn:
            del self._waiting_request_ids[request.request_id]
        return withdrawn

    def restore_engine(self, engine_id: int) -> None:
        """See ``Scheduler.restore_engine``. A DE group that was all lost takes requests again
        from phase 1, its load counted from its next report."""
        self._dead_engine_ids.discard(engine_id)
        for group in self._cluster.decode_groups:
            index = group.index
            if engine_id in group.spec.engine_ids and (
                self._decode_group_tokens[index] == _DEAD_GROUP_TOKENS
            ):
                self._decode_group_tokens[index] = 0

    def fetch_prefill(self, snapshot: GroupSnapshot) -> PrefillFetchResult:
        """A PE group's fetch: Algorithm 1 over the FIFO (SPEC §6).

        Placed requests join the DE global queue. The group's ``read_q`` is recorded even
        when nothing is placed.
        """
        group = self._cluster.accept(snapshot, EngineRole.PREFILL)
        if not self._prefill_queue:
            return EMPTY_PREFILL_FETCH_RESULT
        # Per engine position: tok_e, or -1 once over β (out of both categories), and
        # whether its node's read queue is short (category A) or long (B).
        engine_tokens, is_short_queue = self._categorise(group, snapshot.engines)
        beta_tokens = self._beta_tokens
        block_size_tokens = self._cluster.block_size_tokens
        engine_ids = group.spec.engine_ids
        node_indices = group.node_indices
        prefill_queue = self._prefill_queue
        decode_global_queue = self._decode_global_queue
        request_ids: list[int] = []
        prefill_engine_ids: list[int] = []
        while prefill_queue:
            position = _least_loaded_prefill_engine(engine_tokens, is_short_queue)
            if position < 0:
                break  # A and B are both empty: the fetch ends
            request = prefill_queue.popleft()
            num_tokens = engine_tokens[position] + request.num_prompt_tokens
            # Overloaded now: out of both categories.
            engine_tokens[position] = num_tokens if num_tokens <= beta_tokens else -1
            engine_id = engine_ids[position]
            request_ids.append(request.request_id)
            prefill_engine_ids.append(engine_id)
            num_decode_tokens = request.num_decode_tokens
            num_decode_blocks = -(-num_decode_tokens // block_size_tokens)
            decode_global_queue.append(
                (request, engine_id, node_indices[position], num_decode_tokens, num_decode_blocks)
            )
        return PrefillFetchResult(tuple(request_ids), tuple(prefill_engine_ids))

    def _categorise(
        self, group: GroupIndex, engines: tuple[EngineSnapshot, ...]
    ) -> tuple[list[int], list[bool]]:
        """Algorithm 1's categories: per engine position, ``tok_e`` (-1 for an engine over β,
        which gets nothing) and whether its node's ``read_q`` is at most α (A) or not (B)."""
        beta_tokens = self._beta_tokens
        read_queue_tokens = self._cluster.read_queue_tokens
        alpha_tokens = self._cluster.alpha_tokens
        node_indices = group.node_indices  # (as many as engines: ClusterView.accept checked)
        engine_tokens: list[int] = []
        is_short_queue: list[bool] = []
        for position, engine in enumerate(engines):
            node = node_indices[position]
            num_tokens = engine.num_tokens
            engine_tokens.append(num_tokens if num_tokens <= beta_tokens else -1)
            is_short_queue.append(read_queue_tokens[node] <= alpha_tokens[node])
        return engine_tokens, is_short_queue

    def fetch_decode(self, snapshot: GroupSnapshot) -> DecodeFetchResult:
        """A DE group's fetch: phase 1 for all groups, then phase 2 in this one (SPEC §6).

        Each placed request's read plan is fixed here from both nodes' latest ``read_q`` (and
        ``write_q``: ``ClusterView``).
        """
        group = self._cluster.accept(snapshot, EngineRole.DECODE)
        # (A loop rather than sum() of a list: compiled, it adds machine integers.)
        num_group_tokens = 0
        for engine in snapshot.engines:
            num_group_tokens += engine.num_tokens
        self._record_decode_load(group.index, num_group_tokens)
        self._distribute_global_queue()
        if not self._decode_group_queues[group.index]:
            return EMPTY_DECODE_FETCH_RESULT
        return self._place_in_group(group, snapshot.engines, num_group_tokens)

    def decode_fetch_may_place(self, group_id: int) -> bool:
        """Whether a fetch by DE group ``group_id`` could place anything now: a request waits
        in the global queue (the fetch runs phase 1 for every group) or in the group's private
        queue. When False, ``fetch_decode`` would only record the group's report, and
        ``report_decode_load`` records all of it that a later decision reads. ``ValueError``
        for an unknown group or a prefill group."""
        index = self._cluster.group(group_id, EngineRole.DECODE).index
        return bool(self._decode_global_queue or self._decode_group_queues[index])

    def report_decode_load(self, group_id: int, num_tokens: int) -> None:
        """Record DE group ``group_id``'s Σ ``tok_e`` (``num_tokens``) as its fetch does, without
        fetching: for a leader whose fetch could place nothing (``decode_fetch_may_place``),
        every later answer is then the same as after that fetch. The nodes' ``read_q`` and
        ``write_q`` a full report also carries are not needed: only the group's own placements
        read them (a node has one role and one group), and each of those follows a full report
        of the group."""
        self._record_decode_load(self._cluster.group(group_id, EngineRole.DECODE).index, num_tokens)

    def _record_decode_load(self, index: int, num_tokens: int) -> None:
        """A DE group's reported Σ ``tok_e``; a group whose engines are all lost stays dead."""
        if self._decode_group_tokens[index] != _DEAD_GROUP_TOKENS:
            self._decode_group_tokens[index] = num_tokens

    def _distribute_global_queue(self) -> None:
        """Phase 1: each request, FIFO, to the DE group with the least tokens (then the group
        listed first)."""
        global_queue = self._decode_global_queue
        if not global_queue:
            return
        queued_tokens = self._decode_group_queued_tokens
        group_queues = self._decode_group_queues
        group_tokens = self._decode_group_tokens
        loads = [num_tokens + queued_tokens[index] for index, num_tokens in enumerate(group_tokens)]
        num_groups = len(loads)
        while global_queue:
            entry = global_queue.popleft()
            least = -1
            if entry[0].preferred_decode_engine_id is not None:
                least = self._preferred_place(entry[0])[0]
            if least < 0:
                least = 0
                least_load = loads[0]
                for index in range(1, num_groups):
                    load = loads[index]
                    if load < least_load:
                        least, least_load = index, load
            group_queues[least].append(entry)
            loads[least] += entry[3]
        for index in range(num_groups):
            queued_tokens[index] = loads[index] - group_tokens[index]

    def _place_in_group(
        self, group: GroupIndex, engines: tuple[EngineSnapshot, ...], num_group_tokens: int
    ) -> DecodeFetchResult:
        """Phase 2: steps (1)-(4) of SPEC §6 over the group's private queue
        (``num_group_tokens``: Σ ``tok_e`` of ``engines``)."""
        queue = self._decode_group_queues[group.index]
        num_free_blocks = 0
        for engine in engines:
            num_free_blocks += engine.num_free_kv_blocks
        z_tokens = self._z_tokens(queue, num_group_tokens, len(engines), num_free_blocks)
        # Per engine position, what this fetch has placed there so far (sequences, tokens,
        # KV blocks): the engine's load is its snapshot's plus these.
        num_engines = len(engines)
        added_seqs = [0] * num_engines
        added_tokens = [0] * num_engines
        added_blocks = [0] * num_engines
        engine_ids = group.spec.engine_ids
        node_indices = group.node_indices
        plan_load = self._cluster.plan_load
        waiting_request_ids = self._waiting_request_ids
        num_placed_tokens = 0
        request_ids, prefill_engine_ids, decode_engine_ids, load_plans = [], [], [], []
        while queue:
            request, prefill_engine_id, prefill_node, num_tokens, num_blocks = queue[0]
            position = -1
            if request.preferred_decode_engine_id is not None:
                preferred_group, preferred = self._preferred_place(request)
                if (
                    preferred_group == group.index
                    and engines[preferred].num_free_kv_blocks - added_blocks[preferred]
                    >= num_blocks
                ):
                    position = preferred  # its session's DE, which has room for it
            if position < 0:
                position = _choose_decode_engine(
                    engines,
                    added_seqs,
                    added_tokens,
                    added_blocks,
                    num_tokens,
                    num_blocks,
                    z_tokens,
                )
            if position < 0 and request.preferred_decode_engine_id is not None:
                self._release_preferred(group.index)
                continue
            if position < 0:
                break  # step (4): no DE has room for the head request; the fetch ends
            queue.popleft()
            added_seqs[position] += 1
            added_tokens[position] += num_tokens
            added_blocks[position] += num_blocks
            num_placed_tokens += num_tokens
            del waiting_request_ids[request.request_id]
            request_ids.append(request.request_id)
            prefill_engine_ids.append(prefill_engine_id)
            decode_engine_ids.append(engine_ids[position])
            load_plans.append(plan_load(request, prefill_node, node_indices[position]))
        self._decode_group_queued_tokens[group.index] -= num_placed_tokens
        self._decode_group_tokens[group.index] += num_placed_tokens
        return DecodeFetchResult(
            tuple(request_ids),
            tuple(prefill_engine_ids),
            tuple(decode_engine_ids),
            tuple(load_plans),
        )

    def _release_preferred(self, group_index: int) -> None:
        """The head of the group's queue came for its preferred DE, and no DE of the group has
        room for it: it goes back to the front of the global queue without its preference,
        for the next fetch's phase 1 to place it as any other."""
        request, prefill_engine_id, prefill_node, num_tokens, num_blocks = (
            self._decode_group_queues[group_index].popleft()
        )
        self._decode_group_queued_tokens[group_index] -= num_tokens
        released = SchedulerRequest(
            request.request_id,
            request.num_prompt_tokens,
            request.num_cached_tokens,
            request.max_num_output_tokens,
        )
        self._decode_global_queue.appendleft(
            (released, prefill_engine_id, prefill_node, num_tokens, num_blocks)
        )

    def _preferred_place(self, request: SchedulerRequest) -> tuple[int, int]:
        """(DE group index, position in it) of the request's preferred DE while it is in
        service; (-1, -1) for a lost one (``withdraw_engine``)."""
        engine_id = request.preferred_decode_engine_id
        if engine_id is None or engine_id in self._dead_engine_ids:
            return -1, -1
        return self._cluster.decode_engine_id_to_place[engine_id]

    def _z_tokens(
        self,
        queue: deque[_PlacedOnPrefill],
        num_group_tokens: int,
        num_engines: int,
        num_free_blocks: int,
    ) -> float:
        """Steps (1)-(2): R = the queue's longest prefix that fits the group's free memory
        (ignoring fragmentation); Z = z_factor x (Σ_R len_r + Σ_e tok_e) / |E|."""
        num_r_tokens = 0
        num_r_blocks = 0
        for _, _, _, num_tokens, num_blocks in queue:
            num_r_blocks += num_blocks
            if num_r_blocks > num_free_blocks:
                break
            num_r_tokens += num_tokens
        return self._z_factor * (num_r_tokens + num_group_tokens) / num_engines


def _choose_decode_engine(
    engines: tuple[EngineSnapshot, ...],
    added_seqs: list[int],
    added_tokens: list[int],
    added_blocks: list[int],
    num_tokens: int,
    num_blocks: int,
    z_tokens: float,
) -> int:
    """Step (3) for one request, as an engine position: among the DEs with room, the least
    (``seq_e``, ``tok_e``, position) with ``tok_e + len_r <= Z``; else the least (``tok_e``,
    position); -1 when no DE has room (step 4). An engine's load is its snapshot's plus what
    this fetch has added (``added_*``, per position). One pass over the group's engines in position
    order (a strict ``<`` keeps the first of equal keys): a fetch ends with a failed search,
    so the failure must be cheap too, and E is a group's engines (16 on 8-GPU nodes)."""
    best = -1
    best_seqs = best_tokens = 0
    fallback = -1
    fallback_tokens = 0
    for position in range(len(engines)):
        engine = engines[position]
        if engine.num_free_kv_blocks - added_blocks[position] < num_blocks:
            continue
        engine_tokens = engine.num_tokens + added_tokens[position]
        if engine_tokens + num_tokens <= z_tokens:
            engine_seqs = engine.num_seqs + added_seqs[position]
            if (
                best < 0
                or engine_seqs < best_seqs
                or (engine_seqs == best_seqs and engine_tokens < best_tokens)
            ):
                best, best_seqs, best_tokens = position, engine_seqs, engine_tokens
        elif best < 0 and (fallback < 0 or engine_tokens < fallback_tokens):
            fallback, fallback_tokens = position, engine_tokens
    return best if best >= 0 else fallback


def _least_loaded_prefill_engine(engine_tokens: list[int], is_short_queue: list[bool]) -> int:
    """Algorithm 1's choice: the engine with the least ``tok_e`` in category A (short read
    queue: an idle short queue wastes an SNIC), else in B; equal ``tok_e`` goes to the engine
    listed first; -1 when both are empty. One pass over the group's engines."""
    best_short = best_long = -1
    short_tokens = long_tokens = 0
    for position in range(len(engine_tokens)):
        num_tokens = engine_tokens[position]
        if num_tokens < 0:
            continue  # over β
        if is_short_queue[position]:
            if best_short < 0 or num_tokens < short_tokens:
                best_short, short_tokens = position, num_tokens
        elif best_short < 0 and (best_long < 0 or num_tokens < long_tokens):
            best_long, long_tokens = position, num_tokens
    return best_short if best_short >= 0 else best_long

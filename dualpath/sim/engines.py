"""Simulated nodes and engines: plain state plus the decode engine's fluid step model.

* ``SimRequest`` -- one turn's request as it moves through the cluster (counts and times).
* ``SimNode`` -- a node's SNIC (read and write links), its FIFO storage read queue and, where
  writes share the SNIC with reads, its storage write queue.
* ``StorageService`` -- the store's aggregate read throughput, shared by the nodes reading.
* ``SimPrefillEngine`` / ``SimDecodeEngine`` -- one GPU each, with the load figures the group
  leader reports (``seq_e``, ``tok_e``, free KV blocks).
* ``PrefillGroup`` / ``DecodeGroup`` -- the engines and nodes of one scheduler group, which
  fetch together; an engine or node tells its group when its load changes.

Decode is modelled as a sequence of equal steps between membership changes (a *segment*): with
b sequences the step takes ``decode_step_s(b, context)``, so the next request to finish is
known without simulating every step. A request that joins mid-step starts at the next step
boundary (SPEC §6: a DE puts every running request into every decode step)::

    seg_start        boundary = seg_start + (k+1) * step_s
    |--step--|--step--|--step--|
                 ^ join at now: k = floor((now - seg_start) / step_s) steps done
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from heapq import heappop, heappush
from typing import Any, Final, Generic, TypeVar

from dualpath.scheduler import (
    EngineSnapshot,
    GroupSnapshot,
    LoadPlan,
    NodeSnapshot,
    PrefillBatcher,
)
from dualpath.sim.cost import CostModel
from dualpath.sim.events import EventPriority, EventQueue
from dualpath.sim.links import SimLink, TrafficClass

# An Enum member looked up on its class costs ~0.2 us; a module constant a few ns (Final: the
# compiled build keeps it in a C static instead of looking it up in the module's dict).
_STEP_DONE: Final = EventPriority.STEP_DONE
_KV: Final = TrafficClass.KV


class SimRequest:
    """One turn in flight. Times are seconds of simulated time; -1.0 = not yet."""

    __slots__ = (
        "request_id",
        "agent_index",
        "turn_index",
        "num_prompt_tokens",
        "num_hit_tokens",
        "num_output_tokens",
        "prefill_engine",
        "decode_engine",
        "load_plan",
        "num_pending_reads",
        "num_pending_kv",
        "num_pending_writes",
        "waiting_turn",
        "submit_s",
        "first_token_s",
        "decode_start_s",
        "finish_s",
        "finish_step",
        "num_decode_blocks",
        "num_context_tokens",
    )

    # Set at placement, read only after it: the PE at the PE fetch, the DE and the read plan
    # at the DE fetch.
    prefill_engine: SimPrefillEngine
    decode_engine: SimDecodeEngine
    load_plan: LoadPlan

    def __init__(
        self,
        request_id: int,
        agent_index: int,
        turn_index: int,
        num_prompt_tokens: int,
        num_hit_tokens: int,
        num_output_tokens: int,
        submit_s: float,
    ) -> None:
        self.request_id = request_id
        self.agent_index = agent_index
        self.turn_index = turn_index
        self.num_prompt_tokens = num_prompt_tokens
        self.num_hit_tokens = num_hit_tokens
        self.num_output_tokens = num_output_tokens
        self.num_pending_reads = 0
        self.num_pending_kv = 0  # PE->DE flows still moving, +1 until the prefill is done
        self.num_pending_writes = 0  # store writes of its blocks still moving (shared SNIC)
        # The agent's next turn, held until those writes end (``Simulator._enqueue``).
        self.waiting_turn: SimRequest | None = None
        self.submit_s = submit_s
        self.first_token_s = -1.0
        self.decode_start_s = -1.0
        self.finish_s = -1.0
        self.finish_step = 0
        self.num_decode_blocks = 0
        # Context the decode cost model charges: the prompt plus half the output (the mean).
        self.num_context_tokens = num_prompt_tokens + num_output_tokens // 2

    @property
    def num_new_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_hit_tokens


class StorageService:
    """The store's aggregate read throughput (e.g. 3FS's published 6.6 TiB/s), shared by the
    nodes that are reading: with k nodes reading, max-min fair sharing gives each node's SNIC
    read link min(its own rate, capacity / k) (every node's SNIC has the same rate, so the
    water-filling is an equal split, and a node with any read in flight uses its whole link).
    Only built where it can bind (capacity below the nodes' SNICs together); otherwise every
    link keeps its SNIC rate and nothing here runs."""

    __slots__ = ("capacity_bytes_per_s", "snic_bytes_per_s", "_reading", "_rate")

    def __init__(self, capacity_bytes_per_s: float, snic_bytes_per_s: float) -> None:
        if not 0 < capacity_bytes_per_s < math.inf or not 0 < snic_bytes_per_s < math.inf:
            raise ValueError(
                "the storage service and the SNICs need finite rates > 0, got "
                f"{capacity_bytes_per_s} and {snic_bytes_per_s} B/s"
            )
        self.capacity_bytes_per_s = capacity_bytes_per_s
        self.snic_bytes_per_s = snic_bytes_per_s
        self._reading: list[SimNode] = []  # nodes with a read in flight, in the order they began
        self._rate = snic_bytes_per_s  # every reading node's link rate now

    @property
    def num_reading(self) -> int:
        return len(self._reading)

    def start_reading(self, node: SimNode) -> None:
        """``node`` starts its first read in flight: call before the read's flow starts."""
        self._reading.append(node)
        self._share()
        if node.snic_read.capacity_bytes_per_s != self._rate:  # its share, if _share kept it
            node.snic_read.set_capacity(self._rate)

    def stop_reading(self, node: SimNode) -> None:
        """``node``'s last read in flight has ended."""
        self._reading.remove(node)
        self._share()

    def _share(self) -> None:
        share = self.capacity_bytes_per_s / float(len(self._reading) or 1)
        rate = share if share < self.snic_bytes_per_s else self.snic_bytes_per_s
        if rate != self._rate:
            self._rate = rate
            for node in self._reading:
                node.snic_read.set_capacity(rate)


class SimNode:
    """A node: SNIC links and a FIFO read queue with at most ``max_inflight_reads`` running;
    with a ``service``, its reads also share the store's throughput (``StorageService``).
    Writes (``write``) are flows on the read link: the one SNIC of a node whose reads and
    writes share a cap (``ClusterModel.is_snic_shared``)."""

    __slots__ = (
        "node_id",
        "node_index",
        "snic_read",
        "snic_write",
        "read_queue_tokens",
        "write_queue_tokens",
        "max_inflight_reads",
        "group",
        "service",
        "_num_inflight",
        "_waiting",
        "_snapshot",
    )

    group: EngineGroup  # the EngineGroup it belongs to, set when the group is built

    def __init__(
        self,
        node_id: int,
        node_index: int,
        snic_read: SimLink,
        snic_write: SimLink,
        max_inflight_reads: int,
    ) -> None:
        self.node_id = node_id
        self.node_index = node_index
        self.snic_read = snic_read
        self.snic_write = snic_write
        self.read_queue_tokens = 0  # read_q: tokens queued or being read (SPEC §6)
        self.write_queue_tokens = 0  # write_q: tokens being written (``write``)
        self.max_inflight_reads = max_inflight_reads
        self.service: StorageService | None = None
        self._num_inflight = 0
        self._waiting: deque[tuple[float, int, Callable[[Any], None], Any]] = deque()
        self._snapshot = NodeSnapshot(node_id, 0)

    def snapshot(self) -> NodeSnapshot:
        """The leader's report of this node (``read_q``, ``write_q``); see
        ``SimPrefillEngine.snapshot``."""
        snapshot = self._snapshot
        if (
            snapshot.read_queue_tokens != self.read_queue_tokens
            or snapshot.write_queue_tokens != self.write_queue_tokens
        ):
            snapshot = self._snapshot = NodeSnapshot(
                self.node_id, self.read_queue_tokens, self.write_queue_tokens
            )
        return snapshot

    def write(
        self, num_bytes: float, num_tokens: int, on_done: Callable[[Any], None], token: Any
    ) -> None:
        """Write ``num_bytes`` (``num_tokens`` of Full Blocks) to the store through the node's
        SNIC, next to its reads (one flow, shared max-min with the reads in flight), counted
        in ``write_q`` until written; then ``on_done(token)``."""
        self.write_queue_tokens += num_tokens
        self.group.snapshot = None  # its next report carries the new write_q
        self.snic_read.start(num_bytes, _KV, self._on_write_done, (num_tokens, on_done, token))

    def _on_write_done(self, entry: tuple[int, Callable[[Any], None], Any]) -> None:
        num_tokens, on_done, token = entry
        self.write_queue_tokens -= num_tokens
        self.group.snapshot = None
        on_done(token)

    def read(
        self, num_bytes: float, num_tokens: int, on_done: Callable[[Any], None], token: Any
    ) -> None:
        """Queue a storage read; ``on_done(token)`` when its bytes are in the host buffer."""
        self.read_queue_tokens += num_tokens
        self.group.snapshot = None  # its next report carries the new read_q
        if not self._waiting and self._num_inflight < self.max_inflight_reads:
            if self._num_inflight == 0 and self.service is not None:
                self.service.start_reading(self)  # (reads wait only behind reads in flight)
            self._start(num_bytes, num_tokens, on_done, token)  # _admit with a queue of one
            return
        self._waiting.append((num_bytes, num_tokens, on_done, token))
        self._admit()

    def _admit(self) -> None:
        while self._waiting and self._num_inflight < self.max_inflight_reads:
            self._start(*self._waiting.popleft())

    def _start(
        self, num_bytes: float, num_tokens: int, on_done: Callable[[Any], None], token: Any
    ) -> None:
        self._num_inflight += 1
        self.snic_read.start(num_bytes, _KV, self._on_read_done, (num_tokens, on_done, token))

    def _on_read_done(self, entry: tuple[int, Callable[[Any], None], Any]) -> None:
        num_tokens, on_done, token = entry
        self._num_inflight -= 1
        self.read_queue_tokens -= num_tokens
        self.group.snapshot = None
        if self._waiting:
            self._admit()  # the freed slot's next read: the node reads on without a pause
        elif self._num_inflight == 0 and self.service is not None:
            self.service.stop_reading(self)
        on_done(token)


class SimEngine:
    """What every simulated engine reports to its group leader: ``seq_e``, ``tok_e`` and free
    KV blocks (0 on a PE). The counts change only through ``change_load``, which drops the
    engine's cached snapshot and tells its group (``EngineGroup.changed_engines``): a fetch
    reports every engine of its group, most of them unchanged since the last fetch, and
    building a frozen snapshot costs more than reusing one."""

    __slots__ = (
        "engine_id",
        "node",
        "cnic",
        "group",
        "position",
        "_num_seqs",
        "_num_tokens",
        "_num_free_kv_blocks",
        "_snapshot",
    )

    def __init__(self, engine_id: int, node: SimNode, cnic: SimLink, num_kv_blocks: int) -> None:
        self.engine_id = engine_id
        self.node = node
        self.cnic = cnic
        # Its PrefillGroup / DecodeGroup, set when the group is built.
        self.group: EngineGroup | None = None
        self.position = 0  # its index among the group's engines (snapshot order)
        self._num_seqs = 0
        self._num_tokens = 0
        self._num_free_kv_blocks = num_kv_blocks
        self._snapshot: EngineSnapshot | None = None

    @property
    def num_seqs(self) -> int:
        """seq_e: assigned, unfinished requests."""
        return self._num_seqs

    @property
    def num_tokens(self) -> int:
        """tok_e: their tokens (prompt tokens on a PE, len_r on a DE)."""
        return self._num_tokens

    @property
    def num_free_kv_blocks(self) -> int:
        return self._num_free_kv_blocks

    def change_load(self, num_seqs: int, num_tokens: int, num_kv_blocks: int = 0) -> None:
        """Add a request (positive counts: sequences, tokens, KV blocks it takes) or remove
        one (negative counts)."""
        self._num_seqs += num_seqs
        self._num_tokens += num_tokens
        self._num_free_kv_blocks -= num_kv_blocks
        assert self._num_free_kv_blocks >= 0, f"engine {self.engine_id} over-committed its KV"
        group = self.group
        if group is not None:
            group.num_tokens += num_tokens
        if self._snapshot is not None:
            # The first change since the last snapshot: the group's next report rebuilds it.
            self._snapshot = None
            if group is not None:
                group.changed_engines.append(self)

    def snapshot(self) -> EngineSnapshot:
        """The leader's report of this engine (cached until the load changes)."""
        snapshot = self._snapshot
        if snapshot is None:
            snapshot = self._snapshot = EngineSnapshot(
                self.engine_id, self._num_seqs, self._num_tokens, self._num_free_kv_blocks
            )
        return snapshot


class SimPrefillEngine(SimEngine):
    """A PE: its batcher (the scheduler's ``PrefillBatcher``), CNIC and reported load."""

    __slots__ = ("batcher",)

    def __init__(self, engine_id: int, node: SimNode, batcher: PrefillBatcher, cnic: SimLink):
        super().__init__(engine_id, node, cnic, 0)
        self.batcher = batcher


class SimDecodeEngine(SimEngine):
    """A DE: KV blocks, CNIC, reported load and the fluid decode loop (module docstring)."""

    __slots__ = (
        "_queue",
        "_cost",
        "_on_finish",
        "_running",
        "_num_context_tokens",
        "_steps_done",
        "_segment_start_s",
        "_step_s",
        "_version",
        "num_steps",
    )

    def __init__(
        self,
        engine_id: int,
        node: SimNode,
        cnic: SimLink,
        num_kv_blocks: int,
        queue: EventQueue,
        cost: CostModel,
        on_finish: Callable[[SimRequest], None],
    ) -> None:
        super().__init__(engine_id, node, cnic, num_kv_blocks)
        self._queue = queue
        self._cost = cost
        self._on_finish = on_finish
        self._running: list[tuple[int, int, SimRequest]] = []  # (finish_step, id, request)
        self._num_context_tokens = 0
        self._steps_done = 0  # steps completed by _segment_start_s
        self._segment_start_s = 0.0
        self._step_s = 0.0
        self._version = 0
        self.num_steps = 0  # decode steps run, for reports

    def join(self, request: SimRequest) -> None:
        """Start decoding ``request`` at the next step boundary; it needs output - 1 steps
        (the prefill produced the first token)."""
        now_s = self._queue.now_s
        if self._running:
            segment_start_s = self._segment_start_s
            steps = math.floor((now_s - segment_start_s) / self._step_s)
            self._advance(segment_start_s + (steps + 1) * self._step_s, steps + 1)
        else:
            self._segment_start_s = now_s
        request.decode_start_s = self._segment_start_s
        finish_step = request.finish_step = self._steps_done + request.num_output_tokens - 1
        heappush(self._running, (finish_step, request.request_id, request))
        self._num_context_tokens += request.num_context_tokens
        self._reschedule()

    def _advance(self, boundary_s: float, num_steps: int) -> None:
        if num_steps > 0:
            self._steps_done += num_steps
            self.num_steps += num_steps
            self._segment_start_s = boundary_s

    def _reschedule(self) -> None:
        version = self._version = self._version + 1
        running = self._running
        if not running:
            return
        step_s = self._step_s = self._cost.decode_step_s(len(running), self._num_context_tokens)
        remaining = running[0][0] - self._steps_done
        # (``remaining if remaining > 0 else 0`` is max(0, remaining) without the call.)
        due_s = self._segment_start_s + (remaining if remaining > 0 else 0) * step_s
        self._queue.push(due_s, _STEP_DONE, self._on_due, version)

    def _on_due(self, version: int) -> None:
        if version != self._version:
            return
        running = self._running
        self._advance(self._queue.now_s, running[0][0] - self._steps_done)
        steps_done = self._steps_done
        finished = []
        while running and running[0][0] <= steps_done:
            request = heappop(running)[2]
            self._num_context_tokens -= request.num_context_tokens
            finished.append(request)
        self._reschedule()
        for request in finished:
            self._on_finish(request)


# The engine type of a group: typed lists let the compiled build (mypyc) read the engines'
# attributes and call their methods natively instead of through generic Python look-ups.
EngineT = TypeVar("EngineT", bound=SimEngine)


class EngineGroup(Generic[EngineT]):
    """The engines of one scheduler group (all PEs or all DEs): they fetch together.

    The group owns its engines (``engine.group``, ``engine.position``) and nodes
    (``node.group``) and keeps its last report (``simulator._group_snapshot``): a fetch
    rebuilds only the snapshots of the engines in ``changed_engines`` (``SimEngine.change_load``
    adds an engine there once per report), not all 16 of a full-size group, and reuses the
    whole report when neither an engine nor a node's ``read_q`` changed (``snapshot`` None)."""

    __slots__ = (
        "group_id",
        "engines",
        "nodes",
        "is_fetch_pending",
        "engine_snapshots",
        "changed_engines",
        "snapshot",
        "fetch_phase_s",
        "num_tokens",
    )

    def __init__(self, group_id: int, engines: list[EngineT], nodes: list[SimNode]):
        self.group_id = group_id
        self.engines = engines
        self.nodes = nodes
        self.is_fetch_pending = False
        for position, engine in enumerate(engines):
            engine.group = self
            engine.position = position
        for node in nodes:
            node.group = self
        # Per position, the engine's snapshot as the next report will send it, except for the
        # engines in changed_engines (their load changed since: rebuilt at the next report).
        self.engine_snapshots: list[EngineSnapshot] = [engine.snapshot() for engine in engines]
        self.changed_engines: list[EngineT] = []
        # The last report; None once a node's read_q changed.
        self.snapshot: GroupSnapshot | None = None
        self.fetch_phase_s = 0.0  # its leader fetches at fetch_phase_s + k * fetch_interval_s
        # Σ tok_e over its engines, kept by SimEngine.change_load (what a report would sum).
        self.num_tokens = sum(engine.num_tokens for engine in engines)

    def is_idle(self) -> bool:
        """No engine of the group holds a request."""
        return all(engine.num_seqs == 0 for engine in self.engines)


class PrefillGroup(EngineGroup[SimPrefillEngine]):
    """The PEs of one scheduler group: they also step in lockstep."""

    __slots__ = ("is_busy", "is_full", "num_awaiting_decode")

    def __init__(self, group_id: int, engines: list[SimPrefillEngine], nodes: list[SimNode]):
        super().__init__(group_id, engines, nodes)
        self.is_busy = False
        # Its last fetch placed nothing from a non-empty FIFO (Algorithm 1: every PE over β).
        self.is_full = False
        self.num_awaiting_decode = 0  # requests placed on its PEs, not yet on a DE

    def is_idle(self) -> bool:
        """No PE holds a request and no step runs."""
        return not self.is_busy and super().is_idle()


class DecodeGroup(EngineGroup[SimDecodeEngine]):
    """The DEs of one scheduler group."""

    __slots__ = ()

"""The cluster simulator: the real scheduler (``dualpath.scheduler``, unchanged) driving models
of engines, links and storage. ``run_simulation`` in ``runner.py`` builds one from names.

One request's life (SPEC §2, §6; the order of decisions of ``scheduler/dualpath_policy.py``)::

    send --front end (one turn after another)--> submit
      --PE fetch (Algorithm 1 / round robin)--> PE chosen
      --DE fetch (two phases)--> DE chosen, LoadPlan fixed, KV blocks reserved, reads start
      --storage reads (SNIC of the PE and/or DE node)--> ready on the PE (layer-wise modes)
      --PE step (PrefillBatcher batch, all PEs of the group in lockstep)--> first token
      --PE->DE KV (DE CNIC), DE buffer->HBM (DE CNIC)--> decode (fluid steps)
      --finish: blocks freed--> the agent's next turn

The DE persists the append's Full Blocks when the prompt KV is complete in its buffer and the
output's as they fill during decode (DE SNIC, SPEC §2).

In every mode but ``oracle`` storage reads start at DE placement and fill the host buffer
(SPEC §6, order of decisions; as the runtime does). Without layer-wise prefill (``basic``) a PE
holds whole requests' KV in HBM: its batch is capped by the HBM left for KV, and a step runs
the buffer -> HBM copy, then compute, then the send to the DEs, one after another (the GPUs of
a group in lockstep); with layer-wise prefill a step's per-layer loads overlap its compute and
the batch is capped by one layer's KV. ``oracle`` moves
no bytes at all. Leaders fetch on a ``fetch_interval_s`` grid when something may have changed
(a submit, a placement, an engine freeing work or memory), never on idle ticks; PE groups'
grids are staggered (group g of G at g/G of the interval), DE groups share one.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final

from dualpath.config import mode_settings
from dualpath.scheduler import (
    AttentionTimePredictor,
    EngineRole,
    FetchDriver,
    PrefillBatcher,
    PrefillWork,
    SchedulerRequest,
    make_scheduler,
)
from dualpath.sim.agents import AgentTrace
from dualpath.sim.cluster import ClusterModel, RequestRecord
from dualpath.sim.cost import CostModel
from dualpath.sim.engines import (
    DecodeGroup,
    EngineGroup,
    PrefillGroup,
    SimDecodeEngine,
    SimNode,
    SimPrefillEngine,
    SimRequest,
    StorageService,
)
from dualpath.sim.events import EventPriority, EventQueue
from dualpath.sim.fetch_ticks import SimFetches
from dualpath.sim.links import SimLink, TrafficClass
from dualpath.sim.prefill_step import HbmCappedPredictor

# An Enum member looked up on its class costs ~0.2 us; a module constant a few ns, and every
# request pushes several events (Final: the compiled build keeps them in C statics instead of
# looking them up in the module's dict).
_STEP_DONE: Final = EventPriority.STEP_DONE
_ARRIVAL: Final = EventPriority.ARRIVAL
_KV: Final = TrafficClass.KV

# Simulated seconds between two ``on_progress`` calls of ``Simulator.run``: ~300 updates on a
# paper-sized offline run, each a slice of the event loop (no event of its own).
PROGRESS_EVERY_S: Final = 10.0


class Simulator(SimFetches):
    """One simulated run. Not reusable: build, ``run()`` once, read the results."""

    def __init__(
        self,
        cluster: ClusterModel,
        agents: Sequence[AgentTrace],
        *,
        prefill_cost: CostModel,
        decode_cost: CostModel,
        attention_predictor: AttentionTimePredictor,
        num_prefill_layers: int,
    ) -> None:
        self.cluster = cluster
        self.agents = list(agents)
        # The agents' turns (prompt, hit, output tokens per turn) as the hot path reads them:
        # AgentTrace is not compiled, so each of its attributes costs a generic lookup.
        self._agent_turns = [
            (agent.prompt_tokens, agent.hit_tokens, agent.output_tokens) for agent in self.agents
        ]
        self.settings = mode_settings(cluster.mode)
        self.queue = EventQueue()
        self.scheduler = make_scheduler(cluster.scheduler, cluster.topology)
        self._prefill_cost = prefill_cost
        self._next_request_id = 0
        self._kv_bytes_per_token = cluster.kv_bytes_per_token
        self._block_size = cluster.scheduler.block_size_tokens
        self.records: list[RequestRecord] = []
        self.step_start_s: list[float] = []
        self.step_attention_max_s: list[float] = []
        self.step_attention_mean_s: list[float] = []
        self.agent_finish_s = [-1.0] * len(self.agents)
        self.num_turns = sum(len(turns[0]) for turns in self._agent_turns)
        self.num_submitted = 0
        self._requests_in_flight: dict[int, SimRequest] = {}
        # Per agent, its last finished request while store writes of its blocks still move
        # (shared SNIC only): the agent's next turn waits for them (``_enqueue``).
        self._persisting_by_agent: dict[int, SimRequest] = {}
        # The scheduler's num_waiting_prefill / num_waiting_decode, counted here from the
        # fetches' answers: the round-robin scheduler's and DualPath's decode count sum one
        # queue per group, and every fetch and decode finish asks.
        self._num_waiting_prefill = 0
        self._num_waiting_decode = 0
        self._fetch_interval_s = cluster.scheduler.fetch_interval_s
        self._turn_latency_s = cluster.turn_latency_s
        self._frontend_s_per_request = cluster.frontend_s_per_request
        self._frontend_free_s = 0.0  # when the front end finishes the last admitted turn
        self._sends_reach_scheduler_later = bool(
            self._frontend_s_per_request or self._turn_latency_s
        )
        # Algorithm 1 (the dualpath scheduler) places nothing on a group whose PEs are all
        # over β, however long the FIFO: see _fetch_prefill.
        self._skips_full_prefill_groups = cluster.scheduler.scheduler == "dualpath"
        # DE fetches that could place nothing send only the load they report: _fetch_decode.
        self._skips_idle_decode_fetches = True
        # Pending DE fetches by tick: see _fetch_at_tick.
        self._batches_decode_ticks = True
        self._decode_ticks: dict[float, deque[tuple[int, DecodeGroup]]] = {}
        self._build(attention_predictor, num_prefill_layers, decode_cost)
        # When each group fetches: the runtime's driver and idle rule (scheduler/fetching.py).
        self._fetch_driver: FetchDriver[EngineGroup] = FetchDriver(
            self.prefill_groups,
            self.decode_groups,
            fetch_when_idle=cluster.fetch_when_idle,
            fetch_now=self._fetch_now,
            fetch_at_tick=self._fetch_at_tick,
        )

    # --- construction ------------------------------------------------------------------------

    def _link(self, name: str, rate: float, window: bool = False) -> SimLink:
        c = self.cluster
        if self.settings.is_io_free:
            rate = float("inf")  # oracle: every movement is free
        return SimLink(
            name,
            rate,
            self.queue,
            inference_weight=c.inference_weight,
            kv_weight=c.kv_weight,
            window_s=c.snic_window_s if window else None,
        )

    def _build(
        self, predictor: AttentionTimePredictor, num_layers: int, decode_cost: CostModel
    ) -> None:
        c = self.cluster
        config = c.scheduler
        layers_held = 1 if self.settings.is_layerwise else num_layers
        self.nodes: list[SimNode] = []
        node_id_to_node = {}
        for index, spec in enumerate(c.topology.nodes):
            node = SimNode(
                spec.node_id,
                index,
                self._link(f"node{spec.node_id}.snic.read", c.snic_read_bytes_per_s, True),
                self._link(f"node{spec.node_id}.snic.write", c.snic_write_bytes_per_s, True),
                c.max_inflight_reads_per_node,
            )
            self.nodes.append(node)
            node_id_to_node[spec.node_id] = node
        snic_rate = self.nodes[0].snic_read.capacity_bytes_per_s if self.nodes else math.inf
        if c.storage_service_bytes_per_s < len(self.nodes) * snic_rate < math.inf:
            # The store can bind (on hopper-8x400 only above 168 nodes): its rate is
            # shared by the nodes reading.
            service = StorageService(c.storage_service_bytes_per_s, snic_rate)
            for node in self.nodes:
                node.service = service
        self.engines: dict[int, SimPrefillEngine | SimDecodeEngine] = {}
        # The same engines by role, for the placements (which store them on the request).
        self._prefill_engines: dict[int, SimPrefillEngine] = {}
        self._decode_engines: dict[int, SimDecodeEngine] = {}
        self.prefill_groups: list[PrefillGroup] = []
        self.decode_groups: list[DecodeGroup] = []
        for group in c.topology.groups:
            nodes = [node_id_to_node[n] for n in group.node_ids]
            prefill_engines: list[SimPrefillEngine] = []
            decode_engines: list[SimDecodeEngine] = []
            for node_spec in (c.topology.nodes[node.node_index] for node in nodes):
                node = node_id_to_node[node_spec.node_id]
                for engine_id in node_spec.engine_ids:
                    cnic = self._link(f"engine{engine_id}.cnic", c.cnic_bytes_per_s)
                    engine: SimPrefillEngine | SimDecodeEngine
                    if group.role == EngineRole.PREFILL:
                        capped = HbmCappedPredictor(
                            predictor,
                            self._kv_bytes_per_token * layers_held / num_layers,
                            c.prefill_kv_capacity_bytes,
                            config.attention_quota_s,
                        )
                        # Cuts at Full Block boundaries, as the engine does.
                        batcher = PrefillBatcher.from_config(
                            config, capped, chunk_align_tokens=self._block_size
                        )
                        engine = self._prefill_engines[engine_id] = SimPrefillEngine(
                            engine_id, node, batcher, cnic
                        )
                        prefill_engines.append(engine)
                    else:
                        engine = self._decode_engines[engine_id] = SimDecodeEngine(
                            engine_id,
                            node,
                            cnic,
                            c.num_decode_kv_blocks,
                            self.queue,
                            decode_cost,
                            self._on_decode_finish,
                        )
                        decode_engines.append(engine)
                    self.engines[engine_id] = engine
            if group.role == EngineRole.PREFILL:
                prefill_group = PrefillGroup(group.group_id, prefill_engines, nodes)
                self.prefill_groups.append(prefill_group)
            else:
                decode_group = DecodeGroup(group.group_id, decode_engines, nodes)
                self.decode_groups.append(decode_group)

        # NOTE(sim): PE leaders fetch at staggered phases, as independent timers would: group g
        # of G at g/G of the interval. On one shared grid every tick ran them in group order,
        # and Algorithm 1 lets the fetching group take the FIFO's head up to β, so the first
        # groups filled while the last idled (8P16D 1.09x 2P4D's JCT at --scale-down 8, 1.35x
        # at full size). DE leaders stay on the grid: phase 1 sends each request to the
        # least-loaded DE group whoever fetches (docs/simulator-analysis.md, "Scale").
        interval_s = config.fetch_interval_s
        for index, prefill_group in enumerate(self.prefill_groups):
            prefill_group.fetch_phase_s = interval_s * index / len(self.prefill_groups)

    # --- the run -----------------------------------------------------------------------------

    def run(
        self,
        until_s: float = float("inf"),
        on_progress: Callable[[float, int], None] | None = None,
    ) -> None:
        """Replay every agent to its last turn, or stop at ``until_s`` (an online probe);
        requests still in flight then stay in ``requests_in_flight``.

        ``on_progress(now_s, num_finished_turns)`` is called after every
        ``PROGRESS_EVERY_S`` of simulated time that holds an event (a progress bar); the
        run is the same with or without it: the queue runs the same events in the same
        order, in slices."""
        for index, agent in enumerate(self.agents):
            self.queue.push(agent.arrival_s, EventPriority.ARRIVAL, self._submit_turn, (index, 0))
        # NOTE(sim): the run makes no reference cycles (a collection after a whole run finds
        # nothing), yet the cyclic collector would traverse every live object, millions of
        # records and requests on a large cluster, again and again: ~10% of 8P16D's CPU. It
        # is off during the run and back as it was after.
        was_collecting = gc.isenabled()
        gc.disable()
        try:
            if on_progress is None:
                self.queue.run(until_s)
            else:
                queue = self.queue
                while (next_s := queue.next_time_s()) <= until_s and len(queue):
                    queue.run(min(until_s, next_s + PROGRESS_EVERY_S))
                    on_progress(queue.now_s, len(self.records))
        finally:
            if was_collecting:
                gc.enable()
        if until_s == float("inf"):
            unfinished = [i for i, t in enumerate(self.agent_finish_s) if t < 0]
            assert not unfinished, f"agents {unfinished[:5]} never finished: the simulation stalled"

    @property
    def requests_in_flight(self) -> list[SimRequest]:
        """Submitted, unfinished requests (empty after a complete run)."""
        return list(self._requests_in_flight.values())

    def _submit_turn(self, entry: tuple[int, int]) -> None:
        agent_index, turn = entry
        prompt_tokens, hit_tokens, output_tokens = self._agent_turns[agent_index]
        request = SimRequest(
            self._next_request_id,
            agent_index,
            turn,
            prompt_tokens[turn],
            hit_tokens[turn],
            output_tokens[turn],
            self.queue.now_s,
        )
        self._next_request_id += 1
        self.num_submitted += 1
        self._requests_in_flight[request.request_id] = request
        now_s = self.queue.now_s
        admitted_s = now_s
        if self._frontend_s_per_request:
            # One front end admits turns in the order they were sent: a burst (every agent of
            # an offline run at t = 0) reaches the scheduler over N x the service time.
            admitted_s = max(now_s, self._frontend_free_s) + self._frontend_s_per_request
            self._frontend_free_s = admitted_s
        admitted_s += self._turn_latency_s
        if admitted_s > now_s:
            self.queue.push(admitted_s, EventPriority.ARRIVAL, self._enqueue, request)
        else:
            self._enqueue(request)

    def _enqueue(self, request: SimRequest) -> None:
        """The turn reaches the scheduler's FIFO; the PE groups are asked to fetch. A turn whose
        hit includes blocks its agent's last request is still writing waits until they are
        written (the runtime's scheduler waits for the DE's ``KVPersisted``, rather than
        placing the turn with a short hit: ``cluster/persisting.py``)."""
        persisting = self._persisting_by_agent.get(request.agent_index)
        if persisting is not None:
            persisting.waiting_turn = request
            return
        self.scheduler.submit(
            SchedulerRequest(
                request.request_id,
                request.num_prompt_tokens,
                request.num_hit_tokens,
                request.num_output_tokens,
            )
        )
        self._num_waiting_prefill += 1
        self._fetch_driver.wake_prefill()

    # --- storage reads -----------------------------------------------------------------------

    def _start_reads(self, request: SimRequest) -> None:
        plan = request.load_plan
        if self.settings.is_io_free or plan.num_hit_blocks == 0:
            self._on_ready(request)
            return
        block_bytes = self._block_size * self._kv_bytes_per_token
        for node, num_blocks in (
            (request.prefill_engine.node, plan.num_prefill_side_blocks),
            (request.decode_engine.node, plan.num_decode_side_blocks),
        ):
            if num_blocks:
                request.num_pending_reads += 1
                node.read(
                    num_blocks * block_bytes,
                    num_blocks * self._block_size,
                    self._on_read_done,
                    request,
                )

    def _on_read_done(self, request: SimRequest) -> None:
        request.num_pending_reads -= 1
        if request.num_pending_reads == 0:
            self._on_ready(request)

    def _on_ready(self, request: SimRequest) -> None:
        engine = request.prefill_engine
        if self.settings.is_layerwise:
            request.num_pending_kv = 1  # the prefill itself; sends add their own
        engine.batcher.add(
            PrefillWork(request.request_id, request.num_hit_tokens, request.num_new_tokens)
        )
        group = engine.group
        assert isinstance(group, PrefillGroup)  # (for the type checker)
        if not group.is_busy:
            group.is_busy = True  # claimed now; the step starts as its own event
            self.queue.push(self.queue.now_s, _STEP_DONE, self._start_step, group)

    # --- PE -> DE, decode --------------------------------------------------------------------

    def _on_kv_arrived(self, request: SimRequest) -> None:
        request.num_pending_kv -= 1
        if request.num_pending_kv > 0 or request.first_token_s < 0:
            return
        # SPEC §2: the prompt's KV is complete in the DE buffer; the DE persists the prompt's
        # Full Blocks the store does not hold yet (the append's).
        block = self._block_size
        self._persist(request, request.num_prompt_tokens // block - request.num_hit_tokens // block)
        if self.cluster.handoff_s > 0:
            self.queue.push(
                self.queue.now_s + self.cluster.handoff_s,
                EventPriority.STEP_DONE,
                request.decode_engine.join,
                request,
            )
        else:
            request.decode_engine.join(request)

    def _persist(self, request: SimRequest, num_blocks: int, since_s: float | None = None) -> None:
        """Write ``num_blocks`` Full Blocks to the store through the DE node's SNIC.

        On a shared SNIC (``ClusterModel.is_snic_shared``) they are a flow from now on, next
        to the node's reads, and count in its write_q until written. Otherwise they are only
        counted, spread over [``since_s``, now]. NOTE(sim): on a full-duplex SNIC the writes
        take no bandwidth (``count_unpaced``): a turn writes its append and output, ~3% of the
        bytes it reads, in the other direction."""
        if num_blocks > 0 and not self.settings.is_io_free:
            num_bytes = num_blocks * self._block_size * self._kv_bytes_per_token
            node = request.decode_engine.node
            if self.cluster.is_snic_shared:
                request.num_pending_writes += 1
                node.write(num_bytes, num_blocks * self._block_size, self._on_written, request)
            else:
                node.snic_write.count_unpaced(num_bytes, _KV, since_s)

    def _on_written(self, request: SimRequest) -> None:
        """One of ``request``'s store writes ended; after its last, the agent's next turn goes
        on to the scheduler if it was waiting for them."""
        request.num_pending_writes -= 1
        if request.num_pending_writes == 0 and request.finish_s >= 0:
            del self._persisting_by_agent[request.agent_index]
            waiting = request.waiting_turn
            if waiting is not None:
                request.waiting_turn = None
                self._enqueue(waiting)

    def _on_decode_finish(self, request: SimRequest) -> None:
        now_s = self.queue.now_s
        request.finish_s = now_s
        engine = request.decode_engine
        engine.change_load(
            -1,
            -(request.num_prompt_tokens + request.num_output_tokens),
            -request.num_decode_blocks,
        )
        # SPEC §2: during decode every block that fills is persisted; the steps run at an even
        # pace, so the output's blocks are spread over the decode (the last token has no KV;
        # on a shared SNIC they are written now, as one flow).
        block = self._block_size
        num_tokens_with_kv = request.num_prompt_tokens + request.num_output_tokens - 1
        num_output_blocks = num_tokens_with_kv // block - request.num_prompt_tokens // block
        self._persist(request, num_output_blocks, request.decode_start_s)
        if request.num_pending_writes:
            self._persisting_by_agent[request.agent_index] = request
        del self._requests_in_flight[request.request_id]
        self.records.append(
            RequestRecord(
                request.agent_index,
                request.turn_index,
                request.submit_s,
                request.first_token_s,
                request.decode_start_s,
                now_s,
                request.num_output_tokens,
            )
        )
        if self._num_waiting_decode:
            decode_group = engine.group
            assert isinstance(decode_group, DecodeGroup)  # (for the type checker)
            self._fetch_driver.request_fetch(decode_group)
        next_turn = request.turn_index + 1
        if next_turn < len(self._agent_turns[request.agent_index][0]):  # (a prompt per turn)
            if self._sends_reach_scheduler_later:
                # The send only creates the request and queues it at the front end, whose
                # order is the order of the sends either way: made here, it saves one event a
                # turn (~10% of a run's), and the scheduler still sees the turn later.
                self._submit_turn((request.agent_index, next_turn))
            else:
                self.queue.push(
                    now_s, _ARRIVAL, self._submit_turn, (request.agent_index, next_turn)
                )
        else:
            self.agent_finish_s[request.agent_index] = now_s

"""The scheduler process: places requests on (PE, DE) pairs and relays the engines' messages.

It runs the pure policy of ``dualpath.scheduler`` unchanged, and is made of three parts that
this class wires together and feeds from one control socket:

* ``membership.Membership``: engines joining, liveness, and sending to them;
* ``fetches.GroupFetches``: the groups' loads from the engines' reports, and their fetches
  (SPEC §6) through the fetch driver the simulator runs too (``scheduler/fetching.py``);
* ``lifecycle.RequestLifecycle``: each request from submit to its last token: placement,
  relays, persist waits, events, re-placement after an engine's loss (SPEC §8).

::

    coordinator = Coordinator(cluster_config, scheduler_config, identity, store, token,
                              storage_read_tokens_per_s=...)
    request_id = coordinator.submit(prompt_token_ids, params)   # thread-safe
    coordinator.run_once(timeout_s=0.01)                          # in the serving loop
    for event in coordinator.drain_events(): ...                 # tokens, finishes, failures

An engine silent for ``heartbeat_timeout_s`` (no message from its loop and no heartbeat from
its heartbeat thread), or whose process this host saw exit, is declared dead: the policy never
chooses it again, and its requests are placed again or fail (``lifecycle``). An engine whose
heartbeats say it has been in one step for longer than that is busy, not dead
(``ClusterSnapshot.busy_engines``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dualpath.cluster.fetches import GroupFetches
from dualpath.cluster.hits import PromptHits
from dualpath.cluster.lifecycle import RequestLifecycle
from dualpath.cluster.membership import EngineState, Membership
from dualpath.cluster.pairing import Pairing
from dualpath.cluster.persisting import PersistingBlocks
from dualpath.cluster.request_state import RequestState
from dualpath.cluster.sessions import Sessions
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.control.channel import ControlServer
from dualpath.kv.store import KVStore
from dualpath.model.identity import KVIdentity
from dualpath.protocol import (
    DECODE,
    PREFILL,
    DecodeReady,
    EngineHeartbeat,
    EngineInfo,
    EngineReport,
    KVPersisted,
    PrefillDone,
    PrefillHeld,
    RequestEvent,
    RequestFailed,
    Shutdown,
    TokenUpdate,
)
from dualpath.scheduler import make_cluster_topology, make_scheduler
from dualpath.types import NO_SCOPE, RequestScope, SamplingParams

logger = logging.getLogger(__name__)

# handler(client_id, msg, now_s) for a message from a client that has no live engine yet.
JoinHandler = Callable[[str, object, float], None]
# handler(engine, msg, now_s) for a message from a live engine's client.
EngineHandler = Callable[[EngineState, object, float], None]


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """The scheduler's state at one instant, taken on the loop thread (so self-consistent).

    Readers on other threads (health checks, metrics) use this instead of the coordinator,
    whose state only the loop thread may touch. ``LocalCluster`` republishes one every ``SNAPSHOT_INTERVAL_S``.
    """

    time_s: float  # time.monotonic() when taken
    num_live_engines: int
    num_expected_engines: int
    num_waiting_prefill: int  # in the scheduler's FIFO, not placed on a PE yet
    num_waiting_decode: int  # placed on a PE, waiting for a DE
    num_assigned: int  # requests sent to a (PE, DE) pair since the start
    # Of those, requests sent to their DE alone, which prefilled them (``local_prefill_tokens``).
    num_local_prefills: int = 0
    # Requests that waited for blocks a DE was still writing (see cluster.persisting), and
    # finished requests whose writes were never confirmed in time; both since the start.
    num_persist_waits: int = 0
    num_persist_expired: int = 0
    # Requests placed again after losing an engine (SPEC §8); requests failed because no
    # engine of a role they needed was alive; and, over the re-placements that produced a
    # token since, the time from the engine's loss to that token (count, sum, maximum).
    num_replaced: int = 0
    num_failed_unavailable: int = 0
    num_replacement_delays: int = 0
    replacement_delay_s_sum: float = 0.0
    replacement_delay_s_max: float = 0.0
    # Each stage of first placements' first-token path (``first_token.py``): stage ->
    # (count, sum of seconds), since the start.
    first_token_stages: dict[str, tuple[int, float]] = field(default_factory=dict)
    # Engine and group load reports received (each a fetch when sent by a group's leader).
    num_reports: int = 0
    # engine id -> cumulative bytes by "link.class" (e.g. "node0.snic.kv"), plus
    # "store_read_bytes" (hit KV the engine read from the store); empty until it reports.
    link_bytes: dict[int, dict[str, int]] = field(default_factory=dict)
    # Live engines by role ("prefill", "decode"), and the engines declared dead (id -> why).
    num_live_engines_by_role: dict[str, int] = field(default_factory=dict)
    dead_engines: dict[int, str] = field(default_factory=dict)
    # How often each engine was declared dead (exited, went silent, or joined again as a new
    # process before either was seen): id -> count, for engines that ever died.
    engine_deaths: dict[int, int] = field(default_factory=dict)
    # Engines this host started again after they died: id -> how often (the launcher's).
    engine_restarts: dict[int, int] = field(default_factory=dict)
    # Requests in flight that each engine's loss would place again (a DE's from assignment
    # to the last token, a PE's until prefilled): engine id -> count, engines holding any.
    engine_id_to_num_requests: dict[int, int] = field(default_factory=dict)
    # Live engines that are vLLM servers (``dualpath vllm-config``): id -> OpenAI URL.
    engine_urls: dict[int, str] = field(default_factory=dict)
    # Live engines whose heartbeats say they have been in one step (a prefill batch, a decode
    # step) for longer than the heartbeat timeout: id -> its time so far (s). Busy, not dead.
    busy_engines: dict[int, float] = field(default_factory=dict)
    # Why no request can be served (no live engine of a role, or the scheduler loop died), or
    # None when requests can be served (or engines are still joining).
    unavailable_reason: str | None = None
    # Agent sessions seen within the retention time, and the placements of session requests
    # by outcome ("first", "same_de", "moved": ``cluster.sessions``), since the start.
    num_active_sessions: int = 0
    session_affinity: dict[str, int] = field(default_factory=dict)

    @property
    def is_ready(self) -> bool:
        return self.num_live_engines == self.num_expected_engines


class Coordinator:
    def __init__(
        self,
        cluster: ClusterConfig,
        scheduler_config: SchedulerConfig,
        identity: KVIdentity,
        store: KVStore | None,
        token: str,
        *,
        storage_read_tokens_per_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.identity = identity
        self.clock = clock
        self.topology = make_cluster_topology(
            num_prefill_nodes=cluster.num_prefill_nodes,
            num_decode_nodes=cluster.num_decode_nodes,
            storage_read_tokens_per_s=storage_read_tokens_per_s,
            engines_per_node=cluster.engines_per_node,
            nodes_per_group=cluster.nodes_per_group,
        )
        self.policy = make_scheduler(scheduler_config, self.topology)
        self.store = store
        self.server = ControlServer(cluster.control_endpoint, token)
        self.endpoint = self.server.endpoint
        self.membership = Membership(
            self.topology,
            self.server,
            heartbeat_timeout_s=cluster.heartbeat_timeout_s,
            clock=clock,
            kv_fingerprint=identity.fingerprint,
        )
        self.persisting: PersistingBlocks[RequestState] = PersistingBlocks(
            cluster.persist_wait_s if store is not None else 0.0
        )
        self.fetches = GroupFetches(self.policy, self.topology, self.membership.engine_id_to_node)
        self.requests = RequestLifecycle(
            self.membership,
            PromptHits(store, identity),
            self.persisting,
            place=self.fetches.submit,
            suspect=self.fetches.suspect,
            retry_after_s=cluster.heartbeat_timeout_s,
            sessions=Sessions(cluster.session_retention_s),
            pairing=Pairing(
                self.membership.engines,
                block_size=identity.layout.block_size_tokens,
                local_prefill_tokens=cluster.local_prefill_tokens,
            ),
        )
        self.fetches.assign = self.requests.assign
        lifecycle = self.requests
        self._join_handlers: dict[type, JoinHandler] = {EngineInfo: self._on_engine_info}
        self._engine_handlers: dict[type, EngineHandler] = {
            EngineHeartbeat: lambda engine, msg, now_s: self.membership.on_heartbeat(
                engine, msg.step_s
            ),
            EngineReport: lambda engine, msg, now_s: self.fetches.on_report(
                engine.info.engine_id,
                msg,  # the sender's id, whatever the report says
            ),
            DecodeReady: lambda engine, msg, now_s: lifecycle.on_decode_ready(msg, now_s),
            PrefillHeld: lambda engine, msg, now_s: lifecycle.relay(
                msg.request_id, msg, to_prefill=False
            ),
            PrefillDone: lambda engine, msg, now_s: lifecycle.on_prefill_done(msg, now_s),
            TokenUpdate: lambda engine, msg, now_s: lifecycle.on_tokens(msg, now_s),
            KVPersisted: lambda engine, msg, now_s: lifecycle.on_persisted(msg),
            RequestFailed: lambda engine, msg, now_s: lifecycle.on_failed(msg, now_s),
        }

    # --- the serving side (any thread) ------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        scope: RequestScope = NO_SCOPE,
    ) -> int:
        """Queue a request (token ids already validated); returns its id. Thread-safe: the
        loop's wait ends (``wake``)."""
        request_id = self.requests.submit(prompt_token_ids, params, scope)
        self.server.wake()
        return request_id

    def wake(self) -> None:
        """End the loop's wait in ``run_once`` now (any thread): work is queued for it."""
        self.server.wake()

    def cancel(self, request_id: int) -> None:
        """Stop a request (the caller's id) wherever it is (the loop thread)."""
        self.requests.cancel(request_id)

    def drain_events(self) -> list[RequestEvent]:
        return self.requests.drain_events()

    def placement(self, request_id: int) -> tuple[int | None, int | None] | None:
        return self.requests.placement(request_id)

    def on_engine_exited(self, engine_id: int, exit_code: int) -> None:
        self.membership.on_engine_exited(engine_id, exit_code)
        self.server.wake()

    def on_engine_unreachable(self, engine_id: int, why: str) -> None:
        """A vLLM server engine's HTTP connection failed (any thread): it is declared dead at
        the loop's next turn; it joins again when its connector reports."""
        self.membership.on_engine_unreachable(engine_id, why)
        self.server.wake()

    @property
    def num_expected_engines(self) -> int:
        return self.membership.num_expected_engines

    @property
    def num_live_engines(self) -> int:
        return self.membership.num_live_engines

    def num_live_engines_of(self, role: str) -> int:
        return self.membership.num_live_engines_of(role)

    def is_ready(self) -> bool:
        return self.membership.is_ready()

    @property
    def unavailable_reason(self) -> str | None:
        return self.membership.unavailable_reason

    def dead_engines(self) -> dict[int, str]:
        return self.membership.dead_engines()

    @property
    def num_assigned(self) -> int:
        return self.requests.num_assigned

    @property
    def num_replaced(self) -> int:
        return self.requests.num_replaced

    @property
    def num_reports(self) -> int:
        return self.fetches.num_reports

    def link_bytes(self) -> dict[int, dict[str, int]]:
        """Latest cumulative link byte counters reported by each engine that joined."""
        return self.fetches.link_bytes(list(self.membership.engines))

    def snapshot(self, now_s: float) -> ClusterSnapshot:
        """The state readers on other threads see (the loop thread takes it)."""
        policy = self.policy
        return ClusterSnapshot(
            time_s=now_s,
            num_live_engines=self.num_live_engines,
            num_expected_engines=self.num_expected_engines,
            num_waiting_prefill=policy.num_waiting_prefill,
            num_waiting_decode=policy.num_waiting_decode,
            num_assigned=self.num_assigned,
            num_local_prefills=self.requests.pairing.num_local,
            num_persist_waits=self.persisting.num_waits,
            num_persist_expired=self.persisting.num_expired,
            num_replaced=self.num_replaced,
            num_failed_unavailable=self.requests.num_failed_unavailable,
            num_replacement_delays=self.requests.replacement_delays.count,
            replacement_delay_s_sum=self.requests.replacement_delays.sum_s,
            replacement_delay_s_max=self.requests.replacement_delays.max_s,
            first_token_stages=self.requests.first_token.totals(),
            num_reports=self.num_reports,
            link_bytes=self.link_bytes(),
            num_live_engines_by_role={
                role: self.num_live_engines_of(role) for role in (PREFILL, DECODE)
            },
            dead_engines=self.dead_engines(),
            engine_deaths=dict(self.membership.engine_deaths),
            engine_id_to_num_requests=self.requests.num_requests_by_engine(),
            engine_urls=self.membership.engine_urls(),
            busy_engines=self.membership.busy_engines(),
            unavailable_reason=self.unavailable_reason,
            num_active_sessions=self.requests.sessions.num_active(now_s),
            session_affinity=dict(self.requests.sessions.outcome_to_num_placements),
        )

    # --- the loop (one thread) --------------------------------------------------------------

    def run_once(self, timeout_s: float) -> None:
        """Take submissions, handle the engines' messages, fetch for idle groups, check
        liveness."""
        for engine_id, why in self.membership.exited_engines():
            self._declare_dead(engine_id, why)
        self.requests.take_submitted()
        for client_id, msg in self.server.receive(timeout_s):  # each handled, then dropped
            self._handle(client_id, msg)
        membership = self.membership
        membership.has_been_ready = membership.has_been_ready or membership.is_ready()
        self.fetches.fetch_due()
        membership.check_liveness(self._declare_dead)
        self.requests.release_due()
        membership.announce_peers()

    def _handle(self, client_id: str, msg: object) -> None:
        now_s = self.clock()
        join = self._join_handlers.get(type(msg))
        if join is not None:
            join(client_id, msg, now_s)
            return
        engine = self.membership.sender(client_id, now_s)
        if engine is None:
            # (A heartbeat may overtake its engine's EngineInfo: another socket.)
            if not isinstance(msg, EngineHeartbeat):
                logger.warning("ignoring %s from unregistered %s", type(msg).__name__, client_id)
            return
        handler = self._engine_handlers.get(type(msg))
        if handler is None:
            logger.warning("unexpected %s from %s", type(msg).__name__, client_id)
            return
        handler(engine, msg, now_s)

    def _on_engine_info(self, client_id: str, info: EngineInfo, now_s: float) -> None:
        membership = self.membership
        if membership.is_alive(info.engine_id) and membership.topology_problem(info) is None:
            # An engine says who it is once, when it starts: its earlier process is gone,
            # before its silence was noticed (a quick restart). What that one held is placed
            # again first; its client, which the new process speaks through, stays welcome.
            self._declare_dead(
                info.engine_id, "it joined again: its earlier process is gone", forget_client=False
            )
        if membership.register(client_id, info, now_s):
            self.fetches.engine_joined(info.engine_id)

    def _declare_dead(self, engine_id: int, why: str, *, forget_client: bool = True) -> None:
        state = self.membership.declare_dead(engine_id, why, forget_client=forget_client)
        # Requests only queued for it (not yet sent to any engine) first, so that the policy
        # places nothing more on it.
        self.fetches.engine_lost(engine_id)
        self.requests.engine_lost(engine_id, f"engine {engine_id} ({state.info.role}) died: {why}")

    def shutdown(self, reason: str = "cluster stopping") -> None:
        self.membership.broadcast(Shutdown(reason))

    def close(self) -> None:
        self.server.close()
        if self.store is not None:
            self.store.close()

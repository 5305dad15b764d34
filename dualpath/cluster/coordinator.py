"""The scheduler process: places requests on (PE, DE) pairs and relays the engines' messages.

It runs the pure policy of ``dualpath.scheduler`` unchanged. Engine group leaders pull: a
``GroupReport`` from a group's leader, or an ``EngineReport`` from a group's leading engine, is
that group's fetch (SPEC §6), answered with ``Assignment``s once a request's pair and read plan
are fixed. Engines that speak for themselves report individually and the group snapshot is
assembled from their latest reports; a leader that speaks for its group (``GroupInfo``, then
``GroupReport``s) sends them all at once, and receives everything meant for its engines
(``dualpath.protocol`` has the protocol).

    coordinator = Coordinator(cluster_config, scheduler_config, identity, store_root, token)
    request_id = coordinator.submit(prompt_token_ids, params)   # thread-safe
    coordinator.run_once(timeout_s=0.01)                          # in the serving loop
    for event in coordinator.drain_events(): ...                 # tokens, finishes, failures

An engine that stops reporting for ``heartbeat_timeout_s`` is declared dead (checked once per
heartbeat period, ``heartbeat_timeout_s / 4``): the policy sees it as overloaded (a PE above
beta, a DE with no free memory) so nothing more is placed on it. Its requests that have not
produced a token yet are placed again (SPEC §8), at most ``MAX_PLACEMENTS`` times in all, under
a fresh internal id so that a late message about the lost attempt finds nothing; the caller
keeps its id. So are those a PE gave up on because their DE failed mid-transfer
(``RequestFailed.is_retryable``), which a PE may notice before the heartbeat does. Those
already streaming fail with a message that names the engine (their output so far cannot be
taken back).

A request whose hit prefix stops at a block a DE is still writing (an agent's next turn, sent
the moment the last one finished) waits for that write rather than being placed with a short
hit (``dualpath.cluster.persisting``).
"""

from __future__ import annotations

import array
import contextlib
import itertools
import logging
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from dualpath.cluster.group_load import GroupLoad
from dualpath.cluster.persisting import PersistingBlocks
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.control.channel import ControlServer
from dualpath.control.codec import encode
from dualpath.errors import KVStoreError, PeerUnavailable
from dualpath.kv.hashing import BlockKey, block_keys
from dualpath.kv.store import FileKVStore, KVStore
from dualpath.model.identity import KVIdentity
from dualpath.protocol import (
    DECODE,
    PREFILL,
    Assignment,
    CancelRequest,
    DecodeReady,
    EngineInfo,
    EngineReport,
    GroupInfo,
    GroupReport,
    Heartbeat,
    KVPersisted,
    PeerTable,
    PrefillDone,
    RequestEvent,
    RequestFailed,
    Shutdown,
    TokenUpdate,
    pack_token_ids,
)
from dualpath.scheduler import (
    EngineRole,
    SchedulerRequest,
    make_cluster_topology,
    make_scheduler,
)
from dualpath.types import SamplingParams, sampling_params_to_dict

logger = logging.getLogger(__name__)

# How many times one request may be placed: the first placement and re-placements after the
# loss of an engine (a request that keeps landing on dying engines fails in the end).
MAX_PLACEMENTS = 3


@dataclass
class _RequestState:
    request_id: int  # this placement's (see ``client_request_id``)
    # The id the caller knows; it differs from ``request_id`` after a re-placement, so that
    # messages about an abandoned placement match nothing.
    client_request_id: int
    prompt_token_ids: array.array  # packed once at submit; the Assignment carries it as is
    params: SamplingParams
    sampling: dict[str, Any]  # sampling_params_to_dict(params), made on the submitting thread
    num_cached_tokens: int
    # Keys of the prompt's full blocks (all but its last token), hashed at submit; kept only
    # until the request is queued for placement (see ``_enqueue``).
    block_keys: list[BlockKey] | None = None
    prefill_engine_id: int | None = None
    decode_engine_id: int | None = None
    is_prefill_done: bool = False  # the first token was sent out: no re-placement from here
    num_placements: int = 1


@dataclass
class _Client:
    """A control client that speaks for engines: itself, or its group (a leader). Hearing
    from it keeps all of them alive, so a group report refreshes every engine at once."""

    client_id: str
    last_seen_s: float


@dataclass
class _EngineState:
    info: EngineInfo
    client: _Client
    is_alive: bool = True


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
        self.block_size = identity.layout.block_size_tokens
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
        self._engine_id_to_node = {e: n.node_id for n in self.topology.nodes for e in n.engine_ids}
        self._group_id_to_state = {
            g.group_id: GroupLoad.of(g, self._engine_id_to_node) for g in self.topology.groups
        }
        self._engine_id_to_group = {
            e: self._group_id_to_state[g.group_id]
            for g in self.topology.groups
            for e in g.engine_ids
        }
        # Groups whose last reports say idle, given no work since: the scheduler fetches for
        # them itself when work waits (``_fetch_for_idle_groups``).
        self._idle_groups: dict[int, GroupLoad] = {}
        self._engines: dict[int, _EngineState] = {}
        self._client_id_to_engine_id: dict[str, int] = {}
        self._is_peer_table_stale = False  # membership changed: announce once this loop turn
        self._requests: dict[int, _RequestState] = {}
        # Caller's id -> current placement's id, for re-placed requests only.
        self._client_id_to_request_id: dict[int, int] = {}
        # (when, request): re-placements that wait for a lost peer to be declared dead.
        self._delayed_placements: list[tuple[float, _RequestState]] = []
        self._submissions: queue.SimpleQueue[_RequestState] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[RequestEvent] = queue.SimpleQueue()
        self._request_ids = itertools.count()
        self._last_heartbeat_s = 0.0
        self._has_been_ready = False  # every engine has joined once (see unavailable_reason)
        self._dead_engine_id_to_why: dict[int, str] = {}
        # Live engines by role, kept by _join and _declare_dead: read on every submission, so
        # not counted by walking every engine (1,152 at 48P96D).
        self._role_to_num_live = dict.fromkeys((PREFILL, DECODE), 0)
        # Engine processes this host saw exit, with their exit code (the launcher's watch).
        self._exited: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.num_assigned = 0
        self.num_reports = 0  # engine and group reports received (idle engines send few)
        self.num_replaced = 0  # placements abandoned with a lost engine and made again
        self.persisting: PersistingBlocks[_RequestState] = PersistingBlocks(
            cluster.persist_wait_s if store is not None else 0.0
        )

    # --- the serving side (any thread) ------------------------------------------------------

    @property
    def num_expected_engines(self) -> int:
        return len(self._engine_id_to_node)

    @property
    def num_live_engines(self) -> int:
        return sum(self._role_to_num_live.values())

    def is_ready(self) -> bool:
        """Every engine of the topology has registered and is alive."""
        return self.num_live_engines == self.num_expected_engines

    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Queue a request (token ids already validated); returns its id. Thread-safe.

        The prompt is packed and its store keys hashed here, on the caller's thread, not in
        the loop (a 32K-token prompt takes about a millisecond)."""
        token_ids = pack_token_ids(prompt_token_ids)
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        sampling = sampling_params_to_dict(params)
        _check_encodable(sampling)
        request_id = next(self._request_ids)
        keys = self._prompt_block_keys(token_ids)
        self._submissions.put(
            _RequestState(
                request_id,
                request_id,
                token_ids,
                params,
                sampling,
                self._num_cached_tokens(keys),
                keys if self.persisting.is_enabled else None,
            )
        )
        return request_id

    @property
    def unavailable_reason(self) -> str | None:
        """Why no request can be served now (no live engine of a role), or None. Any thread:
        it reads counts only. Before every engine has joined once, engines are still coming
        and nothing is unavailable."""
        if not self._has_been_ready:
            return None
        missing = [role for role in (PREFILL, DECODE) if not self.num_live_engines_of(role)]
        if not missing:
            return None
        return f"no {' and no '.join(missing)} engine is alive"

    def dead_engines(self) -> dict[int, str]:
        """Engines declared dead: id -> why (the loop thread; a snapshot publishes it)."""
        return dict(self._dead_engine_id_to_why)

    def num_live_engines_of(self, role: str) -> int:
        return self._role_to_num_live[role]

    def placement(self, request_id: int) -> tuple[int | None, int | None] | None:
        """(PE, DE) engine ids of a request (the caller's id) that is in flight, None for an
        engine not chosen yet; None once it is done. Any thread: a snapshot, for tools."""
        state = self._requests.get(self._client_id_to_request_id.get(request_id, request_id))
        return None if state is None else (state.prefill_engine_id, state.decode_engine_id)

    def _prompt_block_keys(self, prompt_token_ids: array.array) -> list[BlockKey]:
        """Keys of the whole blocks a hit may cover: all but the prompt's last token, which
        the PE must compute."""
        if self.store is None:
            return []
        max_blocks = (len(prompt_token_ids) - 1) // self.block_size
        return block_keys(
            prompt_token_ids[: max_blocks * self.block_size],
            self.block_size,
            self.identity.fingerprint,
        )

    def _num_cached_tokens(self, keys: list[BlockKey]) -> int:
        """Tokens of the leading ``keys`` the store holds (any thread)."""
        return self._lookup(keys) * self.block_size if keys else 0

    def _lookup(self, keys: list[BlockKey]) -> int:
        """Leading ``keys`` in the store (any thread)."""
        try:
            return self.store.lookup(keys)
        except KVStoreError as exc:
            logger.warning("store lookup failed, treating the prompt as a miss: %s", exc)
            return 0

    def drain_events(self) -> list[RequestEvent]:
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def link_bytes(self) -> dict[int, dict[str, int]]:
        """Latest cumulative link byte counters reported by each engine."""
        link_bytes = {}
        for engine_id in self._engines:
            group = self._engine_id_to_group[engine_id]
            link_bytes[engine_id] = dict(group.link_bytes[group.spec.engine_ids.index(engine_id)])
        return link_bytes

    # --- the loop (one thread) --------------------------------------------------------------

    def run_once(self, timeout_s: float) -> None:
        """Take submissions, handle the engines' messages, check liveness."""
        self._declare_exited_dead()
        while True:
            try:
                state = self._submissions.get_nowait()
            except queue.Empty:
                break
            self._requests[state.request_id] = state
            reason = self.unavailable_reason
            if reason is not None:
                self._fail(state.request_id, reason, is_unavailable=True)
                continue
            self._enqueue(state)
        for client_id, msg in self.server.receive(timeout_s):  # each handled, then dropped
            self._handle(client_id, msg)
        self._has_been_ready = self._has_been_ready or self.is_ready()
        self._fetch_for_idle_groups()
        self._check_liveness()
        if self._delayed_placements:
            self._place_delayed()
        if self.persisting:
            self._enqueue_all(self.persisting.expire(self.clock()))
        if self._is_peer_table_stale:
            self._is_peer_table_stale = False
            self._broadcast(PeerTable(tuple(e.info for e in self._engines.values() if e.is_alive)))

    def _enqueue(self, state: _RequestState) -> None:
        """Queue the request for placement, unless its hit prefix stops at a block a DE is
        still writing: then it waits for that write (at most ``persist_wait_s``)."""
        if self._is_waiting_for_writes(state):
            return
        state.block_keys = None  # placement needs only the hit length
        self.policy.submit(
            SchedulerRequest(
                state.request_id,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_cached_tokens=state.num_cached_tokens,
                max_num_output_tokens=state.params.max_tokens,
            )
        )

    def _is_waiting_for_writes(self, state: _RequestState) -> bool:
        keys = state.block_keys
        if keys is None:
            return False
        num_hit = state.num_cached_tokens // self.block_size
        while num_hit < len(keys):
            writer_id = self.persisting.writer_of(keys[num_hit])
            if writer_id is not None:
                self.persisting.wait(writer_id, state)
                return True
            # Not being written: absent, or written since the submit's lookup. A bare presence
            # check first, so the common miss is not counted as a second lookup in the store's
            # statistics (the scheduler's hit/miss metrics).
            num_more = self._lookup(keys[num_hit:]) if self._contains(keys[num_hit]) else 0
            if not num_more:
                break
            num_hit += num_more
            state.num_cached_tokens = num_hit * self.block_size
        return False

    def _contains(self, key: BlockKey) -> bool:
        try:
            return self.store.contains(key)
        except KVStoreError as exc:
            logger.warning("store lookup failed, treating the block as a miss: %s", exc)
            return False

    def _enqueue_all(self, states: list[_RequestState]) -> None:
        """Queue requests released from waiting (those not cancelled meanwhile)."""
        for state in states:
            if state.request_id in self._requests:
                self._enqueue(state)

    def _handle(self, client_id: str, msg: object) -> None:
        now_s = self.clock()
        if isinstance(msg, EngineInfo):
            self._register(client_id, msg, now_s)
            return
        if isinstance(msg, GroupInfo):
            self._register_group(client_id, msg, now_s)
            return
        engine_id = self._client_id_to_engine_id.get(client_id)
        if engine_id is None:  # parsed once per client: this runs for every report
            engine_id = self._client_id_to_engine_id[client_id] = _engine_id_of(client_id)
        engine = self._engines.get(engine_id)
        if engine is None or not engine.is_alive:
            logger.warning("ignoring %s from unregistered %s", type(msg).__name__, client_id)
            return
        engine.client.last_seen_s = now_s
        if isinstance(msg, GroupReport):
            self._on_group_report(client_id, msg)
        elif isinstance(msg, EngineReport):
            self._on_engine_report(engine, msg)
        elif isinstance(msg, DecodeReady):
            self._relay(msg.request_id, msg, to_prefill=True)
        elif isinstance(msg, PrefillDone):
            state = self._requests.get(msg.request_id)
            if state is not None:
                state.is_prefill_done = True
                self._events.put(
                    RequestEvent(
                        state.client_request_id,
                        (msg.first_token_id,),
                        None,
                        msg.num_cached_tokens,
                        logprobs=None
                        if msg.first_token_logprob is None
                        else (msg.first_token_logprob,),
                        time_s=now_s,
                    )
                )
                self._relay(msg.request_id, msg, to_prefill=False)
        elif isinstance(msg, TokenUpdate):
            self._on_tokens(msg, now_s)
        elif isinstance(msg, KVPersisted):
            self._enqueue_all(self.persisting.written(msg.request_ids))
        elif isinstance(msg, RequestFailed):
            state = self._requests.get(msg.request_id)
            if msg.is_retryable and state is not None and self._may_place_again(state):
                # Later: by then a peer that died has been declared dead (not placed on again).
                self._place_again(state, msg.reason, at_s=now_s + self.cluster.heartbeat_timeout_s)
            else:
                self._fail(msg.request_id, msg.reason)
        else:
            logger.warning("unexpected %s from %s", type(msg).__name__, client_id)

    def _register(self, client_id: str, info: EngineInfo, now_s: float) -> None:
        problem = self._topology_problem(info)
        if problem is not None:
            logger.error("engine %s does not fit the topology: %s", info, problem)
            self.server.send(client_id, Shutdown(problem))
            return
        self._engine_id_to_group[info.engine_id].leader_client_id = None  # reports on its own
        self._join(info, _Client(client_id, now_s))
        logger.info("engine %d (%s, node %d) joined", info.engine_id, info.role, info.node_id)

    def _register_group(self, client_id: str, group_info: GroupInfo, now_s: float) -> None:
        """A leader joins its whole group: the group's engines, in order, from its own client."""
        engine_ids = tuple(info.engine_id for info in group_info.engines)
        group = self._engine_id_to_group.get(engine_ids[0]) if engine_ids else None
        if group is None or engine_ids != group.spec.engine_ids:
            problem = f"engines {engine_ids} are not one group of the topology"
        elif client_id != _client_id(engine_ids[0]):
            problem = (
                f"group {group.spec.group_id} joins through its leader {_client_id(engine_ids[0])}"
            )
        else:
            problem = next(filter(None, map(self._topology_problem, group_info.engines)), None)
        if problem is not None:
            logger.error("group from %s does not fit the topology: %s", client_id, problem)
            self.server.send(client_id, Shutdown(problem))
            return
        group.leader_client_id = client_id
        client = _Client(client_id, now_s)
        for info in group_info.engines:
            self._join(info, client)
        logger.info(
            "group %d (%s, %d engines) joined through %s",
            group.spec.group_id,
            group_info.engines[0].role,
            len(engine_ids),
            client_id,
        )

    def _topology_problem(self, info: EngineInfo) -> str | None:
        """Why the engine does not fit the topology, or None if it does."""
        if self._engine_id_to_node.get(info.engine_id) != info.node_id:
            return f"engine {info.engine_id} not in the topology (as node {info.node_id})"
        expected_role = (
            PREFILL
            if self._engine_id_to_group[info.engine_id].spec.role == EngineRole.PREFILL
            else DECODE
        )
        if info.role != expected_role:
            return f"engine {info.engine_id} must be {expected_role}"
        return None

    def _join(self, info: EngineInfo, client: _Client) -> None:
        previous = self._engines.get(info.engine_id)
        if previous is not None and previous.is_alive:  # registered again: counted once
            self._role_to_num_live[previous.info.role] -= 1
        self._engines[info.engine_id] = _EngineState(info, client)
        self._role_to_num_live[info.role] += 1
        self._dead_engine_id_to_why.pop(info.engine_id, None)
        group = self._engine_id_to_group[info.engine_id]
        group.is_usable[group.spec.engine_ids.index(info.engine_id)] = False  # until it reports
        self._is_peer_table_stale = True

    def _on_engine_report(self, engine: _EngineState, report: EngineReport) -> None:
        self.num_reports += 1
        engine_id = engine.info.engine_id  # the sender's, whatever the report says
        group = self._engine_id_to_group[engine_id]
        position = group.spec.engine_ids.index(engine_id)
        group.record_engine(position, report)
        self._note_idleness(group)
        if position == 0:  # the group's leading engine: its report is the group's fetch
            self._fetch(group)

    def _on_group_report(self, client_id: str, report: GroupReport) -> None:
        """Every engine's load at once, then the group's fetch (SPEC §6). The sender's client
        speaks for the whole group, so hearing from it kept every engine alive already."""
        self.num_reports += 1
        group = self._group_id_to_state.get(report.group_id)
        if (
            group is None
            or group.leader_client_id != client_id
            or report.engine_ids != group.spec.engine_ids
        ):
            logger.warning("ignoring a report of group %d from %s", report.group_id, client_id)
            return
        group.record_group(report)
        if not all(group.is_usable):  # the first report since joining, or an engine is dead
            group.is_usable[:] = [self._is_alive(e) for e in group.spec.engine_ids]
        self._note_idleness(group)
        self._fetch(group)

    def _note_idleness(self, group: GroupLoad) -> None:
        if group.is_idle_and_current():
            self._idle_groups[group.spec.group_id] = group
        else:
            self._idle_groups.pop(group.spec.group_id, None)

    def _mark_stale(self, group: GroupLoad, position: int | None = None) -> None:
        group.mark_stale(position)
        self._idle_groups.pop(group.spec.group_id, None)

    def _fetch_for_idle_groups(self) -> None:
        """SPEC §6: leaders fetch every fetch interval *or when idle*. An idle engine reports
        only every ``report_keepalive_s`` (it has nothing new to say), so when work waits the
        scheduler fetches for an idle group itself, from its last reports: they are exact
        until the group is given work (a fetch that places anything marks them out of date).
        PE groups first, so a request can be placed on both sides in one loop turn."""
        if not self._idle_groups:
            return
        policy = self.policy
        for is_prefill in (True, False):
            for group in list(self._idle_groups.values()):
                waiting = policy.num_waiting_prefill if is_prefill else policy.num_waiting_decode
                if not waiting:
                    break
                if group.is_prefill == is_prefill and group.is_idle_and_current():
                    self._fetch(group)

    def _fetch(self, group: GroupLoad) -> None:
        snapshot = group.snapshot()
        if group.is_prefill:
            # Placed requests wait for their DE placement; until the PEs report again their
            # entries leave those requests out.
            if self.policy.fetch_prefill(snapshot).request_ids:
                self._mark_stale(group)
            return
        result = self.policy.fetch_decode(snapshot)
        if not result.request_ids:  # most fetches place nothing
            return
        self._mark_stale(group)
        for request_id, pe, de, plan in zip(
            result.request_ids,
            result.prefill_engine_ids,
            result.decode_engine_ids,
            result.load_plans,
            strict=True,
        ):
            self._assign(
                request_id, pe, de, plan.num_prefill_side_blocks, plan.num_decode_side_blocks
            )

    def _assign(
        self, request_id: int, pe: int, de: int, num_pe_blocks: int, num_de_blocks: int
    ) -> None:
        state = self._requests.get(request_id)
        if state is None:  # cancelled while queued
            return
        state.prefill_engine_id, state.decode_engine_id = pe, de
        assignment = Assignment(
            request_id=request_id,
            prompt_token_ids=state.prompt_token_ids,
            sampling=state.sampling,
            num_prefill_side_blocks=num_pe_blocks,
            num_decode_side_blocks=num_de_blocks,
            prefill_engine_id=pe,
            decode_engine_id=de,
        )
        try:
            data = encode(assignment)  # once: both engines get the same bytes
        except (TypeError, ValueError, OverflowError) as exc:  # submit checked; never here
            logger.exception("request %d cannot be sent", state.client_request_id)
            self._fail(request_id, f"the request cannot be sent to its engines: {exc}")
            return
        try:
            self._send_encoded_to_engine(de, data)
            self._send_encoded_to_engine(pe, data)
        except PeerUnavailable as exc:
            self._fail(request_id, f"engine unavailable at assignment: {exc}")
            return
        prefill_group = self._engine_id_to_group[pe]
        self._mark_stale(prefill_group, prefill_group.spec.engine_ids.index(pe))
        self.num_assigned += 1

    def _relay(self, request_id: int, msg: object, *, to_prefill: bool) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        target = state.prefill_engine_id if to_prefill else state.decode_engine_id
        try:
            self._send_to_engine(target, msg)
        except PeerUnavailable as exc:
            self._fail(request_id, str(exc))

    def _on_tokens(self, msg: TokenUpdate, now_s: float) -> None:
        state = self._requests.get(msg.request_id)
        if state is None:
            return
        self._events.put(
            RequestEvent(
                state.client_request_id,
                msg.token_ids,
                msg.finish_reason,
                msg.num_cached_tokens,
                logprobs=msg.logprobs,
                time_s=now_s,
            )
        )
        if msg.finish_reason is not None:
            self._pop(msg.request_id)
            if msg.persisting_keys and state.decode_engine_id is not None:
                self.persisting.add(
                    msg.request_id, state.decode_engine_id, msg.persisting_keys, now_s
                )

    def cancel(self, request_id: int) -> None:
        """Stop a request (the caller's id) wherever it is; its engines free its buffers and
        KV."""
        state = self._pop(self._client_id_to_request_id.get(request_id, request_id))
        if state is None:
            return
        for engine_id in (state.prefill_engine_id, state.decode_engine_id):
            if engine_id is not None:
                with contextlib.suppress(PeerUnavailable):  # a dead engine frees nothing
                    self._send_to_engine(engine_id, CancelRequest(state.request_id))

    def _pop(self, request_id: int) -> _RequestState | None:
        """Forget a placement's request (finished, failed or cancelled)."""
        state = self._requests.pop(request_id, None)
        if state is not None and state.client_request_id != request_id:
            del self._client_id_to_request_id[state.client_request_id]
        return state

    def _fail(self, request_id: int, reason: str, *, is_unavailable: bool = False) -> None:
        state = self._pop(request_id)
        if state is None:
            return
        logger.warning("request %d failed: %s", state.client_request_id, reason)
        self._events.put(
            RequestEvent(
                state.client_request_id,
                (),
                "error",
                state.num_cached_tokens,
                error=reason,
                is_unavailable=is_unavailable,
            )
        )
        self._cancel_on_live_engines(state)

    def _cancel_on_live_engines(self, state: _RequestState) -> None:
        for engine_id in (state.prefill_engine_id, state.decode_engine_id):
            if engine_id is not None and self._is_alive(engine_id):
                self._send_to_engine(engine_id, CancelRequest(state.request_id))

    @staticmethod
    def _may_place_again(state: _RequestState) -> bool:
        return not state.is_prefill_done and state.num_placements < MAX_PLACEMENTS

    def _place_again(self, state: _RequestState, why: str, *, at_s: float = 0.0) -> None:
        """Abandon this placement (its live engines free it) and queue the request again under
        a fresh id, now or at ``at_s``, its hit looked up anew; see the module docstring."""
        self._cancel_on_live_engines(state)
        del self._requests[state.request_id]
        state.request_id = next(self._request_ids)
        self._requests[state.request_id] = state
        self._client_id_to_request_id[state.client_request_id] = state.request_id
        state.prefill_engine_id = state.decode_engine_id = None
        state.num_placements += 1
        logger.warning(
            "request %d placed again (placement %d): %s",
            state.client_request_id,
            state.num_placements,
            why,
        )
        self.num_replaced += 1
        if at_s > self.clock():
            self._delayed_placements.append((at_s, state))
        else:
            self._enqueue_again(state)

    def _enqueue_again(self, state: _RequestState) -> None:
        if state.request_id not in self._requests:
            return  # cancelled meanwhile
        keys = self._prompt_block_keys(state.prompt_token_ids)
        state.num_cached_tokens = self._num_cached_tokens(keys)
        state.block_keys = keys if self.persisting.is_enabled else None
        self._enqueue(state)

    def _place_delayed(self) -> None:
        now_s = self.clock()
        due = [state for at_s, state in self._delayed_placements if at_s <= now_s]
        if due:
            self._delayed_placements = [(t, st) for t, st in self._delayed_placements if t > now_s]
            for state in due:
                self._enqueue_again(state)

    def _is_alive(self, engine_id: int) -> bool:
        state = self._engines.get(engine_id)
        return state is not None and state.is_alive

    def _check_liveness(self) -> None:
        """Once per heartbeat period, not per loop turn: a turn takes about a millisecond at
        scale, and this walks every engine (1,152 at 48P96D)."""
        now_s = self.clock()
        timeout_s = self.cluster.heartbeat_timeout_s
        if now_s - self._last_heartbeat_s < timeout_s / 4:
            return
        self._last_heartbeat_s = now_s
        for engine_id, state in self._engines.items():
            silent_s = now_s - state.client.last_seen_s
            if state.is_alive and silent_s > timeout_s:
                self._declare_dead(engine_id, f"no report for {silent_s:.1f} s")
        self._broadcast(Heartbeat(self.num_live_engines))

    def on_engine_exited(self, engine_id: int, exit_code: int) -> None:
        """An engine process of this host exited (any thread): it is declared dead on the
        loop's next turn, without waiting for the heartbeat timeout."""
        self._exited.put((engine_id, exit_code))

    def _declare_exited_dead(self) -> None:
        while True:
            try:
                engine_id, exit_code = self._exited.get_nowait()
            except queue.Empty:
                return
            if self._is_alive(engine_id):
                self._declare_dead(engine_id, f"its process exited with code {exit_code}")

    def _declare_dead(self, engine_id: int, why: str) -> None:
        state = self._engines[engine_id]
        assert state.is_alive, f"engine {engine_id} declared dead twice"
        state.is_alive = False
        self._role_to_num_live[state.info.role] -= 1
        self._dead_engine_id_to_why[engine_id] = why
        group = self._engine_id_to_group[engine_id]
        group.is_usable[group.spec.engine_ids.index(engine_id)] = False
        if not any(e.is_alive and e.client is state.client for e in self._engines.values()):
            self.server.forget(state.client.client_id)  # it speaks for no live engine any more
        logger.error("engine %d declared dead: %s", engine_id, why)
        # Requests only queued for it (not yet sent to any engine) are placed again; first,
        # so that the policy places nothing more on it.
        for request in self.policy.withdraw_engine(engine_id):
            self.policy.submit(request)
        lost = f"engine {engine_id} ({state.info.role}) died: {why}"
        for request_id, request in list(self._requests.items()):
            if engine_id in (request.prefill_engine_id, request.decode_engine_id):
                if self._may_place_again(request):
                    self._place_again(request, lost)
                else:
                    self._fail(request_id, lost)
        self._enqueue_all(self.persisting.engine_lost(engine_id))
        self._is_peer_table_stale = True
        self._fail_unplaceable()

    def _fail_unplaceable(self) -> None:
        """With no live engine of a role left, every request that still needs one fails now
        (nothing could place it): all of them without a DE, those not prefilled without a PE."""
        reason = self.unavailable_reason
        if reason is None:
            return
        needs_decode = not self.num_live_engines_of(DECODE)
        for request_id, request in list(self._requests.items()):
            if needs_decode or not request.is_prefill_done:
                self._fail(request_id, reason, is_unavailable=True)
        self._delayed_placements.clear()

    def _send_to_engine(self, engine_id: int, msg: object) -> None:
        """Send to the client that speaks for the engine; ``PeerUnavailable`` if none does."""
        self._send_encoded_to_engine(engine_id, encode(msg))

    def _send_encoded_to_engine(self, engine_id: int, data: bytes) -> None:
        state = self._engines.get(engine_id)
        if state is None:
            raise PeerUnavailable(f"engine {engine_id} has not joined")
        self.server.send_encoded(state.client.client_id, data)

    def _broadcast(self, msg: object) -> None:
        """Send to every client that speaks for a live engine, once each; encoded once (a
        PeerTable at 48P96D lists 1,152 engines)."""
        client_ids = dict.fromkeys(s.client.client_id for s in self._engines.values() if s.is_alive)
        data = encode(msg)
        for client_id in client_ids:
            with contextlib.suppress(PeerUnavailable):  # not welcomed yet
                self.server.send_encoded(client_id, data)

    def shutdown(self, reason: str = "cluster stopping") -> None:
        self._broadcast(Shutdown(reason))

    def close(self) -> None:
        self.server.close()
        if self.store is not None:
            self.store.close()


def _check_encodable(sampling: dict[str, Any]) -> None:
    """``ValueError`` unless the sampling fields can cross the control channel (msgpack holds
    64-bit integers at most): a value that cannot must fail its request at the door, not the
    scheduler loop that sends it."""
    try:
        msgpack.packb(sampling)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"sampling parameters cannot be sent to the engines: {exc}") from exc


def _client_id(engine_id: int) -> str:
    return f"engine-{engine_id}"


def _engine_id_of(client_id: str) -> int:
    try:
        return int(client_id.removeprefix("engine-"))
    except ValueError:
        return -1


def open_store_for_lookups(root_dir: Path | None, identity: KVIdentity) -> FileKVStore | None:
    """The scheduler's read-only use of the store: lookups to size each request's hit."""
    if root_dir is None:
        return None
    return FileKVStore(root_dir, identity.layout, identity.fingerprint)

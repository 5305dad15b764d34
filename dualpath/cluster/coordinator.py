"""The scheduler process: places requests on (PE, DE) pairs and relays the engines' messages.

It runs the pure policy of ``dualpath.scheduler`` unchanged. Engine group leaders pull: each
``EngineReport`` from a group's leading engine is that group's fetch (SPEC §6), answered with
``Assignment``s once a request's pair and read plan are fixed. The engines of a group report
individually here and the group snapshot is assembled from their latest reports (on one host
the leader would only forward them).

    coordinator = Coordinator(cluster_config, scheduler_config, identity, store_root, token)
    request_id = coordinator.submit(prompt_token_ids, params)   # thread-safe
    coordinator.run_once(timeout_s=0.01)                          # in the serving loop
    for event in coordinator.drain_events(): ...                 # tokens, finishes, failures

An engine that stops reporting for ``heartbeat_timeout_s`` is declared dead: the policy sees it
as overloaded (a PE above beta, a DE with no free memory) so nothing more is placed on it, and
its in-flight requests fail with a message that names it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dualpath.cluster.messages import (
    DECODE,
    PREFILL,
    Assignment,
    CancelRequest,
    DecodeReady,
    EngineInfo,
    EngineReport,
    Heartbeat,
    PeerTable,
    PrefillDone,
    RequestFailed,
    Shutdown,
    TokenUpdate,
)
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.control.channel import ControlServer
from dualpath.errors import KVStoreError, PeerUnavailable
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import FileKVStore, KVStore
from dualpath.model.identity import KVIdentity
from dualpath.scheduler import (
    EngineRole,
    EngineSnapshot,
    GroupSnapshot,
    NodeSnapshot,
    SchedulerRequest,
    make_cluster_topology,
    make_scheduler,
)
from dualpath.types import SamplingParams, sampling_params_to_dict

logger = logging.getLogger(__name__)

# tok_e reported for a dead PE: above any beta, so Algorithm 1 skips it.
_DEAD_ENGINE_TOKENS = 1 << 62


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """What the serving side sees of a request: new tokens, then one final event."""

    request_id: int
    token_ids: tuple[int, ...]
    finish_reason: str | None  # set on the last event; "error" with ``error`` on failure
    num_cached_tokens: int
    error: str | None = None
    logprobs: tuple | None = None
    time_s: float = 0.0


@dataclass
class _RequestState:
    request_id: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    num_cached_tokens: int
    prefill_engine_id: int | None = None
    decode_engine_id: int | None = None
    is_prefill_done: bool = False


@dataclass
class _EngineState:
    info: EngineInfo
    last_seen_s: float
    report: EngineReport | None = None
    is_alive: bool = True
    link_bytes: dict[str, int] = field(default_factory=dict)


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
        self._engine_id_to_group = {e: g for g in self.topology.groups for e in g.engine_ids}
        self._engines: dict[int, _EngineState] = {}
        self._requests: dict[int, _RequestState] = {}
        self._submissions: queue.SimpleQueue[_RequestState] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[RequestEvent] = queue.SimpleQueue()
        self._request_ids = itertools.count()
        self._last_heartbeat_s = 0.0
        self.num_assigned = 0

    # --- the serving side (any thread) ------------------------------------------------------

    @property
    def num_expected_engines(self) -> int:
        return len(self._engine_id_to_node)

    @property
    def num_live_engines(self) -> int:
        return sum(1 for e in self._engines.values() if e.is_alive)

    def is_ready(self) -> bool:
        """Every engine of the topology has registered and is alive."""
        return self.num_live_engines == self.num_expected_engines

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue a request (token ids already validated); returns its id. Thread-safe."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        request_id = next(self._request_ids)
        num_cached = self._num_cached_tokens(prompt_token_ids)
        self._submissions.put(
            _RequestState(request_id, tuple(prompt_token_ids), params, num_cached)
        )
        return request_id

    def _num_cached_tokens(self, prompt_token_ids: list[int]) -> int:
        """Whole hit blocks, leaving at least one token for the PE to compute."""
        if self.store is None:
            return 0
        max_blocks = (len(prompt_token_ids) - 1) // self.block_size
        keys = block_keys(
            prompt_token_ids[: max_blocks * self.block_size],
            self.block_size,
            self.identity.fingerprint,
        )
        try:
            return self.store.lookup(keys) * self.block_size
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
        return {engine_id: dict(e.link_bytes) for engine_id, e in self._engines.items()}

    # --- the loop (one thread) --------------------------------------------------------------

    def run_once(self, timeout_s: float) -> None:
        """Take submissions, handle the engines' messages, check liveness."""
        while True:
            try:
                state = self._submissions.get_nowait()
            except queue.Empty:
                break
            self._requests[state.request_id] = state
            self.policy.submit(
                SchedulerRequest(
                    state.request_id,
                    num_prompt_tokens=len(state.prompt_token_ids),
                    num_cached_tokens=state.num_cached_tokens,
                    max_num_output_tokens=state.params.max_tokens,
                )
            )
        for client_id, msg in self.server.poll(timeout_s):
            self._handle(client_id, msg)
        self._check_liveness()

    def _handle(self, client_id: str, msg: object) -> None:
        now_s = self.clock()
        if isinstance(msg, EngineInfo):
            self._register(client_id, msg, now_s)
            return
        engine = self._engines.get(_engine_id_of(client_id))
        if engine is None or not engine.is_alive:
            logger.warning("ignoring %s from unregistered %s", type(msg).__name__, client_id)
            return
        engine.last_seen_s = now_s
        if isinstance(msg, EngineReport):
            engine.report = msg
            engine.link_bytes = msg.link_bytes
            self._fetch_if_leader(engine.info.engine_id)
        elif isinstance(msg, DecodeReady):
            self._relay(msg.request_id, msg, to_prefill=True)
        elif isinstance(msg, PrefillDone):
            state = self._requests.get(msg.request_id)
            if state is not None:
                state.is_prefill_done = True
                self._events.put(
                    RequestEvent(
                        msg.request_id,
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
        elif isinstance(msg, RequestFailed):
            self._fail(msg.request_id, msg.reason)
        else:
            logger.warning("unexpected %s from %s", type(msg).__name__, client_id)

    def _register(self, client_id: str, info: EngineInfo, now_s: float) -> None:
        expected_node = self._engine_id_to_node.get(info.engine_id)
        if expected_node is None or expected_node != info.node_id:
            logger.error("engine %s does not fit the topology (node %s)", info, expected_node)
            self.server.send(client_id, Shutdown(f"engine {info.engine_id} not in the topology"))
            return
        expected_role = (
            PREFILL
            if self._engine_id_to_group[info.engine_id].role == EngineRole.PREFILL
            else DECODE
        )
        if info.role != expected_role:
            self.server.send(
                client_id, Shutdown(f"engine {info.engine_id} must be {expected_role}")
            )
            return
        self._engines[info.engine_id] = _EngineState(info, now_s)
        logger.info("engine %d (%s, node %d) joined", info.engine_id, info.role, info.node_id)
        self._broadcast(PeerTable(tuple(e.info for e in self._engines.values() if e.is_alive)))

    def _fetch_if_leader(self, engine_id: int) -> None:
        group = self._engine_id_to_group[engine_id]
        if group.engine_ids[0] != engine_id:
            return
        snapshot = self._group_snapshot(group)
        if group.role == EngineRole.PREFILL:
            self.policy.fetch_prefill(snapshot)  # placed requests wait for their DE placement
            return
        result = self.policy.fetch_decode(snapshot)
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

    def _group_snapshot(self, group) -> GroupSnapshot:
        engines = []
        node_read_tokens = dict.fromkeys(group.node_ids, 0)
        for engine_id in group.engine_ids:
            state = self._engines.get(engine_id)
            report = None if state is None else state.report
            is_usable = state is not None and state.is_alive
            if report is None or not is_usable:
                # Not joined yet, or dead: never chosen (a PE above beta, a DE without memory).
                engines.append(EngineSnapshot(engine_id, 0, _DEAD_ENGINE_TOKENS, 0))
                continue
            engines.append(
                EngineSnapshot(
                    engine_id, report.num_seqs, report.num_tokens, report.num_free_kv_blocks
                )
            )
            node_read_tokens[self._engine_id_to_node[engine_id]] += report.read_queue_tokens
        nodes = tuple(NodeSnapshot(n, node_read_tokens[n]) for n in group.node_ids)
        return GroupSnapshot(group.group_id, tuple(engines), nodes)

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
            sampling=sampling_params_to_dict(state.params),
            num_prefill_side_blocks=num_pe_blocks,
            num_decode_side_blocks=num_de_blocks,
            prefill_engine_id=pe,
            decode_engine_id=de,
        )
        try:
            self.server.send(_client_id(de), assignment)
            self.server.send(_client_id(pe), assignment)
        except PeerUnavailable as exc:
            self._fail(request_id, f"engine unavailable at assignment: {exc}")
            return
        self.num_assigned += 1

    def _relay(self, request_id: int, msg: object, *, to_prefill: bool) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        target = state.prefill_engine_id if to_prefill else state.decode_engine_id
        try:
            self.server.send(_client_id(target), msg)
        except PeerUnavailable as exc:
            self._fail(request_id, str(exc))

    def _on_tokens(self, msg: TokenUpdate, now_s: float) -> None:
        if msg.request_id not in self._requests:
            return
        self._events.put(
            RequestEvent(
                msg.request_id,
                msg.token_ids,
                msg.finish_reason,
                msg.num_cached_tokens,
                logprobs=msg.logprobs,
                time_s=now_s,
            )
        )
        if msg.finish_reason is not None:
            del self._requests[msg.request_id]

    def cancel(self, request_id: int) -> None:
        """Stop a request wherever it is; its engines free its buffers and KV."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        for engine_id in (state.prefill_engine_id, state.decode_engine_id):
            if engine_id is not None:
                with contextlib.suppress(PeerUnavailable):  # a dead engine frees nothing
                    self.server.send(_client_id(engine_id), CancelRequest(request_id))

    def _fail(self, request_id: int, reason: str) -> None:
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        logger.warning("request %d failed: %s", request_id, reason)
        self._events.put(
            RequestEvent(request_id, (), "error", state.num_cached_tokens, error=reason)
        )
        for engine_id in (state.prefill_engine_id, state.decode_engine_id):
            if engine_id is not None and self._is_alive(engine_id):
                self.server.send(_client_id(engine_id), CancelRequest(request_id))

    def _is_alive(self, engine_id: int) -> bool:
        state = self._engines.get(engine_id)
        return state is not None and state.is_alive

    def _check_liveness(self) -> None:
        now_s = self.clock()
        timeout_s = self.cluster.heartbeat_timeout_s
        for engine_id, state in self._engines.items():
            if state.is_alive and now_s - state.last_seen_s > timeout_s:
                self._declare_dead(engine_id, f"no report for {now_s - state.last_seen_s:.1f} s")
        if now_s - self._last_heartbeat_s >= timeout_s / 4:
            self._last_heartbeat_s = now_s
            self._broadcast(Heartbeat(self.num_live_engines))

    def _declare_dead(self, engine_id: int, why: str) -> None:
        state = self._engines[engine_id]
        state.is_alive = False
        self.server.forget(_client_id(engine_id))
        logger.error("engine %d declared dead: %s", engine_id, why)
        for request_id, request in list(self._requests.items()):
            if engine_id in (request.prefill_engine_id, request.decode_engine_id):
                self._fail(request_id, f"engine {engine_id} ({state.info.role}) died: {why}")
        self._broadcast(PeerTable(tuple(e.info for e in self._engines.values() if e.is_alive)))

    def _broadcast(self, msg: object) -> None:
        for engine_id, state in self._engines.items():
            if state.is_alive:
                with contextlib.suppress(PeerUnavailable):  # not welcomed yet
                    self.server.send(_client_id(engine_id), msg)

    def shutdown(self, reason: str = "cluster stopping") -> None:
        self._broadcast(Shutdown(reason))

    def close(self) -> None:
        self.server.close()
        if self.store is not None:
            self.store.close()


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

"""Start a whole PD-disaggregated cluster on one host: the scheduler here, engines as processes.

    with LocalCluster(ClusterConfig(num_prefill_nodes=1, num_decode_nodes=2), model_dir=...,
                      store=KVStoreConfig(root_dir=...)) as cluster:
        outputs = cluster.generate([prompt_ids], SamplingParams(max_tokens=16))

        # or, streaming (the HTTP server's way): events arrive on the scheduler loop thread
        request_id = cluster.submit(prompt_ids, params, on_event=handle_event)
        cluster.cancel(request_id)          # the engines free its buffers and KV

Engines are started as processes (``engine_processes``), each with its whole config. They
exit on their own if this process dies (parent-death signal and the scheduler heartbeat); ``close`` asks them to stop, then
terminates and finally kills any that linger. With ``spawn_engines=False`` no engine is
started here: engines started by hand (on other hosts) join with the same token.

One thread (the scheduler loop) owns the ``Coordinator``: it takes submissions, applies
cancellations, hands out events, and publishes a ``ClusterSnapshot`` for readers on other
threads, so nothing outside it touches the coordinator's state or its control socket.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dualpath.cluster.coordinator import ClusterSnapshot, Coordinator
from dualpath.cluster.engine_processes import EngineProcesses
from dualpath.cluster.hits import open_store_for_lookups
from dualpath.config import (
    DEFAULT_ATTENTION_QUOTA_S,
    ClusterConfig,
    EngineConfig,
    EngineProcessConfig,
    KVStoreConfig,
    SchedulerConfig,
)
from dualpath.control.channel import new_cluster_token
from dualpath.engine.capacity import check_capacity
from dualpath.errors import ClusterUnavailable
from dualpath.kv.layout import KVLayout
from dualpath.model.identity import checkpoint_kv_identity, vllm_device
from dualpath.protocol import DECODE, PREFILL, RequestEvent
from dualpath.queues import drain
from dualpath.transfer.links import check_pd_ratio
from dualpath.types import NO_SCOPE, RequestScope, SamplingParams
from dualpath.units import gbps_to_bytes_per_s
from dualpath.vllm.args import check_engine_kind

logger = logging.getLogger(__name__)

# Storage read rate assumed for alpha when the SNIC is uncapped and nothing was measured.
DEFAULT_STORE_READ_BYTES_PER_S = 1e9
# How often the loop thread publishes a ClusterSnapshot (metrics and health read it).
SNAPSHOT_INTERVAL_S = 0.1
# The scheduler loop's longest wait for a message: what other threads hand it (submissions,
# cancellations, engine exits) wakes it at once, so this paces only what runs on the clock
# (liveness, delayed placements, persist-wait expiry, the snapshot).
LOOP_WAIT_S = 0.05

EventListener = Callable[[RequestEvent], None]


@dataclass(frozen=True, slots=True)
class ClusterOutput:
    request_id: int
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    error: str | None
    arrival_s: float
    first_token_s: float | None
    finish_s: float


def _scheduler_config(
    cluster: ClusterConfig,
    engine: EngineConfig,
    prefill_tokens_per_s: float,
    attention_quota_s: float = DEFAULT_ATTENTION_QUOTA_S,
) -> SchedulerConfig:
    """The scheduler's config when none is given: the mode's policies, Full Block chunks."""
    settings = cluster.settings
    return SchedulerConfig(
        scheduler=settings.scheduler,
        read_path=settings.read_path,
        block_size_tokens=engine.block_size_tokens,
        prefill_tokens_per_s=prefill_tokens_per_s,
        attention_quota_s=attention_quota_s,
        # The PEs cut prompts at Full Blocks, one block at least.
        min_prefill_chunk_tokens=engine.block_size_tokens,
    )


def _storage_read_tokens_per_s(cluster: ClusterConfig, layout: KVLayout) -> float:
    """A node's storage read rate in tokens (for alpha): its SNIC cap, else the default."""
    snic_gbps = cluster.traffic.snic_bandwidth_gbps
    read_bytes_per_s = (
        gbps_to_bytes_per_s(snic_gbps) if snic_gbps > 0 else DEFAULT_STORE_READ_BYTES_PER_S
    )
    return read_bytes_per_s / (layout.full_block_bytes / layout.block_size_tokens)


def _warn_of_pd_ratio(cluster: ClusterConfig) -> None:
    """Log SPEC §5's warnings: some link may congest at this P/D ratio."""
    traffic = cluster.traffic
    for warning in check_pd_ratio(
        cluster.num_prefill_nodes,
        cluster.num_decode_nodes,
        num_gpus_per_node=cluster.engines_per_node,
        snic_bandwidth_gbps=traffic.snic_bandwidth_gbps,
        cnic_bandwidth_gbps=traffic.cnic_bandwidth_gbps,
        host_memory_bandwidth_gbps=traffic.host_memory_bandwidth_gbps,
    ):
        logger.warning("%s", warning)


class LocalCluster:
    def __init__(
        self,
        cluster: ClusterConfig,
        *,
        model_dir: Path,
        store: KVStoreConfig,
        engine: EngineConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        transport: str = "nixl",
        prefill_tokens_per_s: float = 2000.0,
        attention_quota_s: float = DEFAULT_ATTENTION_QUOTA_S,
        log_dir: Path | None = None,
        spawn_engines: bool = True,
        token: str | None = None,
        restart_engines: bool = False,
    ) -> None:
        """``spawn_engines=False`` starts no engine here (they join from elsewhere, with
        ``token``); ``token=None`` makes a new cluster token; ``restart_engines`` starts an
        engine that died again (``EngineProcesses``)."""
        self.cluster = cluster
        self.model_dir = Path(model_dir)
        self.store_config = store
        self.engine_config = engine or EngineConfig(num_threads=1)
        self.transport = transport
        self.log_dir = log_dir
        self.spawn_engines = spawn_engines
        model_config, self.identity = checkpoint_kv_identity(
            self.model_dir,
            self.engine_config.dtype,
            self.engine_config.block_size_tokens,
            self.engine_config.engine,
            vllm_device() if self.engine_config.engine == "vllm" else self.engine_config.device,
        )
        self.model_config = model_config
        self.max_model_len = (
            self.engine_config.max_model_len or model_config.max_position_embeddings
        )
        # Refused here, before any engine starts, rather than by the first long request.
        check_capacity(cluster, self.engine_config, self.identity.layout, self.max_model_len)
        check_engine_kind(cluster, self.engine_config, model_config)
        self.scheduler_config = scheduler or _scheduler_config(
            cluster, self.engine_config, prefill_tokens_per_s, attention_quota_s
        )
        _warn_of_pd_ratio(cluster)
        self.token = token or new_cluster_token()
        self.coordinator = Coordinator(
            cluster,
            self.scheduler_config,
            self.identity,
            open_store_for_lookups(store.root_dir, self.identity),
            self.token,
            storage_read_tokens_per_s=_storage_read_tokens_per_s(cluster, self.identity.layout),
        )
        self.engine_id_to_role = {
            engine_id: PREFILL if node.role.name == "PREFILL" else DECODE
            for node in self.coordinator.topology.nodes
            for engine_id in node.engine_ids
        }
        self.processes = EngineProcesses(
            self.token,
            log_dir,
            on_exit=self.coordinator.on_engine_exited,
            restart=restart_engines,
        )
        self._stop = threading.Event()  # the loop thread exits
        self._closing = threading.Event()  # close() was called: start() gives up
        self._spawn_lock = threading.Lock()  # close() waits for start() to finish spawning
        self._is_closed = False
        self._loop_thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        # Guards _waiters, _listeners and _cancelled. Re-entrant: a listener may cancel.
        self._lock = threading.RLock()
        self._waiters: dict[int, list[RequestEvent]] = {}  # events for result()
        self._listeners: dict[int, EventListener] = {}  # events for streaming submitters
        self._cancelled: set[int] = set()  # cancelled, events may still be in flight
        self._cancellations: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._arrivals: dict[int, float] = {}
        self._loop_error: str | None = None  # why the loop thread died, if it did
        self._snapshot = self._take_snapshot(time.monotonic())

    # --- lifecycle --------------------------------------------------------------------------

    def start(self, timeout_s: float | None = 120.0) -> LocalCluster:
        """Start the loop and the engines; return once every engine has joined.

        ``TimeoutError`` after ``timeout_s`` (None: no deadline), ``RuntimeError`` if an
        engine exits first or ``close`` is called meanwhile (from another thread); the
        cluster is closed then.
        """
        with self._spawn_lock:
            if self._closing.is_set():
                raise RuntimeError("cluster closed before it started")
            self._loop_thread.start()
            if self.spawn_engines:
                for node in self.coordinator.topology.nodes:
                    for engine_id in node.engine_ids:
                        role = self.engine_id_to_role[engine_id]
                        config = self.engine_process_config(role, engine_id, node.node_id)
                        self.processes.spawn(config)
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while not self._snapshot.is_ready:
            if self._closing.is_set():
                raise RuntimeError("cluster closed during start-up")
            dead = self.processes.first_exited()
            if dead is not None:
                self.close()
                raise RuntimeError(
                    f"engine process exited with {dead.returncode} during start-up"
                    + self.processes.log_hint()
                )
            if time.monotonic() > deadline:
                self.close()
                snapshot = self._snapshot
                raise TimeoutError(
                    f"{snapshot.num_live_engines} of {snapshot.num_expected_engines} engines "
                    f"joined in {timeout_s} s" + self.processes.log_hint()
                )
            time.sleep(0.05)
        return self

    def engine_process_config(self, role: str, engine_id: int, node_id: int) -> EngineProcessConfig:
        """What engine ``engine_id`` builds itself from: this cluster's configs, whole."""
        return EngineProcessConfig(
            role=role,
            engine_id=engine_id,
            node_id=node_id,
            scheduler_endpoint=self.coordinator.endpoint,
            model_dir=self.model_dir,
            store=self.store_config,
            engine=self.engine_config.for_role(role),
            cluster=self.cluster,
            scheduler=self.scheduler_config,
            transport=self.transport,
        )

    def _loop(self) -> None:
        """The scheduler loop. If it dies (a bug), it says so: every request in flight gets
        an error event, new ones fail at once, and the snapshot says why (/health is 503)."""
        try:
            self._run_loop()
        except BaseException as exc:
            logger.exception("the scheduler loop died")
            self._loop_error = f"the scheduler loop died: {exc!r}"
            self._snapshot = replace(
                self._snapshot, time_s=time.monotonic(), unavailable_reason=self._loop_error
            )
            self._fail_listeners(self._loop_error)
            raise

    def _run_loop(self) -> None:
        next_snapshot_s = 0.0
        while not self._stop.is_set():
            # Cancellations taken before run_once: their requests were submitted before they
            # were cancelled, so run_once has handed them to the coordinator by now.
            cancels = drain(self._cancellations)
            wait_s = min(LOOP_WAIT_S, next_snapshot_s - time.monotonic())
            self.coordinator.run_once(max(0.0, wait_s))
            for request_id in cancels:
                self.coordinator.cancel(request_id)
            self._dispatch(self.coordinator.drain_events())
            if cancels:  # no event of theirs can come any more
                with self._lock:
                    self._cancelled.difference_update(cancels)
            now_s = time.monotonic()
            if now_s >= next_snapshot_s:
                self._snapshot = self._take_snapshot(now_s)
                next_snapshot_s = now_s + SNAPSHOT_INTERVAL_S

    def _dispatch(self, events: list[RequestEvent]) -> None:
        if not events:
            return
        with self._lock:
            for event in events:
                request_id = event.request_id
                if request_id in self._cancelled:
                    continue
                listener = self._listeners.get(request_id)
                if listener is None:
                    self._waiters.setdefault(request_id, []).append(event)
                    continue
                if event.finish_reason is not None:
                    del self._listeners[request_id]
                listener(event)

    def _take_snapshot(self, now_s: float) -> ClusterSnapshot:
        snapshot = self.coordinator.snapshot(now_s)
        restarts = dict(self.processes.num_restarts)
        if self._loop_error is not None or restarts:
            return replace(
                snapshot,
                unavailable_reason=self._loop_error or snapshot.unavailable_reason,
                engine_restarts=restarts,
            )
        return snapshot

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engines (they flush their pending store writes first) and the loop.

        Idempotent and callable from any thread, also while ``start`` waits. Streaming
        requests still running get a final ``"error"`` event saying the cluster stopped.
        """
        self._closing.set()
        self.processes.expect_exits()
        with self._spawn_lock:  # start() spawns nothing more after this
            if self._is_closed:
                return
            self._is_closed = True
        if self._loop_thread.is_alive():
            self._stop.set()
            self.coordinator.wake()
            self._loop_thread.join()
        # The loop thread is gone: this thread may use the coordinator now.
        self.coordinator.shutdown()
        self.processes.stop(timeout_s)
        self.coordinator.close()
        self._fail_listeners("cluster stopped")

    def _fail_listeners(self, reason: str) -> None:
        """End every streaming request with an error event (the loop that would have sent
        their events is gone)."""
        with self._lock:
            listeners, self._listeners = self._listeners, {}
            for request_id, listener in listeners.items():
                listener(
                    RequestEvent(request_id, (), "error", 0, error=reason, is_unavailable=True)
                )

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engine_pids(self) -> list[int]:
        return self.processes.pids

    # --- requests ---------------------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        on_event: EventListener | None = None,
        scope: RequestScope = NO_SCOPE,
    ) -> int:
        """Queue a request; returns its id. Thread-safe; ``ValueError`` for a bad request.
        ``scope``: its tenant's cache salt and its agent session, if named.

        ``ClusterUnavailable`` once the scheduler loop has died.

        Without ``on_event`` its events are kept for ``result``. With it, every event of the
        request is passed to ``on_event`` in order, on the scheduler loop thread, the last one
        with ``finish_reason`` set; ``on_event`` must return quickly and must not block.
        """
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        if self._loop_error is not None:
            raise ClusterUnavailable(self._loop_error)
        arrival_s = time.monotonic()
        request_id = self.coordinator.submit(prompt_token_ids, params, scope)
        if on_event is None:
            self._arrivals[request_id] = arrival_s
            return request_id
        with self._lock:
            # Events the loop handed out before the listener was in place come first.
            early = self._waiters.pop(request_id, [])
            if not (early and early[-1].finish_reason is not None):
                self._listeners[request_id] = on_event
            for event in early:
                on_event(event)
        return request_id

    def cancel(self, request_id: int) -> None:
        """Stop a request wherever it is; its engines free its buffers and KV. Thread-safe.

        No event of the request is delivered after this returns, and it has no ``result``.
        Cancelling a finished or unknown request does nothing.
        """
        with self._lock:
            self._listeners.pop(request_id, None)
            self._waiters.pop(request_id, None)
            self._cancelled.add(request_id)
        self._arrivals.pop(request_id, None)
        self._cancellations.put(request_id)
        self.coordinator.wake()

    def report_unreachable(self, engine_id: int, why: str) -> None:
        """A vLLM server engine's HTTP connection failed: declare it dead now (thread-safe);
        what it held is failed as lost to the front door, which places it again."""
        self.coordinator.on_engine_unreachable(engine_id, why)

    def snapshot(self) -> ClusterSnapshot:
        """The latest state the loop thread published (at most ``SNAPSHOT_INTERVAL_S`` old)."""
        return self._snapshot

    def result(self, request_id: int, timeout_s: float) -> ClusterOutput:
        """Block until the request finishes (or fails); ``TimeoutError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                events = self._waiters.get(request_id, [])
                if events and events[-1].finish_reason is not None:
                    del self._waiters[request_id]
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id} not finished in {timeout_s} s")
            time.sleep(0.002)
        last = events[-1]
        return ClusterOutput(
            request_id=request_id,
            token_ids=[t for e in events for t in e.token_ids],
            finish_reason=last.finish_reason,
            num_cached_tokens=last.num_cached_tokens,
            error=last.error,
            arrival_s=self._arrivals.pop(request_id),
            first_token_s=next((e.time_s for e in events if e.token_ids), None),
            finish_s=last.time_s,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, timeout_s: float = 300.0
    ) -> list[ClusterOutput]:
        request_ids = [self.submit(p, params) for p in prompts]
        return [self.result(r, timeout_s) for r in request_ids]

"""One engine process ("one engine = one GPU"): a PE or a DE joined to the scheduler.

    dualpath engine --role prefill --scheduler tcp://HOST:PORT --engine-id 0 --node-id 0 ...

It loads the model, registers its KV buffer with the transport, says hello with the cluster
token, and then loops: handle the scheduler's messages, do one unit of work (a prefill batch
or a decode step), report its load every fetch interval (the pull of SPEC §6). It exits on
``Shutdown``, when the scheduler has been silent for ``heartbeat_timeout_s``, on SIGTERM, and
(Linux) when its parent dies.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

import msgpack

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
)
from dualpath.config import ClusterConfig, EngineConfig, KVStoreConfig, TrafficConfig
from dualpath.control.channel import ControlClient
from dualpath.control.codec import encode
from dualpath.engine.buffers import KVBuffer
from dualpath.engine.decode import DecodeEngine
from dualpath.engine.llm import LLMEngine
from dualpath.engine.prefill import PrefillEngine
from dualpath.engine.profile import profile_layer_time
from dualpath.engine.remote_buffer import TransportRemoteBuffer, TransportStaging
from dualpath.errors import DualPathError
from dualpath.kv.store import FileKVStore, KVStore
from dualpath.lifetime import die_with_parent
from dualpath.model.identity import kv_identity
from dualpath.model.loader import load_model
from dualpath.scheduler.batching import PrefillBatcher
from dualpath.transfer.clock import MonotonicClock
from dualpath.transfer.links import TrafficClass, engine_link_specs
from dualpath.transfer.node_limiter import NodeLimiter
from dualpath.transfer.traffic import TrafficManager
from dualpath.transfer.transport import BufferDescriptor, create_transport

logger = logging.getLogger(__name__)

# The engine's store counters in its reports, as "store_<name>" (the metrics' source).
_REPORTED_STORE_STATS = (
    "reads",
    "read_bytes",
    "writes",
    "write_bytes",
    "evictions",
    "corrupt_blocks",
    "missing_on_read",
    "write_errors",
)
# Longest context the start-up profile times (~0.4 s for the tiny model on one CPU thread);
# the fitted quadratic term extrapolates beyond it.
_MAX_PROFILED_CONTEXT_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class EngineProcessConfig:
    role: str  # PREFILL or DECODE
    engine_id: int
    node_id: int
    scheduler_endpoint: str
    token: str
    model_dir: Path
    store: KVStoreConfig
    engine: EngineConfig
    cluster: ClusterConfig
    transport: str = "nixl"  # or "shm"
    # How often the engine reports its load (SPEC §6's fetch interval: 10 ms).
    fetch_interval_s: float = 0.010
    # An idle engine whose report would not change sends it only this often (a keep-alive,
    # well inside the heartbeat timeout); the scheduler fetches for idle groups itself. At
    # 10 ms, three idle engines and their scheduler burned half a core between them.
    report_keepalive_s: float = 0.25
    # Upper bound of one wait on a peer (a transfer, the scheduler's first answer).
    peer_timeout_s: float = 30.0
    # On exit, how long pending store writes may take to finish. Past it they are abandoned
    # and the process exits anyway: a store that hangs (a cut-off network mount) must not
    # keep a stopped engine alive. The blocks are recomputed when next needed.
    store_flush_timeout_s: float = 10.0
    # PE: predicted time of one layer per prefill batch (SPEC §6's compute quota; the
    # paper's 300 ms). The predictor is profiled on this engine at start-up.
    attention_quota_s: float = 0.300

    def __post_init__(self) -> None:
        if self.role not in (PREFILL, DECODE):
            raise ValueError(f"role must be {PREFILL!r} or {DECODE!r}, got {self.role!r}")


class _Stop(Exception):
    """Raised inside the loop to leave it (shutdown, lost scheduler, signal)."""


def run_engine(config: EngineProcessConfig) -> int:
    """Run until told to stop; 0 on a clean shutdown, 1 when the scheduler was lost."""
    die_with_parent()
    signal.signal(signal.SIGTERM, _raise_stop)
    process = _EngineProcess(config)
    exit_code = 1
    try:
        exit_code = process.run()
    finally:
        num_abandoned = process.close()
        if num_abandoned:
            # Their writer threads are stuck in the store, and the interpreter would wait for
            # them at exit.
            logger.error("exiting with %d store writes unfinished: the store hangs", num_abandoned)
            logging.shutdown()
            os._exit(exit_code)
    return exit_code


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(f"signal {signum}")


class _EngineProcess:
    def __init__(self, config: EngineProcessConfig) -> None:
        self.config = config
        engine_config = config.engine
        loaded = load_model(
            config.model_dir, device=engine_config.device, dtype=engine_config.dtype
        )
        self.identity = kv_identity(
            loaded.config,
            loaded.weights_digest,
            engine_config.dtype,
            engine_config.block_size_tokens,
        )
        self.traffic, self._link_names, self._limiter = _make_traffic(config)
        self.transport = create_transport(config.transport, f"engine-{config.engine_id}")
        cluster = config.cluster
        is_prefill = config.role == PREFILL
        buffer_bytes = cluster.prefill_buffer_bytes if is_prefill else cluster.decode_buffer_bytes
        is_cuda = loaded.device.type == "cuda"
        self.buffer = KVBuffer(
            self.identity.layout,
            buffer_bytes,
            pin_memory=is_cuda,
            allocate=None if is_cuda else self.transport.allocate_host_buffer,
        )
        self.buffer_descriptor = self.transport.register("kv-buffer", self.buffer.array)
        self.client = ControlClient(
            config.scheduler_endpoint, f"engine-{config.engine_id}", config.token
        )
        self.prefill: PrefillEngine | None = None
        self.decode: DecodeEngine | None = None
        if is_prefill:
            if engine_config.num_threads is not None:
                import torch

                torch.set_num_threads(engine_config.num_threads)
            store = (
                FileKVStore.from_config(
                    config.store, self.identity.layout, self.identity.fingerprint
                )
                if config.store.is_enabled
                else None
            )
            max_model_len = engine_config.max_model_len or loaded.config.max_position_embeddings
            block_size = engine_config.block_size_tokens
            self.prefill = PrefillEngine(
                loaded.model,
                self.identity,
                store,
                self.buffer,
                dtype=loaded.dtype,
                device=loaded.device,
                is_layerwise=cluster.settings.is_layerwise,
                mover=self._move,
                on_read_done=self.client.wake,
                batcher=PrefillBatcher(
                    profile_layer_time(
                        loaded.model,
                        device=loaded.device,
                        max_context_tokens=min(max_model_len, _MAX_PROFILED_CONTEXT_TOKENS),
                    ),
                    quota_s=config.attention_quota_s,
                    min_chunk_tokens=block_size,
                    chunk_align_tokens=block_size,
                ),
            )
            max_blocks = -(-loaded.config.max_position_embeddings // block_size)
            self.staging = TransportStaging(
                self.transport,
                self.identity.layout,
                max_read_blocks=max_blocks,
                ring_blocks=max_blocks,
            )
        else:
            llm_engine = LLMEngine(loaded, engine_config, config.store, mover=self._move)
            self.decode = DecodeEngine(
                llm_engine, self.buffer, mover=self._move, on_read_done=self.client.wake
            )
        self.remotes: dict[int, TransportRemoteBuffer] = {}
        self.last_heard_s = time.monotonic()
        self.last_report_s = 0.0
        self._last_report: EngineReport | None = None  # the last one sent
        self._last_report_sent_s = 0.0
        self.busy_s = 0.0  # wall time spent in prefill batches or decode steps
        # Messages that arrived mid-batch and wait for its end (``_between_layers``).
        self._deferred: list[object] = []

    def _send(self, msg: object) -> None:
        """A control message to the scheduler: ``inference`` traffic on this engine's CNIC
        (reports, token streaming), ahead of KV by the arbiter's weights (SPEC §4)."""
        data = encode(msg)
        self.traffic.move(
            self._link_names["cnic"],
            TrafficClass.INFERENCE,
            len(data),
            lambda: self.client.send_encoded(data),
            timeout_s=self.config.peer_timeout_s,
        )

    def _move(self, link: str, num_bytes: int, do_move):
        return self.traffic.move(
            self._link_names[link],
            TrafficClass.KV,
            num_bytes,
            do_move,
            timeout_s=self.config.peer_timeout_s,
        )

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        config = self.config
        self.client.connect(timeout_s=config.peer_timeout_s)
        num_kv_blocks = 0 if self.decode is None else self.decode.engine.pool.num_blocks
        self._send(
            EngineInfo(
                config.engine_id,
                config.role,
                config.node_id,
                self.transport.__class__.__name__,
                self.transport.metadata(),
                msgpack.packb(self.buffer_descriptor.to_dict()),
                self.buffer.num_slots,
                num_kv_blocks,
            )
        )
        self.last_heard_s = time.monotonic()
        try:
            while True:
                start_s = time.perf_counter()
                is_busy = self._work()
                if is_busy:
                    self.busy_s += time.perf_counter() - start_s
                deferred, self._deferred = self._deferred, []
                for msg in deferred:
                    self._handle(msg)
                for msg in self.client.poll(0.0 if is_busy else config.fetch_interval_s):
                    self._handle(msg)
                now_s = time.monotonic()
                if now_s - self.last_heard_s > config.cluster.heartbeat_timeout_s:
                    logger.error("scheduler silent for %.1f s: exiting", now_s - self.last_heard_s)
                    return 1
                self._report_if_due(now_s)
        except _Stop as stop:
            logger.info("engine %d stopping: %s", config.engine_id, stop)
            return 0

    def _report_if_due(self, now_s: float) -> None:
        if now_s - self.last_report_s >= self.config.fetch_interval_s:
            self._report(now_s)
            self.last_report_s = now_s

    def _between_layers(self) -> None:
        """Mid-batch on a PE: take the scheduler's messages and report on time. A prefill
        batch lasts up to the compute quota per layer (SPEC §6) times the layers, seconds on
        a CPU; handled only between batches, requests placed meanwhile would start their
        PE-side reads late and the group's fetch would wait for the batch's end, leaving the
        PE node's SNIC idle while the DE nodes' read. New requests only start reads here;
        cancels and shutdowns, which would free this batch's buffers, wait for its end."""
        for msg in self.client.poll(0.0):
            if isinstance(msg, (CancelRequest, Shutdown)):
                self._deferred.append(msg)
            else:
                self._handle(msg)
        self._report_if_due(time.monotonic())

    def _handle(self, msg: object) -> None:
        self.last_heard_s = time.monotonic()
        if isinstance(msg, Assignment):
            self._assign(msg)
        elif isinstance(msg, DecodeReady) and self.prefill is not None:
            self.prefill.on_decode_ready(msg)
        elif isinstance(msg, PrefillDone) and self.decode is not None:
            self.decode.on_prefill_done(msg)
        elif isinstance(msg, CancelRequest):
            (self.prefill or self.decode).cancel(msg.request_id)
        elif isinstance(msg, PeerTable):
            self._connect_peers(msg)
        elif isinstance(msg, Shutdown):
            raise _Stop(f"shutdown: {msg.reason}")
        elif not isinstance(msg, Heartbeat):
            logger.warning("unexpected %s", type(msg).__name__)

    def _assign(self, assignment: Assignment) -> None:
        try:
            if self.prefill is not None:
                self.prefill.add(assignment)
            else:
                self.decode.add(assignment)
        except ValueError as exc:
            self._send(RequestFailed(assignment.request_id, str(exc)))
        except Exception as exc:  # a bug this request met: it fails, the engine goes on
            logger.exception("request %d could not be added", assignment.request_id)
            self._send(RequestFailed(assignment.request_id, f"engine error: {exc!r}"))

    def _connect_peers(self, table: PeerTable) -> None:
        if self.prefill is None:
            return  # the DE is only ever the remote side
        for info in table.engines:
            if info.role != DECODE or info.engine_id in self.remotes:
                continue
            peer_name = f"engine-{info.engine_id}"
            self.transport.connect(peer_name, info.transport_metadata)
            descriptor = BufferDescriptor.from_dict(msgpack.unpackb(info.buffer_descriptor))
            self.remotes[info.engine_id] = TransportRemoteBuffer(
                self.staging, peer_name, descriptor, timeout_s=self.config.peer_timeout_s
            )

    def _work(self) -> bool:
        """One unit of work; True if there was any (then poll without waiting)."""
        if self.prefill is not None:
            # A request waits until its DE's transport metadata has arrived.
            batch = self.prefill.next_batch(
                lambda request: request.assignment.decode_engine_id in self.remotes
            )
            if not batch:
                return False
            try:
                finished = self.prefill.run_batch(
                    batch, self.remotes.__getitem__, self._between_layers
                )
            except Exception as exc:  # its requests are cancelled here; the engine goes on
                # A DE died or timed out mid-transfer: placing them again may succeed. Any
                # other error is a bug these requests met: placing them again would repeat it.
                is_retryable = isinstance(exc, DualPathError)
                if is_retryable:
                    logger.error("prefill batch failed: %s", exc)
                else:
                    logger.exception("prefill batch failed")
                for request, _ in batch:
                    self._send(
                        RequestFailed(
                            request.request_id,
                            f"prefill failed: {exc!r}",
                            is_retryable=is_retryable,
                        )
                    )
                return True
            for done in finished:
                self._send(done)
            return True
        assert self.decode is not None
        for ready in self.decode.poll_ready():
            self._send(ready)
        try:
            updates = self.decode.step()
        except Exception as exc:
            self._fail_all_decodes(exc)
            return True
        for update in updates:
            self._send(update)
        persisted = self.decode.poll_persisted()
        if persisted is not None:
            self._send(persisted)
        return bool(updates) or self.decode.engine.has_unfinished_requests()

    def _fail_all_decodes(self, exc: Exception) -> None:
        """A decode step raised (a bug: the sampler and the cache raise on no request's
        values): the step's batch is every running request, so all of this engine's requests
        fail and are freed, and the engine goes on serving new ones."""
        logger.exception("decode step failed")
        for request_id in self.decode.request_ids:
            self.decode.cancel(request_id)
            self._send(RequestFailed(request_id, f"decode failed: {exc!r}"))

    def _report(self, now_s: float) -> None:
        """Report the load (the group's fetch when this engine leads it); an idle engine whose
        report is the last one sent again only keeps alive (``report_keepalive_s``)."""
        engine = self.prefill or self.decode
        if self.decode is not None:
            num_seqs, num_tokens = self.decode.num_seqs, self.decode.num_tokens
            num_free = self.decode.engine.pool.num_free_blocks
            num_write_tokens = self.decode.num_queued_write_tokens
        else:
            num_seqs, num_tokens, num_free = len(self.prefill.requests), self.prefill.num_tokens, 0
            num_write_tokens = 0  # a PE persists nothing (SPEC §2)
        report = EngineReport(
            self.config.engine_id,
            num_seqs,
            num_tokens,
            num_free,
            engine.num_queued_read_tokens,
            self._link_bytes(),
            self.buffer.num_used_bytes // self.identity.layout.full_block_bytes,
            num_write_tokens,
        )
        keepalive_s = min(
            self.config.report_keepalive_s, self.config.cluster.heartbeat_timeout_s / 4
        )
        if (
            not (num_seqs or num_tokens or report.read_queue_tokens or num_write_tokens)
            and now_s - self._last_report_sent_s < keepalive_s
            and _same_but_reports(report, self._last_report)
        ):
            return
        self._send(report)
        self._last_report, self._last_report_sent_s = report, now_s

    def _link_bytes(self) -> dict[str, int]:
        # Read before the links: a read is counted here only after its SNIC movement finished,
        # so in one report the SNIC bytes always cover store_read_bytes.
        engine = self.prefill or self.decode
        store_read_bytes = engine.num_read_bytes
        counters: dict[str, int] = {}
        for link in self.traffic.stats().links:
            for traffic_class, moved in link.class_to_moved_bytes.items():
                counters[f"{link.name}.{TrafficClass(traffic_class).name.lower()}"] = int(moved)
        counters["store_read_bytes"] = store_read_bytes
        counters["busy_us"] = int(self.busy_s * 1e6)
        counters["buffer_used_bytes"] = self.buffer.num_used_bytes  # a level, not cumulative
        counters["buffer_capacity_bytes"] = (
            self.buffer.num_slots * self.buffer.layout.full_block_bytes
        )
        store = self._store()
        if store is not None:
            stats = store.stats()
            for name in _REPORTED_STORE_STATS:
                counters[f"store_{name}"] = getattr(stats, name)
        return counters

    def _store(self) -> KVStore | None:
        if self.prefill is not None:
            return self.prefill.store
        store_io = self.decode.engine.store_io
        return None if store_io is None else store_io.store

    def close(self) -> int:
        """Release everything; the number of store writes abandoned unfinished (see
        ``store_flush_timeout_s``), after which the engine's store is left open."""
        for part in (self.prefill, self.decode):
            if part is not None:
                part.close()
        num_abandoned = 0
        if self.decode is not None:
            store_io = self.decode.engine.store_io
            if store_io is not None:
                num_abandoned = store_io.flush(self.config.store_flush_timeout_s)
            if not num_abandoned:
                self.decode.engine.close()
        self.client.close()
        self.transport.close()
        if self._limiter is not None:
            self._limiter.close()
        return num_abandoned


def _same_but_reports(report: EngineReport, last: EngineReport | None) -> bool:
    """Whether ``report`` says what ``last`` said, but for the ``inference`` traffic that
    sending reports itself adds (every report would otherwise differ from the last)."""
    if last is None or replace(report, link_bytes={}) != replace(last, link_bytes={}):
        return False
    return _without_inference(report.link_bytes) == _without_inference(last.link_bytes)


def _without_inference(counters: dict[str, int]) -> dict[str, int]:
    suffix = "." + TrafficClass.INFERENCE.name.lower()
    return {name: n for name, n in counters.items() if not name.endswith(suffix)}


def _make_traffic(
    config: EngineProcessConfig,
) -> tuple[TrafficManager, dict[str, str], NodeLimiter | None]:
    """The engine's traffic manager, its short link names ("snic", "cnic") -> link names,
    and the node-wide SNIC limiter shared with the node's other engines (SPEC §1)."""
    cluster = config.cluster
    traffic_config = cluster.traffic
    if cluster.settings.is_io_free:  # oracle: no link costs anything
        traffic_config = TrafficConfig()
    links = engine_link_specs(traffic_config, node_id=config.node_id, engine_id=config.engine_id)
    clock = MonotonicClock()
    node_limiters = {}
    limiter = None
    if links.snic.is_capped:
        # Named after the cluster (a hash of its token, which must not leak into a file name).
        cluster_id = hashlib.sha256(config.token.encode()).hexdigest()[:12]
        limiter = NodeLimiter.for_node(
            config.node_id, links.snic.bandwidth_gbps, clock=clock, cluster_id=cluster_id
        )
        node_limiters[links.snic.name] = limiter
    traffic = TrafficManager(
        links.all(),
        clock=clock,
        weights=traffic_config.class_weights,
        window_s=traffic_config.utilisation_window_s,
        gap_fill_s=traffic_config.gap_fill_s,
        node_limiters=node_limiters,
    )
    return traffic, {"snic": links.snic.name, "cnic": links.cnic.name}, limiter

"""One engine process ("one engine = one GPU"): a PE or a DE joined to the scheduler.

    dualpath engine --config engine.json          # what dualpath serve starts
    dualpath engine --role prefill --scheduler tcp://HOST:PORT --engine-id 0 --node-id 0 ...

It loads the model, registers its KV buffer with the transport, says hello with the cluster
token, and then loops: handle the scheduler's messages, do one unit of work (a prefill batch
or a decode step: its ``RoleEngine``, ``engine/role.py``; ours in ``roles.py``, vLLM's in
``dualpath.vllm.roles``), report its load every fetch interval (the pull of SPEC §6).

Its liveness, both ways: a thread of its own (``engine_heartbeat.HeartbeatThread``, started
after the hello, stopped when the loop ends) sends the scheduler an ``EngineHeartbeat`` every
heartbeat period, with how long the unit of work in progress has run, so a unit longer than
the heartbeat timeout (a long prefill on a loaded CPU) is seen as busy, not dead. The loop
itself hears the scheduler's ``Heartbeat``s between its units of work.

It exits on ``Shutdown`` or SIGTERM (0), when it loses the scheduler (``EXIT_SCHEDULER_LOST``:
no answer to its hello, silence for ``SCHEDULER_SILENCE_TIMEOUTS`` heartbeat timeouts seen
between units of work, or the scheduler no longer knowing it, having declared it dead; also
when its transport cannot start, as on a host whose network is down, or its store's file
system is out of reach, as a network mount not reconnected yet), and (Linux) when its
parent dies.
Whoever supervises it (``dualpath serve``, or ``dualpath engine`` itself: ``engine_processes``)
starts it again after a lost scheduler: a fresh engine rejoins under its id, with nothing of
the requests the scheduler has already placed elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace

import msgpack

from dualpath.cluster.engine_heartbeat import HeartbeatThread
from dualpath.cluster.engine_processes import EXIT_SCHEDULER_LOST
from dualpath.cluster.engine_traffic import make_engine_traffic
from dualpath.cluster.roles import make_role
from dualpath.config import EngineProcessConfig
from dualpath.control.channel import ControlClient, Rejected
from dualpath.control.codec import encode
from dualpath.engine.buffers import KVBuffer
from dualpath.engine.capacity import role_buffer_bytes
from dualpath.engine.role import RoleEngine
from dualpath.errors import KVStoreError, TransferError, TransferTimeout, is_out_of_reach
from dualpath.lifetime import die_with_parent, ignore_stop_signals
from dualpath.model.identity import checkpoint_kv_identity, kv_identity, vllm_device
from dualpath.model.loader import LoadedModel, load_model
from dualpath.model.registry import AnyModelConfig
from dualpath.protocol import (
    HEARTBEATS_PER_TIMEOUT,
    SCHEDULER_SILENCE_TIMEOUTS,
    TRANSPORT_READ_PREFIX,
    TRANSPORT_WRITTEN_PREFIX,
    Assignment,
    CancelRequest,
    DecodeReady,
    EngineInfo,
    EngineReport,
    Heartbeat,
    PeerTable,
    PrefillDone,
    PrefillHeld,
    RequestFailed,
    Shutdown,
)
from dualpath.transfer.links import TrafficClass
from dualpath.transfer.transport import create_transport

logger = logging.getLogger(__name__)

# The engine's store counters in its reports, as "store_<name>" (the metrics' source).
_REPORTED_STORE_STATS = (
    "reads",
    "read_bytes",
    "writes",
    "write_bytes",
    "evictions",
    "retained_evictions",
    "corrupt_blocks",
    "missing_on_read",
    "write_errors",
)


class _Stop(Exception):
    """Raised inside the loop to leave it (shutdown, signal)."""


class _SchedulerLost(Exception):
    """Raised inside the loop when the scheduler is gone or no longer knows this engine."""


def run_engine(config: EngineProcessConfig, token: str) -> int:
    """Run until told to stop (``token``: the cluster's); 0 on a clean shutdown,
    ``EXIT_SCHEDULER_LOST`` when the scheduler was lost."""
    die_with_parent()
    process: EngineProcess | None = None
    signal.signal(signal.SIGTERM, stop_handler(lambda: process))
    try:
        process = EngineProcess(config, token)
    except TransferError as exc:
        # Its transport could not start: the host's network is down (UCX finds no usable
        # device while the link is cut). Not a configuration refused (exit 2, never started
        # again): a host cut off rejoins once it is back, as after a lost scheduler.
        logger.error("engine %d: %s: exiting", config.engine_id, exc)
        return EXIT_SCHEDULER_LOST
    except (KVStoreError, OSError) as exc:
        if not is_out_of_reach(exc):
            raise
        # The store's file system is out of reach (a network mount whose servers this host
        # cannot reach yet, as after its link was cut): started again until it is back, as
        # after a lost scheduler. A store refused otherwise (permissions, no such path) is
        # still the configuration error it was.
        logger.error("engine %d: the KV store is out of reach (%s): exiting", config.engine_id, exc)
        return EXIT_SCHEDULER_LOST
    exit_code = 1  # a crash, unless run() returns
    try:
        exit_code = process.run()
    finally:
        ignore_stop_signals()  # stopping already: a SIGTERM now must not break the close
        num_abandoned = process.close()
        if num_abandoned:
            # Their writer threads are stuck in the store, and the interpreter would wait for
            # them at exit.
            logger.error("exiting with %d store writes unfinished: the store hangs", num_abandoned)
            logging.shutdown()
            os._exit(exit_code)
    return exit_code


def stop_handler(process: Callable[[], EngineProcess | None]) -> Callable[[int, object], None]:
    """SIGTERM's handler: it stops the engine (``_Stop`` in its loop) once. Every later stop
    signal is ignored, and none raises once the engine is leaving its loop: it arrives twice
    where the engine's supervisor stops it and then exits (the parent-death signal), and a
    second ``_Stop`` raised inside the first one's way out could land between a lock's
    acquire and its ``with`` (the heartbeat thread's stop event), leaving the lock held and the
    engine's close waiting on it for ever (an engine left behind, found so)."""

    def stop(signum: int, frame: object) -> None:
        ignore_stop_signals()
        engine = process()
        if engine is None or not engine.is_leaving:
            raise _Stop(f"signal {signum}")

    return stop


class EngineProcess:
    def __init__(
        self,
        config: EngineProcessConfig,
        token: str,
        *,
        served_engine: object = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``served_engine``: the vLLM engine this runs beside, in a vLLM server the user
        started (``dualpath.vllm.served``); None builds the engine here. ``clock``: the
        liveness clock (the scheduler's silence, the step time in heartbeats)."""
        self.config = config
        self.clock = clock
        self._token = token
        engine_config = config.engine
        is_vllm = engine_config.engine == "vllm"
        loaded = None  # vLLM loads the model itself
        if is_vllm:
            model_config, self.identity = checkpoint_kv_identity(
                config.model_dir,
                engine_config.dtype,
                engine_config.block_size_tokens,
                "vllm",
                vllm_device(),
            )
        else:
            loaded = load_model(
                config.model_dir, device=engine_config.device, dtype=engine_config.dtype
            )
            model_config = loaded.config
            self.identity = kv_identity(
                loaded.config,
                loaded.weights_digest,
                engine_config.dtype,
                engine_config.block_size_tokens,
            )
        self.traffic, self._link_names, self._limiter = make_engine_traffic(config, token)
        self.transport = create_transport(config.transport, f"engine-{config.engine_id}")
        max_model_len = engine_config.max_model_len or model_config.max_position_embeddings
        buffer_bytes = role_buffer_bytes(
            config.cluster, config.role, self.identity.layout, max_model_len
        )
        is_cuda = loaded is not None and loaded.device.type == "cuda"
        self.buffer = KVBuffer(
            self.identity.layout,
            buffer_bytes,
            pin_memory=is_cuda,
            allocate=None if is_cuda else self.transport.allocate_host_buffer,
        )
        self.buffer_descriptor = self.transport.register("kv-buffer", self.buffer.array)
        self.client = ControlClient(config.scheduler_endpoint, f"engine-{config.engine_id}", token)
        self.role = self._make_role(loaded, model_config, served_engine)
        self.last_heard_s = clock()
        # When the unit of work in progress began (``clock``), None between units: the
        # heartbeat thread reads it.
        self._step_start_s: float | None = None
        self.heartbeat: HeartbeatThread | None = None  # while ``run`` runs
        self.is_leaving = False  # ``run``'s loop has ended (``stop_handler``)
        self.last_report_s = 0.0
        self._last_report: EngineReport | None = None  # the last one sent
        self._last_report_sent_s = 0.0
        self.busy_s = 0.0  # wall time spent in prefill batches or decode steps
        # Messages that arrived mid-batch and wait for its end (``_between_layers``).
        self._deferred: list[object] = []

    def _make_role(
        self, loaded: LoadedModel | None, model_config: AnyModelConfig, served_engine: object
    ) -> RoleEngine:
        """The engine's role: ours over ``loaded``, or vLLM's (``loaded`` None)."""
        config = self.config
        if loaded is None:
            from dualpath.vllm.roles import make_vllm_role

            return make_vllm_role(
                config,
                model_config,
                self.identity,
                self.buffer,
                self.transport,
                mover=self._move,
                wake=self._wake,
                engine=served_engine,
            )
        return make_role(
            config,
            loaded,
            self.identity,
            self.buffer,
            self.transport,
            mover=self._move,
            wake=self._wake,
        )

    def _wake(self) -> None:
        self.client.wake()  # the client of the moment (a served engine joins again anew)

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
            timeout_s=self.config.transfer_timeout_s,
        )

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        config = self.config
        try:
            self.client.connect(timeout_s=config.peer_timeout_s)
        except TransferTimeout as exc:
            logger.error("%s: exiting", exc)
            return EXIT_SCHEDULER_LOST
        self._send(
            EngineInfo(
                config.engine_id,
                config.role,
                config.node_id,
                self.transport.__class__.__name__,
                self.transport.metadata(),
                msgpack.packb(self.buffer_descriptor.to_dict()),
                self.buffer.num_slots,
                self.role.num_kv_blocks,
                url=config.url,
                kv_fingerprint=self.identity.fingerprint,
                # Only a vLLM PE that probes vLLM's prefix cache says what it holds.
                reports_prefill_held=getattr(self.role, "reports_prefill_held", False),
                prefills_locally=getattr(self.role, "prefills_locally", False),
            )
        )
        self.last_heard_s = self.clock()
        self.is_leaving = False
        self.heartbeat = HeartbeatThread(
            self.client.endpoint,
            self.client.client_id,
            self._token,
            config.engine_id,
            period_s=config.cluster.heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT,
            step_s=self.step_s,
        )
        self.heartbeat.start()
        try:
            while True:
                is_busy = self._work()
                idle_s = 0.0 if is_busy else config.scheduler.fetch_interval_s
                self._take(self.client.poll(idle_s))
        except _Stop as stop:
            logger.info("engine %d stopping: %s", config.engine_id, stop)
            return 0
        except _SchedulerLost as lost:
            logger.error("engine %d lost the scheduler (%s): exiting", config.engine_id, lost)
            return EXIT_SCHEDULER_LOST
        finally:
            # No stop signal raises from here on (``stop_handler``); one that came just before
            # must not escape: the engine is leaving run() already.
            with contextlib.suppress(_Stop):
                self.is_leaving = True
            # With this client: a served engine rejoins with a new one.
            self.heartbeat.stop()

    def step_s(self) -> float:
        """How long the unit of work in progress has run; 0.0 between units (any thread)."""
        start_s = self._step_start_s  # read once: the loop may end the unit meanwhile
        return 0.0 if start_s is None else max(0.0, self.clock() - start_s)

    def _work(self) -> bool:
        """One unit of the role's work, then the messages that waited for it; whether it was
        busy (then the next poll does not wait)."""
        start_s = time.perf_counter()
        self._step_start_s = self.clock()
        try:
            is_busy = self.role.work(self._send, self._between_layers)
        finally:
            self._step_start_s = None
        if is_busy:
            self.busy_s += time.perf_counter() - start_s
        deferred, self._deferred = self._deferred, []
        for msg in deferred:
            self._handle(msg)
        return is_busy

    def _take(self, messages: list[object]) -> None:
        """The scheduler's messages, its liveness, and this engine's report when due."""
        for msg in messages:
            self._handle(msg)
        now_s = self.clock()
        silence_s = self.config.cluster.heartbeat_timeout_s * SCHEDULER_SILENCE_TIMEOUTS
        if now_s - self.last_heard_s > silence_s:
            raise _SchedulerLost(f"scheduler silent for {now_s - self.last_heard_s:.1f} s")
        self._report_if_due(now_s)

    def _report_if_due(self, now_s: float) -> None:
        if now_s - self.last_report_s >= self.config.scheduler.fetch_interval_s:
            self._report(now_s)
            self.last_report_s = now_s

    def _between_layers(self) -> None:
        """Mid-batch on a PE (and mid-step on a vLLM DE): take the scheduler's messages and
        report on time. A prefill batch lasts up to the compute quota per layer (SPEC §6) times
        the layers, seconds on a CPU; handled only between batches, requests placed meanwhile
        would start their PE-side reads late and the group's fetch would wait for the batch's
        end, leaving the PE node's SNIC idle while the DE nodes' read. A DE's requests take
        their slots and start their reads here, so their PE need not wait for the DE's step
        to end. New requests only start reads here; cancels and shutdowns, which would free
        this batch's buffers, wait for its end."""
        for msg in self.client.poll(0.0):
            if isinstance(msg, (CancelRequest, Shutdown)):
                self._deferred.append(msg)
            else:
                self._handle(msg)
        self._report_if_due(self.clock())

    def _handle(self, msg: object) -> None:
        if isinstance(msg, Rejected):
            # Declared dead (a silence the scheduler saw and this engine did not): its
            # requests are placed elsewhere already, so it leaves and joins again afresh.
            raise _SchedulerLost(f"the scheduler no longer knows this engine: {msg.reason}")
        self.last_heard_s = self.clock()
        if isinstance(msg, Assignment):
            self._assign(msg)
        elif isinstance(msg, (DecodeReady, PrefillDone, PrefillHeld)):
            self.role.on_peer_message(msg)
        elif isinstance(msg, CancelRequest):
            self.role.cancel(msg.request_id)
        elif isinstance(msg, PeerTable):
            self.role.connect_peers(msg)
        elif isinstance(msg, Shutdown):
            raise _Stop(f"shutdown: {msg.reason}")
        elif not isinstance(msg, Heartbeat):
            logger.warning("unexpected %s", type(msg).__name__)

    def _assign(self, assignment: Assignment) -> None:
        try:
            self.role.add(assignment)
        except ValueError as exc:
            self._send(RequestFailed(assignment.request_id, str(exc)))
        except Exception as exc:  # a bug this request met: it fails, the engine goes on
            logger.exception("request %d could not be added", assignment.request_id)
            self._send(RequestFailed(assignment.request_id, f"engine error: {exc!r}"))

    def _report(self, now_s: float) -> None:
        """Report the load (the group's fetch when this engine leads it); an idle engine whose
        report is the last one sent again only keeps alive (``report_keepalive_s``)."""
        load = self.role.load()
        report = EngineReport(
            self.config.engine_id,
            load.num_seqs,
            load.num_tokens,
            load.num_free_blocks,
            load.read_queue_tokens,
            self._link_bytes(),
            self.buffer.num_used_bytes // self.identity.layout.full_block_bytes,
            load.write_queue_tokens,
        )
        keepalive_s = min(
            self.config.report_keepalive_s, self.config.cluster.heartbeat_timeout_s / 4
        )
        if (
            not (load.num_seqs or load.num_tokens or load.read_queue_tokens)
            and not load.write_queue_tokens
            and now_s - self._last_report_sent_s < keepalive_s
            and _same_but_reports(report, self._last_report)
        ):
            return
        self._send(report)
        self._last_report, self._last_report_sent_s = report, now_s

    def _link_bytes(self) -> dict[str, int]:
        # Read before the links: a read is counted here only after its SNIC movement finished,
        # so in one report the SNIC bytes always cover store_read_bytes.
        store_read_bytes = self.role.num_read_bytes
        counters: dict[str, int] = {}
        for link in self.traffic.stats().links:
            for traffic_class, moved in link.class_to_moved_bytes.items():
                counters[f"{link.name}.{TrafficClass(traffic_class).name.lower()}"] = int(moved)
        counters["store_read_bytes"] = store_read_bytes
        counters["engine_cached_bytes"] = self.role.num_engine_cached_bytes
        for peer, (written, read) in self.role.transport_bytes.items():
            counters[f"{TRANSPORT_WRITTEN_PREFIX}{peer}"] = written
            counters[f"{TRANSPORT_READ_PREFIX}{peer}"] = read
        counters["busy_us"] = int(self.busy_s * 1e6)
        counters["buffer_used_bytes"] = self.buffer.num_used_bytes  # a level, not cumulative
        counters["buffer_capacity_bytes"] = (
            self.buffer.num_slots * self.buffer.layout.full_block_bytes
        )
        store = self.role.store
        if store is not None:
            stats = store.stats()
            for name in _REPORTED_STORE_STATS:
                counters[f"store_{name}"] = getattr(stats, name)
        return counters

    def close(self) -> int:
        """Release everything; the number of store writes abandoned unfinished (see
        ``store_flush_timeout_s``), after which the engine's store is left open."""
        if self.heartbeat is not None:
            self.heartbeat.stop()  # (``run`` did, unless it never returned)
        num_abandoned = self.role.close(self.config.store_flush_timeout_s)
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

"""Start a whole PD-disaggregated cluster on one host: the scheduler here, engines as processes.

    with LocalCluster(ClusterConfig(num_prefill_nodes=1, num_decode_nodes=2), model_dir=...,
                      store=KVStoreConfig(root_dir=...)) as cluster:
        outputs = cluster.generate([prompt_ids], SamplingParams(max_tokens=16))

Engine ``i`` is started as ``python -m dualpath.cli engine ...`` with the cluster token in its
environment (not on its command line). The engines exit on their own if this process dies
(parent-death signal and the scheduler heartbeat); ``close`` asks them to stop, then
terminates and finally kills any that linger.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dualpath.cluster.coordinator import Coordinator, RequestEvent, open_store_for_lookups
from dualpath.cluster.messages import DECODE, PREFILL
from dualpath.config import ClusterConfig, EngineConfig, KVStoreConfig, SchedulerConfig
from dualpath.control.channel import new_cluster_token
from dualpath.model.identity import checkpoint_kv_identity
from dualpath.transfer.links import check_pd_ratio
from dualpath.types import SamplingParams
from dualpath.units import bytes_to_gb, gbps_to_bytes_per_s

logger = logging.getLogger(__name__)

TOKEN_ENV = "DUALPATH_CLUSTER_TOKEN"
# Storage read rate assumed for alpha when the SNIC is uncapped and nothing was measured.
DEFAULT_STORE_READ_BYTES_PER_S = 1e9


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
        log_dir: Path | None = None,
    ) -> None:
        self.cluster = cluster
        self.model_dir = Path(model_dir)
        self.store_config = store
        self.engine_config = engine or EngineConfig(num_threads=1)
        self.transport = transport
        self.log_dir = log_dir
        settings = cluster.settings
        model_config, self.identity = checkpoint_kv_identity(
            self.model_dir, self.engine_config.dtype, self.engine_config.block_size_tokens
        )
        self.scheduler_config = scheduler or SchedulerConfig(
            scheduler=settings.scheduler,
            read_path=settings.read_path,
            block_size_tokens=self.engine_config.block_size_tokens,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        bytes_per_token = (
            self.identity.layout.full_block_bytes / self.identity.layout.block_size_tokens
        )
        read_bytes_per_s = (
            gbps_to_bytes_per_s(cluster.traffic.snic_bandwidth_gbps)
            if cluster.traffic.snic_bandwidth_gbps > 0
            else DEFAULT_STORE_READ_BYTES_PER_S
        )
        traffic = cluster.traffic
        for warning in check_pd_ratio(
            cluster.num_prefill_nodes,
            cluster.num_decode_nodes,
            num_gpus_per_node=cluster.engines_per_node,
            snic_bandwidth_gbps=traffic.snic_bandwidth_gbps,
            cnic_bandwidth_gbps=traffic.cnic_bandwidth_gbps,
            host_memory_bandwidth_gbps=traffic.host_memory_bandwidth_gbps,
        ):
            logger.warning("%s", warning)  # SPEC §5: some link may congest at this P/D ratio
        self.token = new_cluster_token()
        self.coordinator = Coordinator(
            cluster,
            self.scheduler_config,
            self.identity,
            open_store_for_lookups(store.root_dir, self.identity),
            self.token,
            storage_read_tokens_per_s=read_bytes_per_s / bytes_per_token,
        )
        self.max_model_len = (
            self.engine_config.max_model_len or model_config.max_position_embeddings
        )
        self._processes: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._loop_thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._lock = threading.Lock()
        self._waiters: dict[int, list[RequestEvent]] = {}
        self._arrivals: dict[int, float] = {}

    # --- lifecycle --------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        self._loop_thread.start()
        for node in self.coordinator.topology.nodes:
            role = PREFILL if node.role.name == "PREFILL" else DECODE
            for engine_id in node.engine_ids:
                self._processes.append(self._spawn(role, engine_id, node.node_id))
        deadline = time.monotonic() + timeout_s
        while not self.coordinator.is_ready():
            dead = [p for p in self._processes if p.poll() is not None]
            if dead:
                self.close()
                raise RuntimeError(
                    f"engine process exited with {dead[0].returncode} during start-up"
                    + self._log_hint()
                )
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(
                    f"{self.coordinator.num_live_engines} of "
                    f"{self.coordinator.num_expected_engines} engines joined in {timeout_s} s"
                    + self._log_hint()
                )
            time.sleep(0.05)
        return self

    def _spawn(self, role: str, engine_id: int, node_id: int) -> subprocess.Popen:
        cluster, engine, store = self.cluster, self.engine_config, self.store_config
        argv = [
            sys.executable, "-m", "dualpath.cli", "engine",
            "--role", role,
            "--scheduler", self.coordinator.endpoint,
            "--engine-id", str(engine_id),
            "--node-id", str(node_id),
            "--model", str(self.model_dir),
            "--mode", cluster.mode,
            "--transport", self.transport,
            "--device", engine.device,
            "--dtype", engine.dtype,
            "--block-size", str(engine.block_size_tokens),
            "--snic-gbps", str(cluster.traffic.snic_bandwidth_gbps),
            "--cnic-gbps", str(cluster.traffic.cnic_bandwidth_gbps),
            "--buffer-gb", str(bytes_to_gb(
                cluster.prefill_buffer_bytes if role == PREFILL else cluster.decode_buffer_bytes
            )),
            "--kv-cache-gb", str(bytes_to_gb(engine.kv_cache_bytes)),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            "--heartbeat-timeout-s", str(cluster.heartbeat_timeout_s),
        ]  # fmt: skip
        if engine.num_threads is not None:
            argv += ["--threads", str(engine.num_threads)]
        if engine.max_model_len is not None:
            argv += ["--max-model-len", str(engine.max_model_len)]
        if store.root_dir is None:
            argv.append("--no-kv-store")
        else:
            argv += ["--kv-store", str(store.root_dir)]
        env = dict(os.environ, **{TOKEN_ENV: self.token})
        env.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent creation at INFO
        output = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = open(self.log_dir / f"engine-{engine_id}.log", "ab")  # noqa: SIM115
        return subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT)

    def _log_hint(self) -> str:
        return f"; see logs in {self.log_dir}" if self.log_dir else "; pass log_dir for logs"

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.coordinator.run_once(0.002)
            events = self.coordinator.drain_events()
            if events:
                with self._lock:
                    for event in events:
                        self._waiters.setdefault(event.request_id, []).append(event)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._loop_thread.is_alive():
            self.coordinator.shutdown()
            time.sleep(0.1)
            self._stop.set()
            self._loop_thread.join()
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
        for process in self._processes:
            try:
                process.wait(2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.coordinator.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def engine_pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    # --- requests ---------------------------------------------------------------------------

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        request_id = self.coordinator.submit(prompt_token_ids, params)
        self._arrivals[request_id] = time.monotonic()
        return request_id

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

"""``ServingContext``: what every route needs, owned by one app (no module-level state).

It lives on the event loop: only the loop's thread reads or changes it, except
``cluster`` (thread-safe) and the events the scheduler thread hands in through
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dualpath.cluster.launcher import LocalCluster
from dualpath.model.generation_config import (
    GENERATION_CONFIG_FILE,
    SamplingDefaults,
    read_sampling_defaults,
)
from dualpath.model.tokenizer import Tokenizer
from dualpath.server.chat import ChatRenderer
from dualpath.server.cluster_metrics import link_capacity_lookup
from dualpath.server.config import ServerConfig
from dualpath.server.errors import unavailable
from dualpath.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# What a 503 of a server that cannot serve yet tells clients to wait (Retry-After): engines
# join, or are declared dead and come back, on the scale of seconds.
RETRY_AFTER_S = 5


class ServerState(enum.Enum):
    STARTING = "starting"  # HTTP is up, engines are joining: generation routes answer 503
    READY = "ready"
    FAILED = "failed"  # the cluster did not start; the server is exiting
    STOPPING = "stopping"  # SIGINT/SIGTERM: in-flight requests cancelled, nothing new taken


class Abortable(Protocol):
    """What ``stop_serving`` needs of a request in flight (``generation.Generation``)."""

    def abort(self, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the API process knows of the served checkpoint (no weights here)."""

    name: str  # served model name
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class ServingContext:
    def __init__(
        self,
        config: ServerConfig,
        cluster: LocalCluster,
        tokenizer: Tokenizer,
        chat: ChatRenderer,
    ) -> None:
        self.config = config
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.chat = chat
        model_config = cluster.model_config
        self.model = ModelInfo(
            name=config.served_model_name,
            max_model_len=cluster.max_model_len,
            vocab_size=max(model_config.vocab_size, tokenizer.vocab_size),
            eos_token_ids=model_config.eos_token_ids,
        )
        self.max_prompt_tokens = config.max_prompt_tokens or self.model.max_model_len - 1
        self.sampling_defaults = sampling_defaults(cluster.model_dir, config.generation_config)
        traffic = cluster.cluster.traffic
        store = cluster.coordinator.store
        self.metrics = ServerMetrics(
            cluster.snapshot,
            engine_id_to_role=cluster.engine_id_to_role,
            link_capacity_bytes_per_s=link_capacity_lookup(
                traffic.snic_bandwidth_gbps, traffic.cnic_bandwidth_gbps
            ),
            store_stats=store.stats if store is not None else lambda: None,  # --no-kv-store
            window_s=config.metrics_window_s,
            model_name=self.model.name,
            max_model_len=self.model.max_model_len,
        )
        self.state = ServerState.STARTING
        self.created_unix_s = int(time.time())
        self.generations: set[Abortable] = set()  # in flight, for shutdown
        self.num_waiting = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        self._has_served_engines = False  # see is_forwarding

    # --- the bounded waiting queue ------------------------------------------------------------

    def try_admit(self, num_generations: int) -> bool:
        """Take ``num_generations`` waiting places, or none if they do not all fit."""
        if self.num_waiting + num_generations > self.config.max_waiting_requests:
            self.metrics.rejected.labels("queue_full").inc()
            return False
        self.num_waiting += num_generations
        self.metrics.waiting.set(self.num_waiting)
        return True

    def release_waiting(self, num_generations: int) -> None:
        """Give back places taken by ``try_admit`` (a first token came, or the request ended)."""
        assert 0 <= num_generations <= self.num_waiting, (num_generations, self.num_waiting)
        self.num_waiting -= num_generations
        self.metrics.waiting.set(self.num_waiting)

    # --- lifecycle ------------------------------------------------------------------------------

    @property
    def unavailable_reason(self) -> str | None:
        """Why generation routes answer 503 now, or None when they serve."""
        if self.state == ServerState.STARTING:
            missing = ", ".join(
                f"{n} {role} engine{'s' if n > 1 else ''}"
                for role, n in self.missing_engines().items()
            )
            return f"the server is starting: waiting for {missing or 'the engines'} to join"
        if self.state == ServerState.FAILED:
            return "the cluster failed to start"
        if self.state == ServerState.STOPPING:
            return "the server is shutting down"
        return self.cluster.snapshot().unavailable_reason

    def missing_engines(self) -> dict[str, int]:
        """Engines of the topology not live now, by role ("prefill", "decode"); roles with
        none missing are left out."""
        expected: dict[str, int] = {}
        for role in self.cluster.engine_id_to_role.values():
            expected[role] = expected.get(role, 0) + 1
        live = self.cluster.snapshot().num_live_engines_by_role
        missing = {role: n - live.get(role, 0) for role, n in expected.items()}
        return {role: n for role, n in missing.items() if n > 0}

    def check_serving(self) -> None:
        """``APIError`` 503 with ``Retry-After`` while generation routes cannot serve."""
        reason = self.unavailable_reason
        if reason is not None:
            raise unavailable(reason, RETRY_AFTER_S)

    @property
    def is_forwarding(self) -> bool:
        """Whether generation routes forward requests to vLLM server engines
        (``forwarding.py``) instead of generating here: once an engine that is a vLLM server
        has joined, for the server's life. Membership keeps a cluster's DEs all of one kind, so
        a moment with none live is a 503 from placement, not a turn to our own path."""
        if not self._has_served_engines and self.cluster.snapshot().engine_urls:
            self._has_served_engines = True
        return self._has_served_engines

    def stop_serving(self, reason: str) -> None:
        """Refuse new requests and end every request in flight (their engines free them)."""
        if self.state != ServerState.FAILED:
            self.state = ServerState.STOPPING
        in_flight = list(self.generations)
        for generation in in_flight:
            generation.abort(reason)
        logger.info("stopped serving (%s); %d requests aborted", reason, len(in_flight))


def sampling_defaults(model_dir: Path, generation_config: str) -> SamplingDefaults:
    """What requests that omit sampling values get (``ServerConfig.generation_config``);
    ``ValueError`` if the checkpoint recommends sampling we do not implement, so a server never
    samples differently from what the checkpoint's authors set without saying so."""
    if generation_config == "none":
        return SamplingDefaults()
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    defaults = read_sampling_defaults(model_dir)
    if defaults.unsupported:
        raise ValueError(
            f"{path} sets {', '.join(defaults.unsupported)}: sampling that dualpath does not "
            "implement. Pass --generation-config none to serve with our defaults instead "
            "(temperature 1, top_p 1, no top_k, where a request sets none), or remove the field"
        )
    if defaults.describe():
        # A warning, as in vLLM: outputs differ from a server that ignores the file.
        logger.warning(
            "requests that omit them get the sampling defaults of %s: %s "
            "(--generation-config none: ours)",
            path,
            defaults.describe(),
        )
    return defaults

"""DualPath inside a vLLM server the user starts: our connector, configured by
``dualpath vllm-config``, joins the scheduler as one engine of the cluster.

    vllm serve MODEL --kv-transfer-config "$(dualpath vllm-config --role decode --engine-id 1
        --node-id 1 --scheduler tcp://HOST:5557 --url http://THIS_HOST:8000)"

vLLM builds the connector twice, as it does its own: the worker side, in the process that
holds the pages (its per-layer hooks, ``ConnectorWorker``, unchanged), and the scheduler side,
in vLLM's engine-core process (``served_scheduler.ServedScheduler``; on vLLM's CPU build these
are two processes). The worker's
process also runs the engine our scheduler sees (``ServedEngine``): the ``EngineProcess`` of
``dualpath engine`` (buffer, transport, store reads, reports, the scheduler's messages) with
the vLLM role of ``--engine vllm`` (``dualpath.vllm.roles``), on a thread of its own beside
vLLM's loop instead of stepping vLLM itself. What differs is how a request reaches vLLM:

    --engine vllm       the role adds the request to the vLLM engine it steps
    a vLLM server       the front door (``dualpath serve --external-engines``) sends the
                        client's request to the servers with ``kv_transfer_params =
                        {"dualpath_request_id": N}``; the scheduler side tells vLLM "not known
                        yet" (``get_num_new_matched_tokens`` -> None: vLLM asks again each
                        step) until the role has planned request N, exactly when the role would
                        have added it: the PE once its reads on both sides are done, the DE once
                        the PE's KV is in its buffer

The two sides speak over a pair of local ZeroMQ sockets named after vLLM's engine id
(``served_mailbox.Mailbox``): the engine sends each plan's ``PlanView`` (with the placed prompt
and cache salt, which the scheduler side checks the request against) and its cancels; the
scheduler side sends each planned request's end (its tokens and finish reason: the PE's token
makes its ``PrefillDone``, the DE's end its ``TokenUpdate`` and persisting), a refused prompt,
and the KV blocks its requests hold (a DE's reports). The tokens reach the client over vLLM's HTTP.

The role's state is touched by two threads of the worker's process (ours, and vLLM's through
the hooks: a DE frees a loaded request's slots), so both take ``ServedEngine.lock``. Our
threads run on the cores the server was given, not on the one core vLLM's CPU worker pins
itself to (``VLLM_CPU_OMP_THREADS_BIND``, inherited by every thread it starts): pinned there,
a PE's engine thread waited for that core as long as a DE sharing it decoded (25 s where its
messages took milliseconds), and the DEs' prompts waited with it.

Not here: vLLM's prefix cache is not probed (the PE reads every hit block of its side, vLLM
loads only what its own cache lacks, and the DEs read their side at once: the PE has nothing
to tell them, ``EngineInfo.reports_prefill_held``), and a DE's free KV blocks are vLLM's
blocks less those of the requests this connector tracks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from dualpath.cluster.engine_process import EngineProcess
from dualpath.cluster.engine_processes import TOKEN_ENV
from dualpath.config import EngineProcessConfig
from dualpath.control.channel import ControlClient
from dualpath.model.identity import KVIdentity, checkpoint_kv_identity, vllm_device, vllm_page_order
from dualpath.protocol import DECODE, RequestFailed
from dualpath.queues import drain
from dualpath.transfer.traffic import direct_move
from dualpath.vllm.args import served_engine_config
from dualpath.vllm.connector import (
    ConnectorHost,
    ConnectorScheduler,
    DualpathConnector,
    DualpathStepMetadata,
    PlanView,
)
from dualpath.vllm.roles import connector_host
from dualpath.vllm.served_mailbox import Mailbox
from dualpath.vllm.served_scheduler import ServedScheduler

logger = logging.getLogger(__name__)

_REJOIN_MAX_S = 5.0  # between attempts to join a scheduler that is gone or not up yet


class _NoPrefixCacheProbe:
    """vLLM's prefix cache is vLLM's loop's to touch: nothing is pinned from our thread, and
    the PE tells its DEs nothing of it (they read at once)."""

    enabled = False

    def pin(self, prompt: list[int], num_blocks: int, *, cache_salt: str | None = None) -> list:
        return []

    def unpin(self, pinned: list) -> None:
        pass


class _HeldBlocks:
    """A DE's KV memory for its reports: vLLM's blocks less those the scheduler side says
    its requests hold."""

    def __init__(self) -> None:
        self.num_gpu_blocks = 0
        self.num_used = 0

    def get_num_free_blocks(self) -> int:
        return max(0, self.num_gpu_blocks - self.num_used)


class ServedEngine:
    """One per vLLM worker process: the engine our scheduler sees, and what the role calls a
    vLLM engine (``add_request``, ``step``, ...) for a vLLM that steps itself."""

    steps_itself = True
    _instance: ServedEngine | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def of(
        cls, config: EngineProcessConfig, identity: KVIdentity, page_order: str, vllm_config: Any
    ) -> ServedEngine:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls(config, identity, page_order, vllm_config)
            return cls._instance

    def __init__(
        self, config: EngineProcessConfig, identity: KVIdentity, page_order: str, vllm_config: Any
    ) -> None:
        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise ValueError(
                f"set ${TOKEN_ENV} in the vLLM server's environment to the cluster token "
                "'dualpath serve --external-engines' was started with"
            )
        self.config, self.token, self.identity = config, token, identity
        # Every thread's stack to the server's log on SIGUSR2: this process runs vLLM's
        # worker and our engine side by side.
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        self.max_model_len = config.engine.max_model_len
        model_config = vllm_config.model_config
        self.eos_token_ids = tuple(
            t for t in [getattr(model_config.hf_config, "eos_token_id", None)] if isinstance(t, int)
        )
        self.host, self.store = connector_host(config, identity, page_order, self._move)
        self._vllm_engine_id = vllm_config.kv_transfer_config.engine_id
        self.mailbox: Mailbox | None = None  # from ``start``
        self.lock = threading.RLock()  # the role's state: our thread and vLLM's hooks
        self.prefix_cache = _NoPrefixCacheProbe()
        # Its requests come over HTTP, through a PE (the front door's forwarding): a DE here
        # never prefills one placed on it alone (``EngineInfo.prefills_locally``).
        self.prefills_locally = False
        self.block_pool = _HeldBlocks()
        self.process: _ServedProcess | None = None
        self._outputs: queue.SimpleQueue[Any] = queue.SimpleQueue()  # ended, for ``step``
        self._refused: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()

    # --- what the role calls the engine -----------------------------------------------------

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        """The role planned the request (``host.plans``): the scheduler side may let vLLM
        schedule it once the request's prompt and cache salt are the placed ones."""
        assert self.process is not None
        rid = int(request_id)
        placed = self.process.role.requests[rid].assignment
        view = PlanView.of(self.host.plans[rid])
        self.mailbox.send(
            "plan",
            rid,
            view.load_first_block,
            view.load_num_tokens,
            view.persist_from_block,
            list(placed.prompt_token_ids),
            placed.cache_salt,
        )

    def abort_request(self, request_ids: list[str]) -> None:
        """Its HTTP request is the front door's to end (it closes it on a cancel)."""
        for request_id in request_ids:
            self.mailbox.send("drop", int(request_id))

    def has_unfinished_requests(self) -> bool:
        return not self._outputs.empty()

    def step(self) -> list[Any]:
        """The planned requests vLLM ended since the last call, as a step's outputs."""
        return drain(self._outputs)

    def add_busy_s(self, seconds: float) -> None:
        """Time vLLM's worker spent on a step with our requests."""
        process = self.process
        if process is not None:
            with self.lock:
                process.busy_s += seconds

    def take_refused(self) -> list[tuple[int, str]]:
        return drain(self._refused)

    # --- the engine's threads ---------------------------------------------------------------

    def _move(self, link: str, num_bytes: int, do_move: Any) -> Any:
        """Through the engine's links once it is built (vLLM registers its pages before)."""
        process = self.process
        if process is None:
            return direct_move(link, num_bytes, do_move)
        return process._move(link, num_bytes, do_move)

    def start(self, num_kv_blocks: int) -> None:
        """Build the engine once vLLM registered its pages, and join the scheduler on a thread
        of ours once this server answers (the front door forwards to it from then on)."""
        if self.process is not None:
            return
        self.block_pool.num_gpu_blocks = num_kv_blocks
        with _off_vllms_core():
            self.mailbox = Mailbox(self._vllm_engine_id, own="engine", other="scheduler")
            self.process = _ServedProcess(self.config, self.token, self)
            threading.Thread(target=self._receive, name="dualpath-mailbox", daemon=True).start()
            threading.Thread(target=self._serve, name="dualpath-engine", daemon=True).start()

    def _receive(self) -> None:
        """The scheduler side's news: requests ended or refused, blocks held."""
        while True:
            for kind, *fields in self.mailbox.receive(None):
                if kind == "ended":
                    request_id, token_ids, finish_reason = fields
                    self._outputs.put(_ended(request_id, token_ids, finish_reason))
                elif kind == "refused":
                    self._refused.put((fields[0], fields[1]))
                elif kind == "blocks":
                    self.block_pool.num_used = fields[0]
            assert self.process is not None
            self.process.client.wake()

    def _serve(self) -> None:
        process = self.process
        assert process is not None
        _wait_until_serving(self.config.url)
        wait_s = 1.0
        while True:
            try:
                code = process.run()
            except Exception:  # a bug: logged, and the engine joins afresh
                logger.exception("the dualpath engine beside this vLLM server failed")
                code = -1
            with self.lock:
                for request_id in list(process.role.requests):
                    process.role.cancel(request_id)
            logger.warning(
                "engine %d left the scheduler (%s): joining again in %.0f s",
                self.config.engine_id,
                "told to stop" if code == 0 else f"code {code}",
                wait_s,
            )
            time.sleep(wait_s)
            wait_s = min(2 * wait_s, _REJOIN_MAX_S)
            process.client.close()
            process.client = ControlClient(
                self.config.scheduler_endpoint, f"engine-{self.config.engine_id}", self.token
            )


def _ended(request_id: int, token_ids: list[int], finish_reason: str) -> Any:
    """A request vLLM ended, as the role takes a step's output."""
    completion = SimpleNamespace(token_ids=token_ids, logprobs=None, finish_reason=finish_reason)
    return SimpleNamespace(request_id=str(request_id), finished=True, outputs=[completion])


class _ServedProcess(EngineProcess):
    """``dualpath engine``'s loop beside vLLM's: its turns hold the engine's lock, not its
    waits for messages."""

    def __init__(self, config: EngineProcessConfig, token: str, served: ServedEngine) -> None:
        self.served = served
        super().__init__(config, token, served_engine=served)

    def _work(self) -> bool:
        with self.served.lock:
            for request_id, reason in self.served.take_refused():
                logger.warning("%s: its vLLM serves it alone", reason)
                self.role.cancel(request_id)
                self._send(RequestFailed(request_id, reason, is_prompt_refused=True))
            return super()._work()

    def _take(self, messages: list[object]) -> None:
        with self.served.lock:
            super()._take(messages)


class DualpathServedConnector(DualpathConnector):
    """The connector a vLLM server takes from ``dualpath vllm-config``."""

    def _find_host(self, extra: dict, vllm_config: Any, kv_cache_config: Any) -> ConnectorHost:
        _log_as_vllm()
        model_config = vllm_config.model_config
        config = served_engine_config(
            extra,
            model=model_config.model,
            dtype=str(model_config.dtype).removeprefix("torch."),
            max_model_len=model_config.max_model_len,
        )
        engine_config = config.engine
        model_config, identity = checkpoint_kv_identity(
            config.model_dir,
            engine_config.dtype,
            engine_config.block_size_tokens,
            "vllm",
            vllm_device(),
        )
        page_order = vllm_page_order(model_config, vllm_device())
        self._config = config
        self._num_kv_blocks = getattr(kv_cache_config, "num_blocks", 0)
        if self._role == KVConnectorRole.WORKER:
            self.served = ServedEngine.of(config, identity, page_order, vllm_config)
            return self.served.host
        return ConnectorHost(identity.layout, identity.fingerprint)

    def _scheduler_side(self, host: ConnectorHost) -> ConnectorScheduler:
        config = self._config
        persists = config.role == DECODE and config.store.is_enabled
        return ServedScheduler(host, persists, self._vllm_config.kv_transfer_config.engine_id)

    # vLLM's forward time is the engine's busy time (its reports' busy_us: the benchmarks'
    # calibration and PE utilisation); our own loop only waits beside it. A step's metadata is
    # bound before its forward and its saves are waited for after it (vLLM calls
    # start_load_kv after the forward too, when the step loads nothing synchronously).

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._role == KVConnectorRole.WORKER:
            meta = connector_metadata
            has_work = isinstance(meta, DualpathStepMetadata) and bool(meta.steps)
            self._step_start_s = time.perf_counter() if has_work else None

    def wait_for_save(self) -> None:
        super().wait_for_save()
        start_s = getattr(self, "_step_start_s", None)
        if start_s is not None:
            self._step_start_s = None
            self.served.add_busy_s(time.perf_counter() - start_s)

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        num_blocks = self._num_kv_blocks or len(self.host.cache.pages[0])
        self.served.start(num_blocks)


@contextlib.contextmanager
def _off_vllms_core() -> Iterator[None]:
    """While the engine's threads start (they, and the transport's and store's threads they
    start, inherit the starting thread's cores): the cores of the server's engine core
    process, not the one vLLM's CPU worker pins its compute thread to
    (``VLLM_CPU_OMP_THREADS_BIND``)."""
    pinned = os.sched_getaffinity(0)
    try:
        cores = os.sched_getaffinity(os.getppid())
    except OSError:
        cores = pinned
    if cores == pinned:
        yield
        return
    os.sched_setaffinity(0, cores)  # this thread only
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def _log_as_vllm() -> None:
    """Our log lines in the server's log as vLLM's are: its handlers, its level
    (``VLLM_LOGGING_LEVEL``); else Python's default prints our warnings and drops the rest."""
    ours, vllms = logging.getLogger("dualpath"), logging.getLogger("vllm")
    if ours.handlers or not vllms.handlers:
        return
    for handler in vllms.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllms.getEffectiveLevel())
    ours.propagate = False


def _wait_until_serving(url: str, *, interval_s: float = 0.5) -> None:
    """Wait until the vLLM server at ``url`` answers its /health (its engine is ready)."""
    while True:
        try:
            if httpx.get(f"{url.rstrip('/')}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)

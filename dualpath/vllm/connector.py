"""``DualpathConnector``: SPEC §2's KV movement inside a vLLM engine (vLLM's KV connector API).

An engine process of ours builds a ``ConnectorHost`` (its KV layout, store, mover), registers it
under a key, and builds vLLM with::

    KVTransferConfig(kv_connector="DualpathConnector",
                     kv_connector_module_path="dualpath.vllm.connector", kv_role="kv_both",
                     kv_connector_extra_config={"engine_key": key})

vLLM then builds two instances of the connector in that process, as it does its own: the
scheduler side (``ConnectorScheduler``) decides what each step loads, sends and persists; the
worker side (``ConnectorWorker``) runs vLLM's per-layer hooks, each a call of the one
``KVCourier`` our own PE's layer loop calls too (``dualpath.engine.courier``), over vLLM's
pages. Both find the host through the key. Each request the engine adds carries
``{"dualpath_request_id": N}`` in its ``kv_transfer_params``; its ``KVTransfer`` sits in the
host under N and says up to three things::

    load      hit KV copied into vLLM's blocks layer by layer, each layer ready before its
              attention (``wait_for_layer_load``) and the next one loading meanwhile, from
              host memory (a buffer's Full Block slots: the PE's store hits, or the DE's whole
              prompt) or, on the DE read path, pulled from the DE's buffer over the transport;
              vLLM's own prefix cache is a tier above it: tokens it holds are not loaded again
    send      after each layer (``save_kv_layer``), that layer's KV of every block the request
              reached and the DE does not hold (its own reads), to the DE's buffer (the PE
              side of SPEC §2)
    persist   each full block not in the store yet, once all its layers are computed
              (``wait_for_save``): the DE's prompt blocks and every block decode fills

Per step the scheduler side hands the worker side one ``StepPlan`` per request: its blocks,
the token range to load, how far its KV reaches, the blocks to persist; the worker side makes
it the courier's ``StepTransfer`` with the request's ``KVTransfer``. The scheduler side knows a
transfer only as its ``PlanView`` (picklable), so the two sides may run in two processes, as
vLLM's CPU build runs them (a vLLM server: ``dualpath.vllm.served``). A request
without ``dualpath_request_id`` is served by vLLM alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dualpath.engine.courier import KVCourier, KVTransfer, StepTransfer
from dualpath.engine.kv_io import KVStoreIO
from dualpath.kv.hashing import extend_block_keys
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import KVStore
from dualpath.transfer.traffic import Mover, direct_move
from dualpath.vllm.cache import layer_index
from dualpath.vllm.checks import attention_backend, check_config
from dualpath.vllm.layouts import VllmPages, choose_layout

REQUEST_ID_PARAM = "dualpath_request_id"  # our request id in vLLM's kv_transfer_params


@dataclass(eq=False)
class ConnectorHost:
    """What an engine process gives its connector: the store's layout and namespace, the store
    (None: persist nothing), the mover every byte goes through, and the requests' transfers
    (``plans``, by our request id)."""

    layout: KVLayout
    fingerprint: str
    store: KVStore | None = None
    mover: Mover = direct_move
    # Loads overlap the forward, one layer ahead (SPEC §3); False (``basic``): every layer is
    # loaded before the forward starts.
    is_layerwise: bool = True
    num_io_threads: int = 4
    max_pending_write_bytes: int = 256 << 20
    plans: dict[int, KVTransfer] = field(default_factory=dict)
    # Called after each layer's sends (the engine's chance to take messages mid-step).
    between_layers: Callable[[], None] | None = None
    # The Layer Block order the store's fingerprint names (``layouts``); None: not checked.
    page_order: str | None = None
    # Set when vLLM registers its cache (worker side).
    cache: VllmPages | None = None
    store_io: KVStoreIO | None = None


_HOSTS: dict[str, ConnectorHost] = {}
_HOSTS_LOCK = threading.Lock()


def register_host(key: str, host: ConnectorHost) -> None:
    """Make ``host`` the one the connector of the engine built with ``engine_key=key`` uses."""
    with _HOSTS_LOCK:
        if key in _HOSTS:
            raise RuntimeError(f"a connector host is already registered as {key!r}")  # a bug
        _HOSTS[key] = host


def unregister_host(key: str) -> None:
    with _HOSTS_LOCK:
        _HOSTS.pop(key, None)


@dataclass(frozen=True, slots=True)
class PlanView:
    """What the scheduler side knows of a request's transfer: enough to answer vLLM and to
    plan steps, nothing that lives only in the engine's process (buffers, peers), so that the
    two sides may run in two processes, as vLLM's CPU build runs them."""

    request_id: int
    load_first_block: int = 0  # its first block a load fills (vLLM's own cache holds before)
    load_num_tokens: int = 0  # tokens a load brings in all; 0: nothing to load
    persist_from_block: int | None = None  # see ``KVTransfer``
    # The prompt the placement was made for (a vLLM server checks the request it got); None:
    # not checked (the engine added the request itself).
    prompt_token_ids: tuple[int, ...] | None = None
    # The cache salt it was placed with, its blocks read under (checked with the prompt).
    cache_salt: str | None = None

    @classmethod
    def of(cls, transfer: KVTransfer, prompt_token_ids: tuple[int, ...] | None = None) -> PlanView:
        load = transfer.load
        return cls(
            transfer.request_id,
            0 if load is None else load.first_block,
            0 if load is None else load.num_tokens,
            transfer.persist_from_block,
            prompt_token_ids,
        )


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One request's work in one step, scheduler side -> worker side (pickled by vLLM): the
    worker makes it the courier's ``StepTransfer`` with the request's transfer."""

    request_id: int
    block_ids: tuple[int, ...]
    load_first: int = 0
    load_num: int = 0
    num_reached: int = 0
    persist: tuple[tuple[Any, int], ...] = ()


@dataclass
class DualpathStepMetadata(KVConnectorMetadata):
    """One step's work, scheduler side -> worker side: a ``StepPlan`` per request."""

    steps: list[StepPlan] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler side: a request with a transfer, from its allocation to its end."""

    view: PlanView
    request: Any  # vLLM's Request (its token ids grow as it decodes)
    num_external_tokens: int = 0  # tokens promised to load
    block_ids: list[int] = field(default_factory=list)
    is_load_pending: bool = False
    is_load_taken: bool = False  # a request vLLM preempts later is recomputed, not loaded
    persisted_keys: list = field(default_factory=list)


class ConnectorScheduler:
    """The scheduler side: how many tokens a request loads, and each step's work, from the
    requests' ``PlanView``s (``view_of``: by our request id; the host's plans by default)."""

    def __init__(
        self,
        host: ConnectorHost,
        view_of: Callable[[int], PlanView | None] | None = None,
    ) -> None:
        self.host = host
        self.block_size = host.layout.block_size_tokens
        self.persists = host.store is not None
        self._view_of = view_of or self._host_view
        self._tracked: dict[str, _Tracked] = {}  # vLLM request id -> state

    def _host_view(self, request_id: int) -> PlanView | None:
        transfer = self.host.plans.get(request_id)
        return None if transfer is None else PlanView.of(transfer)

    def _view(self, request: Any) -> PlanView | None:
        params = request.kv_transfer_params or {}
        request_id = params.get(REQUEST_ID_PARAM)
        return None if request_id is None else self._view_of(request_id)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """The transfer's loadable tokens beyond vLLM's own prefix hit (no side effects: vLLM
        may ask again). At most ``num_tokens - 1`` in all: vLLM computes at least one token
        of every request (the one whose logits it samples from). If vLLM evicted blocks the
        plan counted on, the gap cannot be loaded: vLLM computes everything past its hit."""
        view = self._view(request)
        return 0 if view is None else self._num_loadable(view, request, num_computed_tokens)

    def _num_loadable(self, view: PlanView, request: Any, num_computed_tokens: int) -> int:
        tracked = self._tracked.get(request.request_id)
        if not view.load_num_tokens or (tracked is not None and tracked.is_load_taken):
            return 0
        if num_computed_tokens < view.load_first_block * self.block_size:
            return 0
        loadable = min(view.load_num_tokens, request.num_tokens - 1)
        return max(0, loadable - num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        view = self._view(request)
        if view is None:
            return
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = self._tracked[request.request_id] = _Tracked(view, request)
        tracked.num_external_tokens = num_external_tokens
        tracked.block_ids = list(blocks.get_block_ids()[0])
        tracked.is_load_pending = num_external_tokens > 0

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = DualpathStepMetadata()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            meta.steps.append(
                self._step(tracked, new.num_computed_tokens, num_scheduled[new.req_id])
            )
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_block_ids = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:  # preempted and back: its blocks are new
                tracked.block_ids = list(new_block_ids[0]) if new_block_ids else []
            elif new_block_ids is not None:
                tracked.block_ids.extend(new_block_ids[0])
            meta.steps.append(
                self._step(tracked, cached.num_computed_tokens[index], num_scheduled[req_id])
            )
        return meta

    def _step(self, tracked: _Tracked, num_computed: int, num_scheduled: int) -> StepPlan:
        """``num_computed``: tokens with KV before this step, loaded ones included."""
        load_first = load_num = 0
        if tracked.is_load_pending:
            tracked.is_load_pending = False
            tracked.is_load_taken = True
            load_num = tracked.num_external_tokens
            load_first = num_computed - load_num
        num_reached = num_computed + num_scheduled
        return StepPlan(
            tracked.view.request_id,
            tuple(tracked.block_ids),
            load_first,
            load_num,
            num_reached,
            self._blocks_to_persist(tracked, num_reached),
        )

    def _blocks_to_persist(self, tracked: _Tracked, num_reached: int) -> tuple:
        """(key, block) of every block full after this step and not persisted yet, keyed in
        the request's tenant namespace: vLLM's ``cache_salt`` ("" is none, as vLLM has it)."""
        persist_from_block = tracked.view.persist_from_block
        if persist_from_block is None or not self.persists:
            return ()
        keys = tracked.persisted_keys
        num_keyed = len(keys)
        extend_block_keys(
            keys,
            tracked.request.all_token_ids,
            num_reached // self.block_size,
            self.block_size,
            self.host.fingerprint,
            cache_salt=tracked.request.cache_salt or None,
        )
        first = max(num_keyed, persist_from_block)
        return tuple((keys[i], tracked.block_ids[i]) for i in range(first, len(keys)))

    def request_finished(self, request: Any) -> None:
        """Nothing outlives the request's blocks: sends are flushed and persisted blocks copied
        to host memory within the step that computed them."""
        self._tracked.pop(request.request_id, None)


class ConnectorWorker:
    """The worker side: vLLM's per-layer hooks, each a call of the host's ``KVCourier`` over
    vLLM's pages."""

    def __init__(self, host: ConnectorHost) -> None:
        self.host = host
        self.courier: KVCourier | None = None
        self._meta: KVConnectorMetadata | None = None  # the step the courier is on
        self._steps: list[StepTransfer] = []
        self._lost_blocks: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], backend: str) -> None:
        """vLLM's pages, as the adapter of what the engine reports (``layouts.choose_layout``:
        the backend vLLM chose, the views' shapes and strides), refused when unmapped."""
        host = self.host
        pages = choose_layout(kv_caches, backend, host.layout)
        if host.page_order is not None and pages.order != host.page_order:
            raise ValueError(
                f"vLLM's {backend} pages are in the order {pages.order!r}, not the "
                f"{host.page_order!r} this engine's store is named by: this engine does not start"
            )
        host.cache = pages
        if host.store is not None:
            host.store_io = KVStoreIO(
                host.store,
                pages,
                num_io_threads=host.num_io_threads,
                max_pending_write_bytes=host.max_pending_write_bytes,
                mover=host.mover,
            )
        self.courier = KVCourier(
            host.mover,
            num_layers=host.layout.num_layers,
            block_size=host.layout.block_size_tokens,
            is_layerwise=host.is_layerwise,
            store=host.store_io,
            name="vllm-layer-load",
        )

    def begin(self, meta: KVConnectorMetadata | None) -> KVCourier:
        """The courier, on this step (begun once, whichever hook comes first)."""
        courier = self.courier
        assert courier is not None, "vLLM ran a step before registering its cache"
        if meta is not self._meta:
            assert self.host.cache is not None
            self._meta = meta
            self._steps = self._transfers(meta)
            courier.begin_step(self._steps, self.host.cache)
        return courier

    def _transfers(self, meta: KVConnectorMetadata | None) -> list[StepTransfer]:
        """The step's plans with their requests' transfers. A request whose transfer is gone
        (cancelled since vLLM scheduled it) is left out, its load reported failed."""
        steps = []
        for plan in meta.steps if isinstance(meta, DualpathStepMetadata) else []:
            transfer = self.host.plans.get(plan.request_id)
            if transfer is None:
                if plan.load_num:
                    self._lost_blocks.update(plan.block_ids)
                continue
            transfer.persisted_keys.extend(key for key, _ in plan.persist)
            steps.append(
                StepTransfer(
                    transfer,
                    plan.block_ids,
                    plan.load_first,
                    plan.load_num,
                    plan.num_reached,
                    plan.persist,
                )
            )
        return steps

    def pop_failed_blocks(self) -> set[int]:
        """Blocks whose load failed: a pull from a DE, or a transfer gone before its step."""
        failed, self._lost_blocks = self._lost_blocks, set()
        if self.courier is not None:
            failed |= self.courier.pop_failed_blocks()
        return failed

    def save_layer(self, meta: KVConnectorMetadata | None, layer: int) -> None:
        self.begin(meta).save_layer(layer)
        if self.host.between_layers is not None:
            self.host.between_layers()

    def end(self, meta: KVConnectorMetadata | None) -> None:
        """The step's KV is all computed: the courier ends the step. A load is taken once: a
        request vLLM preempts later is recomputed, not loaded again."""
        self.begin(meta).end_step()
        self._meta = None
        for step in self._steps:
            if step.load_num:
                step.transfer.load = None
        self._steps = []

    def shutdown(self) -> None:
        if self.courier is not None:
            self.courier.close()


class DualpathConnector(KVConnectorBase_V1):
    """vLLM's connector API over a ``ConnectorHost``: vLLM builds one per role, as it does
    its own connectors; each delegates to its side."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        host = self._find_host(extra, vllm_config, kv_cache_config)
        check_config(vllm_config, host.layout)
        self.host = host
        is_scheduler = role == KVConnectorRole.SCHEDULER
        self.scheduler = self._scheduler_side(host) if is_scheduler else None
        self.worker = None if is_scheduler else ConnectorWorker(host)

    def _find_host(self, extra: dict, vllm_config: Any, kv_cache_config: Any) -> ConnectorHost:
        """The host the engine process registered under ``extra["engine_key"]``."""
        key = extra.get("engine_key")
        with _HOSTS_LOCK:
            host = _HOSTS.get(key)
        if host is None:
            raise ValueError(
                f"no dualpath connector host is registered as engine_key={key!r}: the "
                "connector serves an engine that dualpath builds (a vLLM server takes the "
                "configuration 'dualpath vllm-config' prints)"
            )
        return host

    def _scheduler_side(self, host: ConnectorHost) -> ConnectorScheduler:
        return ConnectorScheduler(host)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # the backend's own; the page layout is checked at registration

    # --- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Loaded synchronously: the source is host memory (or a DE's buffer, pulled per
        layer within the step). None: not known yet (vLLM asks again at its next step)."""
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        assert self.scheduler is not None
        self.scheduler.request_finished(request)
        return False, None

    # --- worker side ------------------------------------------------------------------------

    def _meta(self) -> KVConnectorMetadata | None:
        return self._get_connector_metadata() if self.has_connector_metadata() else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches, attention_backend(self._vllm_config, kv_caches))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.begin(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.begin(self._meta()).wait_for_layer(layer_index(layer_name))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self.worker is not None
        self.worker.save_layer(self._meta(), layer_index(layer_name))

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.end(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose pull from a DE failed this step (a copy from host memory cannot)."""
        assert self.worker is not None
        return self.worker.pop_failed_blocks()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

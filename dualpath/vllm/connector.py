"""``DualpathConnector``: SPEC §2's KV movement inside a vLLM engine (vLLM's KV connector API).

An engine process of ours builds a ``ConnectorHost`` (its KV layout, store, mover), registers it
under a key, and builds vLLM with::

    KVTransferConfig(kv_connector="DualpathConnector",
                     kv_connector_module_path="dualpath.vllm.connector", kv_role="kv_both",
                     kv_connector_extra_config={"engine_key": key})

vLLM then builds two instances of the connector in that process: a scheduler side that decides
and a worker side that moves bytes; both find the host through the key. Each request the
engine adds carries ``{"dualpath_request_id": N}`` in its ``kv_transfer_params`` and its
``KVPlan`` sits in the host under N. A plan says up to three things::

    load      hit KV copied into vLLM's blocks layer by layer, each layer ready before its
              attention (``wait_for_layer_load``) and the next one loading meanwhile, from
              host memory (a buffer's Full Block slots: the PE's store hits, or the DE's whole
              prompt) or, on the DE read path, pulled from the DE's buffer over the transport;
              vLLM's own prefix cache is a tier above it: tokens it holds are not loaded again
    send      after each layer (``save_kv_layer``), that layer's KV of every block the request
              reached and the DE does not hold (its own reads), to the DE's buffer through the
              engine's mover (the PE side of SPEC §2)
    persist   each full block not in the store yet, once all its layers are computed
              (``wait_for_save``): the DE's prompt blocks and every block decode fills

Per step the scheduler side hands the worker side one ``StepPlan`` per request: its blocks,
the token range to load, how far its KV reaches, the blocks to persist. A request without
``dualpath_request_id`` is served by vLLM alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dualpath.engine.buffers import KVBuffer
from dualpath.engine.kv_io import KVStoreIO
from dualpath.engine.prefill import RemoteBuffer
from dualpath.kv.hashing import BlockKey, block_keys
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import KVStore
from dualpath.transfer.traffic import Mover, direct_move
from dualpath.vllm.cache import VllmPagedCache, check_packing, layer_index, layers_in_order

logger = logging.getLogger(__name__)

REQUEST_ID_PARAM = "dualpath_request_id"  # our request id in vLLM's kv_transfer_params


@dataclass(eq=False)
class RemoteBlocks:
    """Hit blocks in a DE's buffer (the DE read path, SPEC §2): block j of the request's tokens
    (``first_block <= j < first_block + len(slots)``) in the DE's slot ``slots[j -
    first_block]``, pulled one layer at a time over the transport."""

    remote: RemoteBuffer
    slots: Sequence[int]
    first_block: int

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.slots)


@dataclass(eq=False)
class LoadSource:
    """Hit KV to load: block j of the request's tokens (``first_block <= j``) in ``buffer``
    slot ``slots[j - first_block]``, then the blocks of ``remote`` (if any), tokens up to
    ``num_tokens`` valid. The blocks before ``first_block`` were in vLLM's own prefix cache
    when the engine planned the request (``PrefixCacheProbe``), so they were not read."""

    buffer: KVBuffer
    slots: Sequence[int]
    num_tokens: int
    first_block: int = 0
    remote: RemoteBlocks | None = None

    def __post_init__(self) -> None:
        remote = self.remote
        if remote is not None and remote.first_block != self.first_block + len(self.slots):
            raise ValueError(  # a bug: the two sides' blocks must meet
                f"DE-side blocks start at {remote.first_block}, not after the local ones "
                f"({self.first_block} + {len(self.slots)})"
            )

    def slot(self, block: int) -> int:
        return self.slots[block - self.first_block]

    def is_local(self, block: int) -> bool:
        return block < self.first_block + len(self.slots)


@dataclass(eq=False)
class SendTarget:
    """A DE's buffer: block j of the prompt goes to slot ``slots[j]``; ``num_tokens`` prompt
    tokens are sent, except the blocks in ``held`` (the DE read them itself)."""

    remote: RemoteBuffer
    slots: Sequence[int]
    num_tokens: int
    held: range = range(0)


@dataclass(eq=False)
class KVPlan:
    """What the connector does with one request's KV (see the module docstring). Owned by the
    engine; the connector updates the progress counts (on vLLM's thread)."""

    request_id: int
    load: LoadSource | None = None
    send: SendTarget | None = None
    # Persist full blocks from this block on (the store holds the ones before); None: never.
    persist_from_block: int | None = None
    # Called on vLLM's thread once the load has been copied into vLLM's blocks (the source's
    # buffer slots are free then).
    on_loaded: Callable[[], None] | None = None
    num_sent_blocks: int = 0  # leading blocks sent complete
    # Why a send or a pull from the DE failed (it died or timed out): the request's transfers
    # stop, the engine fails it.
    transfer_error: Exception | None = None
    num_loaded_tokens: int = 0  # tokens loaded from ``load`` (0 if vLLM's own cache had them)
    persisted_keys: list[BlockKey] = field(default_factory=list)


@dataclass(eq=False)
class ConnectorHost:
    """What an engine process gives its connector: the store's layout and namespace, the store
    (None: persist nothing), the mover every byte goes through, and the requests' plans."""

    layout: KVLayout
    fingerprint: str
    store: KVStore | None = None
    mover: Mover = direct_move
    # Loads overlap the forward, one layer ahead (SPEC §3); False (``basic``): every layer is
    # loaded before the forward starts.
    is_layerwise: bool = True
    num_io_threads: int = 4
    max_pending_write_bytes: int = 256 << 20
    plans: dict[int, KVPlan] = field(default_factory=dict)
    # Called after each layer's sends (the engine's chance to take messages mid-step).
    between_layers: Callable[[], None] | None = None
    # Set when vLLM registers its cache (worker side).
    cache: VllmPagedCache | None = None
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
class StepPlan:
    """One request's work in one engine step (scheduler side -> worker side)."""

    plan: KVPlan
    block_ids: tuple[int, ...]  # all the request's vLLM blocks, in token order
    load_first: int  # first token to load this step
    load_num: int  # tokens to load this step (0: none)
    num_reached: int  # tokens whose KV is in vLLM's blocks after this step
    persist: tuple[tuple[BlockKey, int], ...]  # (key, vLLM block) full after this step


@dataclass
class DualpathStepMetadata(KVConnectorMetadata):
    steps: list[StepPlan] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler side: a request with a plan, from its first query to its end."""

    plan: KVPlan
    request: Any  # vLLM's Request (its token ids grow as it decodes)
    num_local_tokens: int = 0  # vLLM's own prefix-cache hit when asked
    num_external_tokens: int = 0  # tokens promised to load
    block_ids: list[int] = field(default_factory=list)
    is_load_pending: bool = False


class DualpathConnector(KVConnectorBase_V1):
    """vLLM's connector API over a ``ConnectorHost``; both roles in one class, as vLLM wants."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        key = extra.get("engine_key")
        with _HOSTS_LOCK:
            host = _HOSTS.get(key)
        if host is None:
            raise ValueError(
                f"no dualpath connector host is registered as engine_key={key!r}: the "
                "connector serves an engine that dualpath builds"
            )
        check_config(vllm_config, host.layout)
        self.host = host
        self.block_size = host.layout.block_size_tokens
        self._tracked: dict[str, _Tracked] = {}  # vLLM request id -> state (scheduler side)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # the backend's own; cache.check_packing verifies it at registration

    # --- scheduler side ---------------------------------------------------------------------

    def _plan_of(self, request: Any) -> KVPlan | None:
        params = request.kv_transfer_params or {}
        request_id = params.get(REQUEST_ID_PARAM)
        return None if request_id is None else self.host.plans.get(request_id)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The plan's loadable tokens beyond vLLM's own prefix hit, loaded synchronously (the
        source is host memory). At most ``num_tokens - 1`` in all: vLLM computes at least
        one token of every request (the one whose logits it samples from)."""
        plan = self._plan_of(request)
        if plan is None:
            return 0, False
        tracked = _Tracked(plan, request, num_local_tokens=num_computed_tokens)
        self._tracked[request.request_id] = tracked
        if plan.load is None:
            return 0, False
        if num_computed_tokens < plan.load.first_block * self.block_size:
            # vLLM evicted blocks the plan counted on: the gap cannot be loaded, so vLLM
            # computes everything past its own hit.
            logger.info(
                "request %d: vLLM's prefix cache holds %d tokens, fewer than the %d planned; "
                "recomputing them",
                plan.request_id,
                num_computed_tokens,
                plan.load.first_block * self.block_size,
            )
            return 0, False
        loadable = min(plan.load.num_tokens, request.num_tokens - 1)
        tracked.num_external_tokens = max(0, loadable - num_computed_tokens)
        return tracked.num_external_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.block_ids = list(blocks.get_block_ids()[0])
        tracked.num_external_tokens = num_external_tokens
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
            load_num = tracked.num_external_tokens
            load_first = num_computed - load_num
        num_reached = num_computed + num_scheduled
        return StepPlan(
            tracked.plan,
            tuple(tracked.block_ids),
            load_first,
            load_num,
            num_reached,
            self._blocks_to_persist(tracked, num_reached),
        )

    def _blocks_to_persist(self, tracked: _Tracked, num_reached: int) -> tuple:
        """(key, block) of every block full after this step and not persisted yet."""
        plan = tracked.plan
        if plan.persist_from_block is None or self.host.store is None:
            return ()
        num_full = num_reached // self.block_size
        num_keyed = len(plan.persisted_keys)
        if num_full <= num_keyed:
            return ()
        token_ids = tracked.request.all_token_ids
        parent = plan.persisted_keys[-1] if plan.persisted_keys else None
        new_keys = block_keys(
            token_ids[num_keyed * self.block_size : num_full * self.block_size],
            self.block_size,
            self.host.fingerprint,
            parent,
        )
        plan.persisted_keys.extend(new_keys)
        return tuple(
            (key, tracked.block_ids[num_keyed + i])
            for i, key in enumerate(new_keys)
            if num_keyed + i >= plan.persist_from_block
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Nothing outlives the request's blocks: sends are flushed and persisted blocks copied
        to host memory within the step that computed them."""
        self._tracked.pop(request.request_id, None)
        return False, None

    # --- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = layers_in_order(kv_caches)
        num_blocks, num_heads, block_size, two_dims = layers[0].shape
        check_packing(num_heads, block_size, two_dims // 2, layers[0].dtype)
        host = self.host
        host.cache = VllmPagedCache(layers, host.layout)
        if host.store is not None:
            host.store_io = KVStoreIO(
                host.store,
                host.cache,
                num_io_threads=host.num_io_threads,
                max_pending_write_bytes=host.max_pending_write_bytes,
                mover=host.mover,
            )
        # Loads run one layer ahead of the forward: layer l+1 while layer l computes.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="vllm-layer-load")
        self._load_meta: KVConnectorMetadata | None = None  # the step the loads below are of
        self._load_steps: list[StepPlan] = []
        self._layer_loads: dict[int, Future[None]] = {}
        self._failed_load_blocks: set[int] = set()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start loading layer 0 of every load of the step (the rest follow the forward).
        vLLM calls this before the forward of a step with loads, after it otherwise."""
        self._begin_loads()

    def _begin_loads(self) -> None:
        """This step's loads, layer 0 started; once per step (the metadata is the step's)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if meta is self._load_meta:
            return
        self._drain_loads()
        self._load_meta = meta
        self._load_steps = [step for step in self._steps() if step.load_num]
        if self._load_steps and not self.host.is_layerwise:
            for layer in range(self.host.layout.num_layers):
                self._load_layer(self._load_steps, layer)
            self._load_steps = []
        elif self._load_steps:
            self._layer_loads[0] = self._loader.submit(self._load_layer, self._load_steps, 0)

    def _steps(self) -> list[StepPlan]:
        if not self.has_connector_metadata():
            return []
        meta = self._get_connector_metadata()
        assert isinstance(meta, DualpathStepMetadata), type(meta)
        return meta.steps

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this layer of every load of the step is in vLLM's blocks, the next
        layer's load started."""
        self._begin_loads()
        if not self._load_steps:
            return
        layer = layer_index(layer_name)
        for needed in (layer, layer + 1):
            if needed < self.host.layout.num_layers and needed not in self._layer_loads:
                self._layer_loads[needed] = self._loader.submit(
                    self._load_layer, self._load_steps, needed
                )
        self._layer_loads.pop(layer).result()

    def _drain_loads(self) -> None:
        """Wait for every layer load still running (none, after a whole forward)."""
        for future in self._layer_loads.values():
            future.result()
        self._layer_loads.clear()

    def _load_layer(self, steps: Sequence[StepPlan], layer: int) -> None:
        """Layer ``layer`` of every load of the step into vLLM's blocks (on the loader thread):
        the local blocks from the buffer, the DE-side ones pulled from the DE's buffer."""
        cache = self.host.cache
        assert cache is not None, "vLLM ran a layer before registering its cache"
        for step in steps:
            plan = step.plan
            source = plan.load
            assert source is not None, f"request {plan.request_id}: a load without a source"
            pulled = []  # (block, first, num) in the DE's buffer
            for block, first, num in _block_ranges(step.load_first, step.load_num, self.block_size):
                if not source.is_local(block):
                    pulled.append((block, first, num))
                    continue
                self._write(
                    cache,
                    layer,
                    step.block_ids[block],
                    source.buffer.layer_block(source.slot(block), layer),
                    first,
                    num,
                )
            if not pulled:
                continue
            if plan.transfer_error is None:
                remote = source.remote
                assert remote is not None, f"request {plan.request_id}: blocks past its sources"
                pages = np.empty((len(pulled), *self.host.layout.layer_block_shape), np.uint8)
                slots = [remote.slots[block - remote.first_block] for block, _, _ in pulled]
                try:
                    self.host.mover(
                        "cnic", pages.nbytes, partial(remote.remote.read_layer, slots, layer, pages)
                    )
                except Exception as exc:  # kept for the engine: raised here, it would stop vLLM
                    plan.transfer_error = exc
            if plan.transfer_error is not None:
                # This layer of these blocks is not pulled (this pull failed, or an earlier
                # one, or a send to the same DE): vLLM must neither keep nor cache what they
                # hold, nor the blocks computed after them. Reported, it fails the request and
                # evicts them all from its prefix cache.
                self._failed_load_blocks.update(step.block_ids[block] for block, _, _ in pulled)
                continue
            for page, (block, first, num) in zip(pages, pulled, strict=True):
                self._write(cache, layer, step.block_ids[block], page, first, num)

    def _write(
        self,
        cache: VllmPagedCache,
        layer: int,
        block_id: int,
        page: np.ndarray,
        first: int,
        num: int,
    ) -> None:
        if num == self.block_size:
            cache.write_layer_page(layer, block_id, page)
        else:
            cache.write_layer_tokens(layer, block_id, page, first, num)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Send this layer of every block a request's KV reached (and that was not sent
        complete before) to its DE's buffer."""
        layer = layer_index(layer_name)
        cache = self.host.cache
        assert cache is not None, "vLLM ran a layer before registering its cache"
        block_size = self.block_size
        for step in self._steps():
            send = step.plan.send
            if send is None or step.plan.transfer_error is not None:
                continue
            num_tokens = min(step.num_reached, send.num_tokens)
            end_block = -(-num_tokens // block_size)
            blocks = [
                block
                for block in range(step.plan.num_sent_blocks, end_block)
                if block not in send.held
            ]
            if not blocks:
                continue
            data = np.empty((len(blocks), *self.host.layout.layer_block_shape), np.uint8)
            cache.read_layer_pages(layer, [step.block_ids[block] for block in blocks], data)
            slots = [send.slots[block] for block in blocks]
            try:
                self.host.mover(
                    "cnic", data.nbytes, partial(send.remote.write_layer, slots, layer, data)
                )
            except Exception as exc:  # kept for the engine: raised here, it would stop vLLM
                step.plan.transfer_error = exc
        if self.host.between_layers is not None:
            self.host.between_layers()

    def wait_for_save(self) -> None:
        """The step's KV is all computed: advance the sends (flushed once a prompt is sent
        whole), persist the blocks that filled, and end the loads."""
        self._drain_loads()
        block_size = self.block_size
        for step in self._steps():
            plan = step.plan
            send = plan.send
            if send is not None and plan.transfer_error is None:
                num_tokens = min(step.num_reached, send.num_tokens)
                plan.num_sent_blocks = max(plan.num_sent_blocks, num_tokens // block_size)
                if num_tokens == send.num_tokens:
                    try:
                        send.remote.flush()
                    except Exception as exc:
                        plan.transfer_error = exc
                    plan.num_sent_blocks = -(-send.num_tokens // block_size)
            if step.persist:
                store_io = self.host.store_io
                assert store_io is not None, "blocks to persist without a store"
                for key, block_id in step.persist:
                    store_io.persist(key, block_id)
            if step.load_num:
                plan.num_loaded_tokens += step.load_num
                plan.load = None  # a request vLLM preempts later is recomputed, not reloaded
                if plan.on_loaded is not None:
                    plan.on_loaded()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose pull from a DE failed this step (a copy from host memory cannot)."""
        failed, self._failed_load_blocks = self._failed_load_blocks, set()
        return failed

    def shutdown(self) -> None:
        loader = getattr(self, "_loader", None)  # worker side only
        if loader is not None:
            loader.shutdown(wait=True)


def _block_ranges(first: int, num: int, block_size: int) -> list[tuple[int, int, int]]:
    """(block index, first token in it, tokens) covering tokens ``first .. first + num``."""
    ranges = []
    token = first
    end = first + num
    while token < end:
        block, offset = divmod(token, block_size)
        count = min(block_size - offset, end - token)
        ranges.append((block, offset, count))
        token += count
    return ranges


def check_config(vllm_config: Any, layout: KVLayout) -> None:
    """``ValueError`` naming the vLLM setting the connector cannot serve exactly."""
    parallel = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = getattr(parallel, name, 1)
        if value != 1:
            raise ValueError(f"dualpath's vLLM engine runs one worker: {name}={value} is refused")
    cache_config = vllm_config.cache_config
    if cache_config.block_size != layout.block_size_tokens:
        raise ValueError(
            f"vLLM block_size={cache_config.block_size} differs from the store's "
            f"{layout.block_size_tokens}-token blocks: give --block-size to both"
        )
    model_config = vllm_config.model_config
    if getattr(model_config.hf_text_config, "sliding_window", None):
        raise ValueError("sliding-window attention is refused: the store holds whole contexts")
    if model_config.use_mla:
        raise ValueError(
            "MLA models are refused on the vLLM engine (their latent KV is not mapped)"
        )

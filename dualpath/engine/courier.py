"""The KV courier: every move of KV between buffers, a decode engine's buffer and an engine's
pages, for both engines (SPEC §2, §9).

An engine plans each request's movement once (``plan_prefill`` on a PE; a ``KVTransfer`` whose
load is its buffer on a DE), then per engine step hands the courier one ``StepTransfer`` per
request and calls its hooks around the forward, in vLLM's connector shape::

    begin_step(steps, pages)  start loading layer 0 of every load (every layer, not layer-wise)
    wait_for_layer(l)         layer l of every load is in the pages; layer l+1 is loading
    save_layer(l)             layer l of every block a request's DE lacks -> the DE's buffer
    end_step()                loads drained; a prompt's sends flushed once it is whole; the
                              blocks that filled persisted

Our PE's layer loop (``LayerwiseModel.forward_layers``: ``past_of`` waits, ``on_layer`` saves)
and the vLLM connector's worker side (``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``) call the same hooks; what differs is only the pages (``pages.py``).

Rules both engines follow (docs/architecture.md):

* A transfer error (a DE died or timed out) fails the requests it touches, not the step: the
  request's transfers stop, the blocks it did not load are reported (``pop_failed_blocks``:
  vLLM must not cache them) and the engine fails it once the step ends (``failed``).
* Links: every copy between a host buffer and the engine's pages, and every pull from or write
  to a DE's buffer, is charged to the engine's CNIC (SPEC §4: every byte into or out of a GPU
  goes through its CNIC; on a CPU, host memory stands in for the GPU's); store reads and
  writes to the node's SNIC (``StoreReader``, ``KVStoreIO``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import numpy as np

from dualpath.engine.buffers import KVBuffer
from dualpath.engine.pages import KVPages, adjacent
from dualpath.kv.hashing import BlockKey
from dualpath.transfer.traffic import Mover

logger = logging.getLogger(__name__)


class RemoteBuffer(Protocol):
    """A PE's access to one DE's KV buffer (``remote_buffer.TransportRemoteBuffer`` over the
    transport); slots and layers as in ``KVBuffer``."""

    def read_layer(self, slots: Sequence[int], layer: int, out: np.ndarray) -> None:
        """Copy Layer Blocks ``(slot, layer)`` for ``slots`` into ``out[i]`` (blocking)."""
        ...

    def write_layer(self, slots: Sequence[int], layer: int, data: np.ndarray) -> None:
        """Post ``data[i]`` to ``(slots[i], layer)``; may return before the bytes land (the
        data is copied before it returns)."""
        ...

    def flush(self) -> None:
        """Block until every write posted to this DE has landed; raise if one failed."""
        ...


class BlockStore(Protocol):
    """Where full blocks are persisted from the pages (``kv_io.KVStoreIO``)."""

    def persist(self, key: BlockKey, block_id: int) -> None: ...


@dataclass(eq=False)
class RemoteBlocks:
    """Hit blocks in a DE's buffer (the DE read path): block j of the request's tokens
    (``first_block <= j < first_block + len(slots)``) in the DE's slot ``slots[j -
    first_block]``, pulled one layer at a time."""

    remote: RemoteBuffer
    slots: Sequence[int]
    first_block: int


@dataclass(eq=False)
class LoadSource:
    """Hit KV to load: block j (``first_block <= j``) in ``buffer`` slot ``slots[j -
    first_block]``, then the blocks of ``remote`` (if any); tokens below ``num_tokens`` valid.
    Blocks before ``first_block`` are already in the engine's pages (vLLM's prefix cache)."""

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
class KVTransfer:
    """One request's KV movement, planned once; the courier advances its progress."""

    request_id: int
    load: LoadSource | None = None
    send: SendTarget | None = None
    # Persist full blocks from this block on (the store holds those before); None: never.
    persist_from_block: int | None = None
    # Called once a step has loaded the request's KV (the source's buffer slots may go).
    on_loaded: Callable[[], None] | None = None
    num_sent_blocks: int = 0  # leading blocks sent complete
    # Why a pull or a send failed (its DE died or timed out): its transfers stop.
    transfer_error: Exception | None = None
    num_loaded_tokens: int = 0
    persisted_keys: list[BlockKey] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepTransfer:
    """One request's work in one engine step."""

    transfer: KVTransfer
    block_ids: Sequence[int]  # the request's pages, block j of its tokens in block_ids[j]
    load_first: int = 0  # first token to load this step
    load_num: int = 0  # tokens to load this step (0: none)
    num_reached: int = 0  # tokens whose KV is in the pages after this step
    persist: tuple[tuple[BlockKey, int], ...] = ()  # (key, page block) full after this step


def plan_prefill(
    request_id: int,
    *,
    buffer: KVBuffer,
    pe_slots: Sequence[int],
    num_prefill_side_blocks: int,
    num_pe_read: int,
    remote: RemoteBuffer,
    de_slots: Sequence[int],
    num_de_read: int,
    num_prompt_tokens: int,
    block_size: int,
    num_engine_cached: int = 0,
) -> tuple[KVTransfer, int]:
    """A PE's movement for a request whose reads on both sides are done, and its hit blocks.

    Hit blocks are, in order: ``num_engine_cached`` already in the engine's pages (vLLM's
    prefix cache; the DE skipped reading those, PrefillHeld), the PE side's read into
    ``pe_slots`` (``num_pe_read`` of ``num_prefill_side_blocks``), then the DE side's, read
    into the DE's ``de_slots`` (``num_de_read`` blocks past the PE side, counting any it
    skipped). A PE side read short ends the hit there: the DE side's blocks are recomputed
    (and sent over what the DE read). The DE is sent every block it did not read itself: the
    PE side's hits with the first chunk, then every computed block."""
    num_pe = num_prefill_side_blocks
    num_hit = num_engine_cached + num_pe_read
    held = range(0)
    if num_hit >= num_pe:  # the PE side whole: the DE side's blocks follow
        held = range(max(num_pe, num_engine_cached), num_pe + num_de_read)
        num_hit = max(num_hit, num_pe + num_de_read)
    first_pulled = max(num_engine_cached, num_pe)
    pulled = None
    if held.stop > first_pulled:
        pulled = RemoteBlocks(remote, de_slots[first_pulled : held.stop], first_pulled)
    load = None
    if num_hit:
        load = LoadSource(
            buffer, pe_slots[:num_pe_read], num_hit * block_size, num_engine_cached, pulled
        )
    send = SendTarget(remote, de_slots, num_prompt_tokens, held)
    return KVTransfer(request_id, load=load, send=send), num_hit


def block_ranges(first: int, num: int, block_size: int) -> list[tuple[int, int, int]]:
    """(block, first token in it, tokens) covering tokens ``first .. first + num``."""
    ranges = []
    token, end = first, first + num
    while token < end:
        block, offset = divmod(token, block_size)
        count = min(block_size - offset, end - token)
        ranges.append((block, offset, count))
        token += count
    return ranges


class KVCourier:
    """One engine's KV mover over its pages (see the module docstring)."""

    def __init__(
        self,
        mover: Mover,
        *,
        num_layers: int,
        block_size: int,
        is_layerwise: bool = True,
        store: BlockStore | None = None,
        name: str = "kv-layer-load",
    ) -> None:
        """``is_layerwise``: loads run one layer ahead of the forward (SPEC §3); otherwise
        (``basic``) every layer loads before the forward starts."""
        self.mover = mover
        self.num_layers = num_layers
        self.block_size = block_size
        self.is_layerwise = is_layerwise
        self.store = store
        self._loader = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._steps: Sequence[StepTransfer] = ()
        self._pages: KVPages | None = None
        self._loading: list[StepTransfer] = []
        self._layer_loads: dict[int, Future[None]] = {}
        self._failed_blocks: set[int] = set()

    # --- the hooks --------------------------------------------------------------------------

    def begin_step(self, steps: Sequence[StepTransfer], pages: KVPages) -> None:
        """The step's work: start its loads (layer 0, or every layer when not layer-wise)."""
        self._drain_loads()
        self._steps, self._pages = steps, pages
        self._loading = [step for step in steps if step.load_num]
        if self._loading and not self.is_layerwise:
            for layer in range(self.num_layers):
                self._load_layer(layer)
                pages.fence(layer)
            self._loading = []
        elif self._loading:
            self._layer_loads[0] = self._loader.submit(self._load_layer, 0)

    def wait_for_layer(self, layer: int) -> None:
        """Return once layer ``layer`` of every load is in the pages, the next one loading."""
        if not self._loading:
            return
        for needed in (layer, layer + 1):
            if needed < self.num_layers and needed not in self._layer_loads:
                self._layer_loads[needed] = self._loader.submit(self._load_layer, needed)
        self._layer_loads.pop(layer).result()
        assert self._pages is not None
        self._pages.fence(layer)

    def save_layer(self, layer: int) -> None:
        """Send layer ``layer`` of every block each request reached this step, not sent
        whole before and not read by its DE, to the DE's buffer."""
        pages = self._pages
        for step in self._steps:
            transfer = step.transfer
            send = transfer.send
            if send is None or transfer.transfer_error is not None:
                continue
            end_block = -(-min(step.num_reached, send.num_tokens) // self.block_size)
            blocks = [b for b in range(transfer.num_sent_blocks, end_block) if b not in send.held]
            if not blocks:
                continue
            assert pages is not None
            block_ids = [step.block_ids[b] for b in blocks]
            data = pages.layer_view(layer, block_ids)
            if data is None:
                data = np.empty((len(blocks), *self._layer_block_shape(pages)), np.uint8)
                pages.read_layer(layer, block_ids, data)
            slots = [send.slots[b] for b in blocks]
            try:
                write = partial(send.remote.write_layer, slots, layer, data)
                self.mover("cnic", data.nbytes, write)
            except Exception as exc:  # the request fails; the step goes on
                self._fail(transfer, exc)

    def end_step(self) -> None:
        """The step's KV is all computed: drain the loads, flush each prompt sent whole,
        persist the blocks that filled, and tell each load's owner it is done."""
        self._drain_loads()
        for step in self._steps:
            transfer = step.transfer
            send = transfer.send
            if send is not None and transfer.transfer_error is None:
                num_tokens = min(step.num_reached, send.num_tokens)
                transfer.num_sent_blocks = max(
                    transfer.num_sent_blocks, num_tokens // self.block_size
                )
                if num_tokens == send.num_tokens:
                    try:
                        send.remote.flush()
                    except Exception as exc:
                        self._fail(transfer, exc)
                    transfer.num_sent_blocks = -(-send.num_tokens // self.block_size)
            if step.persist:
                assert self.store is not None, "blocks to persist without a store"
                for key, block_id in step.persist:
                    self.store.persist(key, block_id)
            if step.load_num:
                transfer.num_loaded_tokens += step.load_num
                if transfer.on_loaded is not None:
                    transfer.on_loaded()
        self._steps, self._pages = (), None

    def run_loads(self, steps: Sequence[StepTransfer], pages: KVPages) -> None:
        """Every layer of ``steps``' loads at once, outside a forward (a DE taking a prompt's
        KV into its cache): ``begin_step`` and ``end_step`` with no layer between."""
        is_layerwise, self.is_layerwise = self.is_layerwise, False
        try:
            self.begin_step(steps, pages)
        finally:
            self.is_layerwise = is_layerwise
        self.end_step()

    def failed(self, steps: Sequence[StepTransfer]) -> list[KVTransfer]:
        """The transfers of ``steps`` that met a transfer error."""
        return [s.transfer for s in steps if s.transfer.transfer_error is not None]

    def pop_failed_blocks(self) -> set[int]:
        """Page blocks a failed pull left unloaded since the last call: what they hold (and
        every block computed after them) must be neither kept nor cached."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def close(self) -> None:
        self._loader.shutdown(wait=True)

    # --- loads ------------------------------------------------------------------------------

    def _drain_loads(self) -> None:
        for future in self._layer_loads.values():
            future.result()
        self._layer_loads.clear()

    def _load_layer(self, layer: int) -> None:
        """Layer ``layer`` of every load of the step into the pages (on the loader thread):
        the local blocks from the buffer, the DE-side ones pulled from the DE's buffer."""
        pages = self._pages
        assert pages is not None
        for step in self._loading:
            transfer = step.transfer
            source = transfer.load
            assert source is not None, f"request {transfer.request_id}: a load without a source"
            local, pulled = [], []
            for block, first, num in block_ranges(step.load_first, step.load_num, self.block_size):
                (local if source.is_local(block) else pulled).append((block, first, num))
            if local:
                self._load_local(pages, step, source, layer, local)
            if pulled and transfer.transfer_error is None:
                self._pull(pages, step, source, layer, pulled)
            if pulled and transfer.transfer_error is not None:
                # Not pulled (this pull failed, or an earlier one, or a send to that DE):
                # reported, so that vLLM fails the request and evicts these blocks.
                self._failed_blocks.update(step.block_ids[block] for block, _, _ in pulled)

    def _load_local(self, pages, step, source, layer, ranges) -> None:  # noqa: ANN001
        buffer = source.buffer
        nbytes = sum(num for _, _, num in ranges) * buffer.layout.bytes_per_token_per_layer

        def copy() -> None:
            for block, first, num in ranges:
                slot = source.slots[block - source.first_block]
                data = buffer.array[slot, layer : layer + 1]
                pages.write_layer(layer, (step.block_ids[block],), data, first, num)

        self.mover("cnic", nbytes, copy)

    def _pull(self, pages, step, source, layer, ranges) -> None:  # noqa: ANN001
        """DE-side blocks over the transport, straight into the pages when they are one run
        of whole blocks that has a host view; else through a host copy."""
        remote = source.remote
        transfer = step.transfer
        assert remote is not None, f"request {transfer.request_id}: blocks past its sources"
        block_ids = [step.block_ids[block] for block, _, _ in ranges]
        slots = [remote.slots[block - remote.first_block] for block, _, _ in ranges]
        is_whole = all(num == self.block_size for _, _, num in ranges)
        view = pages.layer_view(layer, block_ids) if is_whole and adjacent(block_ids) else None
        into = view
        if into is None:
            into = np.empty((len(ranges), *self._layer_block_shape(pages)), np.uint8)
        try:
            self.mover("cnic", into.nbytes, lambda: remote.remote.read_layer(slots, layer, into))
        except Exception as exc:  # the request fails; the step goes on
            self._fail(transfer, exc)
            return
        if view is None:
            for i, (_, first, num) in enumerate(ranges):
                pages.write_layer(layer, (block_ids[i],), into[i : i + 1], first, num)

    @staticmethod
    def _layer_block_shape(pages: KVPages) -> tuple[int, int]:
        return pages.layout.layer_block_shape

    @staticmethod
    def _fail(transfer: KVTransfer, exc: Exception) -> None:
        if transfer.transfer_error is None:
            logger.warning("request %d: KV transfer failed: %s", transfer.request_id, exc)
            transfer.transfer_error = exc

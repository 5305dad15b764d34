"""PE and DE buffers: bounded host-DRAM KV staging in Full Block slots (SPEC §2–§3).

A buffer is one numpy array ``[num_slots, num_layers, block_size, bytes_per_token_per_layer]``
(uint8), registered once with the transport, so a slot is one contiguous Full Block and
``(slot, layer)`` is one contiguous Layer Block at a fixed byte offset (the transport's
``SlotLayout.full_blocks``, which peers address it by)::

    offset(slot, layer) = (slot * num_layers + layer) * layer_block_bytes

``allocate`` returns None when the buffer cannot hold a request right now: the caller keeps
the request queued and retries after a ``free`` (back-pressure; nothing is dropped). A request
larger than the whole buffer is refused up front, so waiting can never deadlock.

Every buffer holds the longest request the model accepts (``capacity.buffer_capacity_bytes``,
checked when a cluster or an engine starts): sized from the model and its context unless a size is
configured, and a configured size too small for one such request is refused at start, so no
request within the context is ever refused here.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from dualpath.errors import KVStoreError
from dualpath.kv.block_pool import BlockPool
from dualpath.kv.hashing import BlockKey
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import KVStore
from dualpath.protocol import Assignment
from dualpath.transfer.traffic import Mover
from dualpath.types import SamplingParams

logger = logging.getLogger(__name__)

R = TypeVar("R")


class KVBuffer:
    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        *,
        pin_memory: bool = False,
        allocate: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        """``pin_memory``: page-locked, for an engine on a GPU (DMA to and from the device,
        and what RDMA registration wants); needs CUDA. ``allocate(num_bytes)``: where the
        zeroed uint8 array comes from instead, e.g. ``Transport.allocate_host_buffer`` for a
        transport that can only register its own memory (shared memory)."""
        num_slots = capacity_bytes // layout.full_block_bytes
        if num_slots <= 0:
            raise ValueError(
                f"buffer of {capacity_bytes} bytes holds no Full Block of "
                f"{layout.full_block_bytes} bytes"
            )
        self.layout = layout
        self.num_slots = num_slots
        shape = (num_slots, *layout.full_block_shape)
        if pin_memory and allocate is not None:
            raise ValueError("give pin_memory or allocate, not both")
        if allocate is not None:
            self.array = allocate(num_slots * layout.full_block_bytes).reshape(shape)
        elif pin_memory:
            import torch  # only engines on a GPU pay for the import here

            self.array = torch.zeros(shape, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            self.array = np.zeros(shape, dtype=np.uint8)
        self._pool = BlockPool(num_slots)

    @property
    def num_used_bytes(self) -> int:
        return self._pool.num_used_blocks * self.layout.full_block_bytes

    def check_fits(self, num_slots: int) -> None:
        """``ValueError`` if ``num_slots`` could never be held at once (would wait forever)."""
        if num_slots > self.num_slots:
            raise ValueError(
                f"request needs {num_slots} buffer slots but the buffer has {self.num_slots}: "
                "longer than the context the buffer was sized for"
            )

    def allocate(self, num_slots: int) -> list[int] | None:
        """Slot ids, or None when not enough are free now (retry after a ``free``)."""
        self.check_fits(num_slots)
        if not self._pool.can_allocate(num_slots):
            return None
        return self._pool.allocate(num_slots)

    def free(self, slots: list[int]) -> None:
        self._pool.free(slots)

    def full_block(self, slot: int) -> np.ndarray:
        return self.array[slot]

    def layer_block(self, slot: int, layer: int) -> np.ndarray:
        return self.array[slot, layer]


class SlotQueue(Generic[R]):
    """Requests waiting, in arrival order, for slots of one buffer (its back-pressure, SPEC
    §3): each gets its slots as soon as they are free, and never before one ahead of it, then
    ``start(slots)`` (its reads) runs. Both engines queue their requests here."""

    def __init__(self, buffer: KVBuffer) -> None:
        self.buffer = buffer
        self._waiting: deque[tuple[R, int, Callable[[list[int]], None]]] = deque()

    def add(self, request: R, num_slots: int, start: Callable[[list[int]], None]) -> None:
        """Queue ``request`` for ``num_slots`` slots (``check_fits`` first: a request larger
        than the buffer would wait forever) and start every request that fits now."""
        self._waiting.append((request, num_slots, start))
        self.start_waiting()

    def start_waiting(self) -> None:
        """Start the requests at the head of the queue whose slots are free (after a free)."""
        while self._waiting:
            request, num_slots, start = self._waiting[0]
            slots = self.buffer.allocate(num_slots)
            if slots is None:
                return
            self._waiting.popleft()
            start(slots)

    def remove(self, request: R) -> bool:
        """Take a waiting request out (a cancel); False if it is not waiting."""
        for index, (waiting, _, _) in enumerate(self._waiting):
            if waiting is request:
                del self._waiting[index]
                return True
        return False

    @property
    def num_waiting_slots(self) -> int:
        return sum(num_slots for _, num_slots, _ in self._waiting)


class StoreReader:
    """Reads hit Full Blocks from the store into buffer slots on a thread pool, through the
    node's SNIC (the mover), counting the bytes: either engine's side of SPEC §2's reads."""

    def __init__(
        self,
        store: KVStore | None,
        buffer: KVBuffer,
        mover: Mover,
        *,
        num_threads: int,
        name: str,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """``on_done`` is called on the reading thread after each ``submit``'s reads end (an
        engine loop uses it to stop waiting for messages and take the request up at once)."""
        self.store = store
        self.buffer = buffer
        self.mover = mover
        self.on_done = on_done
        self.num_read_bytes = 0  # hit-KV bytes read so far (this side's path_bytes)
        # Blocks submitted and not yet read or given up: this engine's share of read_q.
        self.num_queued_blocks = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=name)

    def submit(self, keys: Sequence[BlockKey], slots: Sequence[int], what: str) -> Future[int]:
        """Read ``keys[i]`` into slot ``slots[i]``; the future gives how many leading blocks
        were read. A block that cannot be read stops the run there (it is recomputed)."""
        with self._lock:
            self.num_queued_blocks += len(keys)
        future = self._pool.submit(self._read, list(keys), list(slots), what)
        if self.on_done is not None:
            on_done = self.on_done
            future.add_done_callback(lambda _: on_done())
        return future

    def _read(self, keys: list[BlockKey], slots: list[int], what: str) -> int:
        for index, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            out = self.buffer.full_block(slot)
            try:
                self.mover("snic", out.nbytes, lambda key=key, out=out: self.store.read(key, out))
            except KVStoreError as exc:
                logger.warning(
                    "%s: block %d unreadable, recomputed from there: %s", what, index, exc
                )
                with self._lock:
                    self.num_queued_blocks -= len(keys) - index
                return index
            with self._lock:
                self.num_read_bytes += out.nbytes
                self.num_queued_blocks -= 1
        return len(keys)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(eq=False)
class BufferedRequest:
    """A placed request on one engine, from its buffer slots and this side's store reads to
    its end: what both engines' PE and DE requests share (``BufferReads`` runs it)."""

    assignment: Assignment
    params: SamplingParams
    keys: list[BlockKey]  # the hit blocks this side reads
    slots: list[int] = field(default_factory=list)
    reads: Future[int] | None = None  # -> leading blocks of ``keys`` read

    @property
    def request_id(self) -> int:
        return self.assignment.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.assignment.prompt_token_ids)

    @property
    def is_read(self) -> bool:
        return self.reads is not None and self.reads.done()


B = TypeVar("B", bound=BufferedRequest)


class BufferReads(Generic[B]):
    """One engine's reads into its buffer (SPEC §2-§3): a request waits for its slots (FIFO
    back-pressure), then its hit blocks are read into them through the node's SNIC; cancelled
    at any point, its slots come back. Every PE and DE of both engines holds one."""

    def __init__(
        self,
        side: str,
        store: KVStore | None,
        buffer: KVBuffer,
        mover: Mover,
        num_threads: int,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """``side``: "PE" or "DE" (the logs' "PE side", the threads' "pe-read");
        ``on_done`` as ``StoreReader``'s."""
        self.buffer = buffer
        self.side = f"{side} side"
        self.reader = StoreReader(
            store,
            buffer,
            mover,
            num_threads=num_threads,
            name=f"{side.lower()}-read",
            on_done=on_done,
        )
        self.queue: SlotQueue[B] = SlotQueue(buffer)

    def add(self, request: B, num_slots: int, on_slots: Callable[[B], None]) -> None:
        """Queue ``request`` for ``num_slots`` slots; ``on_slots(request)`` once it has them
        (``request.slots``), to start its reads (``read``)."""

        def start(slots: list[int]) -> None:
            request.slots = slots
            on_slots(request)

        self.queue.add(request, num_slots, start)

    def read(self, request: B, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        """Read ``keys[i]`` into slot ``slots[i]`` (``request.reads``: leading blocks read)."""
        what = f"request {request.request_id} {self.side}"
        request.reads = self.reader.submit(keys, slots, what)

    def release(self, request: B) -> None:
        """Free ``request``'s slots, whatever it is at: waiting (taken out of the queue),
        reading (once its reads end: the reading thread owns the slots until then), read."""
        if self.queue.remove(request):
            return
        if request.reads is not None:
            request.reads.result()
        self.buffer.free(request.slots)
        request.slots = []
        self.queue.start_waiting()

    def num_queued_blocks(self, *, waiting: bool) -> int:
        """Blocks submitted for reading and not read yet, and with ``waiting`` the slots of
        requests still waiting for them (a PE's side: one slot per block it will read)."""
        num_waiting = self.queue.num_waiting_slots if waiting else 0
        return self.reader.num_queued_blocks + num_waiting

    @property
    def num_read_bytes(self) -> int:
        return self.reader.num_read_bytes

    @property
    def store(self) -> KVStore | None:
        return self.reader.store

    def close(self) -> None:
        self.reader.close()

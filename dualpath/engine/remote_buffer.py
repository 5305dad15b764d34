"""A DE's KV buffer reached over the PE's transport (NIXL in a cluster): ``RemoteBuffer``.

The PE registers two host staging areas once: one receives a request's DE-side hit Layer
Blocks for one layer (READ), one is a ring that outgoing Layer Blocks are copied into before
they are written (WRITE). Transfers are posted per layer with one region per run of Layer
Blocks. A ring slot is reused only after its write landed, so in-flight data is never
overwritten. ``flush`` waits for the writes to one DE; a write that failed is raised to the
remote buffer of its own DE only (its requests fail), never to one whose writes landed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from dualpath.errors import TransferError
from dualpath.kv.layout import KVLayout
from dualpath.transfer.transport import (
    BufferDescriptor,
    SlotLayout,
    TransferHandle,
    Transport,
    layer_block_regions,
)


class TransportStaging:
    """The PE's registered staging memory, shared by every ``TransportRemoteBuffer``."""

    def __init__(
        self, transport: Transport, layout: KVLayout, *, max_read_blocks: int, ring_blocks: int
    ) -> None:
        self.transport = transport
        self.layout = layout
        block = layout.layer_block_bytes
        self.read_area = transport.allocate_host_buffer(max_read_blocks * block)
        self.read_descriptor = transport.register("pe-read-staging", self.read_area)
        self.write_ring = transport.allocate_host_buffer(ring_blocks * block)
        self.write_descriptor = transport.register("pe-write-ring", self.write_ring)
        self.max_read_blocks = max_read_blocks
        self.ring_blocks = ring_blocks
        self.next_ring_block = 0
        self.in_flight: deque[TransferHandle] = deque()  # writes not yet known to have landed
        # Peer name -> why a write to it failed, found while draining for another peer: raised
        # by that peer's next write or flush.
        self.failed: dict[str, Exception] = {}
        # Peer name -> [bytes written to it (posted), bytes read from it (landed)]: what this
        # PE moved over the transport with each DE, which a NIC carries at both ends.
        self.moved_bytes: dict[str, list[int]] = {}

    def count(self, peer_name: str, *, written: int = 0, read: int = 0) -> None:
        moved = self.moved_bytes.setdefault(peer_name, [0, 0])
        moved[0] += written
        moved[1] += read

    def drain(self, timeout_s: float) -> None:
        """Wait for every write in flight (the ring wraps after); a failure is kept for its
        peer (``failed``) and that peer's other writes are abandoned, nothing is raised."""
        while self.in_flight:
            handle = self.in_flight.popleft()
            try:
                self.transport.wait(handle, timeout_s)
            except TransferError as exc:
                self.lose(handle.peer_name, exc)

    def lose(self, peer_name: str, exc: Exception) -> None:
        """A write to ``peer_name`` failed: every other write to it is lost too, abandoned so
        that later waits (for other DEs) do not each wait one of them out."""
        self.failed.setdefault(peer_name, exc)
        kept: deque[TransferHandle] = deque()
        for other in self.in_flight:
            if other.peer_name == peer_name:
                self.transport.abandon(other)
            else:
                kept.append(other)
        self.in_flight = kept


class TransportRemoteBuffer:
    def __init__(
        self,
        staging: TransportStaging,
        peer_name: str,
        remote: BufferDescriptor,
        *,
        timeout_s: float,
    ) -> None:
        self.staging = staging
        self.transport = staging.transport
        self.peer_name = peer_name
        self.remote = remote
        self.timeout_s = timeout_s
        self._remote_layout = SlotLayout.full_blocks(staging.layout)
        self._local_layout = SlotLayout.layer_blocks(staging.layout)
        staging.failed.pop(peer_name, None)  # a DE connected anew starts clean

    def read_layer(self, slots: Sequence[int], layer: int, out: np.ndarray) -> None:
        staging = self.staging
        block = staging.layout.layer_block_bytes
        for start in range(0, len(slots), staging.max_read_blocks):
            chunk = slots[start : start + staging.max_read_blocks]
            regions = layer_block_regions(
                layer, self._local_layout, range(len(chunk)), self._remote_layout, chunk
            )
            handle = self.transport.read(
                self.peer_name, staging.read_descriptor, self.remote, regions
            )
            self.transport.wait(handle, self.timeout_s)
            staging.count(self.peer_name, read=len(chunk) * block)
            out_bytes = out[start : start + len(chunk)].reshape(-1)
            out_bytes[...] = staging.read_area[: len(chunk) * block]

    def write_layer(self, slots: Sequence[int], layer: int, data: np.ndarray) -> None:
        self._raise_failed()
        staging = self.staging
        block = staging.layout.layer_block_bytes
        for start in range(0, len(slots), staging.ring_blocks):
            chunk = slots[start : start + staging.ring_blocks]
            first = self._reserve_ring(len(chunk))
            ring = staging.write_ring[first * block : (first + len(chunk)) * block]
            ring[...] = data[start : start + len(chunk)].reshape(-1)
            regions = layer_block_regions(
                layer,
                self._local_layout,
                range(first, first + len(chunk)),
                self._remote_layout,
                chunk,
            )
            handle = self.transport.write(
                self.peer_name, staging.write_descriptor, self.remote, regions
            )
            staging.in_flight.append(handle)
            staging.count(self.peer_name, written=len(chunk) * block)

    def _reserve_ring(self, num_blocks: int) -> int:
        """First of ``num_blocks`` contiguous ring blocks. The ring wraps only after every
        write has landed, so a reservation never overlaps a write in flight."""
        staging = self.staging
        if staging.next_ring_block + num_blocks > staging.ring_blocks:
            staging.drain(self.timeout_s)
            self._raise_failed()
            staging.next_ring_block = 0
        first = staging.next_ring_block
        staging.next_ring_block = first + num_blocks
        return first

    def flush(self) -> None:
        """Wait for every write posted to this DE; raise if one failed."""
        staging = self.staging
        mine = [h for h in staging.in_flight if h.peer_name == self.peer_name]
        staging.in_flight = deque(h for h in staging.in_flight if h.peer_name != self.peer_name)
        for index, handle in enumerate(mine):
            try:
                self.transport.wait(handle, self.timeout_s)
            except TransferError as exc:
                for other in mine[index + 1 :]:
                    self.transport.abandon(other)
                staging.failed.setdefault(self.peer_name, exc)
                break
        self._raise_failed()

    def _raise_failed(self) -> None:
        exc = self.staging.failed.pop(self.peer_name, None)
        if exc is not None:
            raise exc

"""The KV data plane between engines: one ``Transport`` interface and its implementations.

A transport moves bytes between a buffer this process registered and a buffer a peer
registered, as a batch of ``Region`` s (one per Layer Block, or coalesced runs of them).

* ``NixlTransport`` (``nixl_transport.py``): NIXL with the UCX backend, as vLLM, SGLang and
  Dynamo use it. UCX picks CMA/TCP on one host, RDMA across hosts and GPU memory on a cluster.
* ``ShmTransport`` (``shm_transport.py``): POSIX shared memory, one host, no NIXL needed.
* ``FakeTransport`` (here): in-process buffers for tests; it can hold transfers to test timeouts.

Everything that crosses process lines is plain data the control channel (msgpack) carries: an
agent's ``metadata()`` is ``bytes`` and a ``BufferDescriptor`` has ``to_dict``/``from_dict``.
Connecting is one-sided: only the side that calls ``write``/``read`` connects to the other.
An engine uses it like this (``send``/``receive`` stand for the control channel)::

    slots = SlotLayout.full_blocks(kv_layout)  # both buffers hold Full Blocks here
    de = NixlTransport("de-0")  # the DE registers its buffer once and publishes it
    de_buffer = de.register("de-buffer", de.allocate_host_buffer(num_bytes))
    send(de.metadata(), de_buffer.to_dict())

    pe = NixlTransport("pe-0")  # the PE registers its buffer once and connects once
    pe_buffer = pe.register("pe-buffer", pe_kv)
    de_metadata, de_buffer_dict = receive()
    pe.connect("de-0", de_metadata)
    de_buffer = BufferDescriptor.from_dict(de_buffer_dict)
    # After layer l: push layer l of PE blocks 0, 1, 2 into DE slots 7, 3, 4, one batch.
    regions = layer_block_regions(l, slots, [0, 1, 2], slots, [7, 3, 4])
    pe.wait(pe.write("de-0", pe_buffer, de_buffer, regions), timeout_s=5.0)
"""

from __future__ import annotations

import abc
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack
import numpy as np

from dualpath.errors import PeerUnavailable, TransferError, TransferTimeout
from dualpath.kv.layout import KVLayout

if TYPE_CHECKING:
    import torch

    Buffer = np.ndarray | torch.Tensor

TRANSPORT_KINDS = ("nixl", "shm")  # what create_transport builds; the fake needs a FakeNetwork
_MAX_POLL_SLEEP_S = 0.001  # wait() polls at most this far apart: never > 1 ms late


class TransferOp(Enum):
    WRITE = "WRITE"  # local -> remote (PE pushes layer KV into the DE buffer)
    READ = "READ"  # remote -> local (PE pulls a layer of hit KV out of the DE buffer)


class Region(NamedTuple):
    """One contiguous run of bytes: ``num_bytes`` at ``local_offset_bytes`` in the local buffer
    and at ``remote_offset_bytes`` in the remote one (offsets from each buffer's start)."""

    local_offset_bytes: int
    remote_offset_bytes: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class BufferDescriptor:
    """A registered buffer, as peers address it. Plain data: send ``to_dict()`` to peers.

    Only its owner's transport can use it as the local side; peers use it as the remote side
    after ``connect`` with metadata published after it was registered.
    """

    owner_name: str  # the transport (NIXL agent) that registered it
    buffer_id: str  # unique per owner
    address: int  # virtual address in the owner's process (device pointer for VRAM)
    num_bytes: int
    mem_type: str  # "DRAM" (host) or "VRAM" (GPU)
    device_id: int  # CUDA device index for VRAM, 0 for DRAM

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BufferDescriptor:
        names = {field.name for field in fields(cls)}
        if set(data) != names:
            raise ValueError(f"buffer descriptor needs keys {sorted(names)}, got {sorted(data)}")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class TransferHandle:
    """One posted transfer. Opaque: only ``transport_name``'s ``is_done``/``wait`` take it."""

    transport_name: str
    transfer_id: int  # per transport, from 0
    peer_name: str
    op: TransferOp
    num_bytes: int  # payload of all regions
    num_regions: int


class Transport(abc.ABC):
    """Moves bytes between buffers registered here and buffers registered by connected peers.

    Contract, the same for every implementation:

    * ``register`` a buffer once and reuse its descriptor for every transfer; the transport
      keeps a reference to it until ``close``. Peers see a buffer only through ``metadata()``
      taken after it was registered (``connect`` again to refresh).
    * ``write``/``read`` post one batch of regions and return a handle, or raise
      ``PeerUnavailable``/``TransferError`` when they cannot post it. They may move the bytes
      before returning (UCX over CMA and the shared-memory transport do; both release the
      GIL while copying): call them from a worker thread to overlap with compute.
    * ``wait(handle, timeout_s)`` returns once the bytes have landed, or raises
      ``TransferTimeout`` (the transfer is cancelled and its destination bytes are undefined),
      ``PeerUnavailable`` (the peer is gone) or ``TransferError``. ``is_done`` polls without
      blocking. Both may repeat: a finished handle answers at once, a failed one re-raises.
    * A transport is not thread-safe: calls must not overlap (they may come from any thread).
    * Bad regions raise ``ValueError``; using a peer that was never connected, a handle of
      another transport, or a closed transport is a caller bug and raises ``RuntimeError``.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"transport name must be a non-empty str, got {name!r}")
        self.name = name
        self.num_registrations = 0  # buffers registered with the backend, ever (tests, metrics)
        self._buffer_id_to_registration: dict[str, _Registration] = {}
        self._peer_names: set[str] = set()
        self._next_transfer_id = 0
        self._transfer_id_to_pending: dict[int, Any] = {}
        self._transfer_id_to_error: dict[int, TransferError] = {}  # failed handles re-raise
        self._is_closed = False

    # --- public interface -------------------------------------------------------------------

    def allocate_host_buffer(self, num_bytes: int) -> np.ndarray:
        """A zeroed ``uint8`` host array of ``num_bytes`` that this transport can register."""
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be > 0, got {num_bytes}")
        return np.zeros(num_bytes, dtype=np.uint8)  # calloc: pages appear when first touched

    def register(self, buffer_id: str, buffer: Buffer) -> BufferDescriptor:
        """Register a C-contiguous numpy array or torch tensor (CPU, or CUDA on NIXL) once."""
        self._check_open()
        if not isinstance(buffer_id, str) or not buffer_id:
            raise ValueError(f"buffer_id must be a non-empty str, got {buffer_id!r}")
        if buffer_id in self._buffer_id_to_registration:
            raise ValueError(f"buffer {buffer_id!r} is already registered with {self.name!r}")
        address, num_bytes, mem_type, device_id = buffer_placement(buffer)
        descriptor = BufferDescriptor(self.name, buffer_id, address, num_bytes, mem_type, device_id)
        backend_state = self._register(descriptor, buffer)
        self._buffer_id_to_registration[buffer_id] = _Registration(
            descriptor, buffer, backend_state
        )
        self.num_registrations += 1
        return descriptor

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer passes to ``connect`` to reach this transport and its buffers so far."""

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        """Make ``peer_name``'s registered buffers reachable. Repeat to refresh (more buffers
        registered, or the peer restarted under the same name)."""
        self._check_open()
        self._connect(peer_name, peer_metadata)
        self._peer_names.add(peer_name)

    def write(
        self,
        peer_name: str,
        local: BufferDescriptor,
        remote: BufferDescriptor,
        regions: Sequence[Region],
    ) -> TransferHandle:
        """Copy each region from ``local`` (ours) into ``remote`` (``peer_name``'s)."""
        return self._start(TransferOp.WRITE, peer_name, local, remote, regions)

    def read(
        self,
        peer_name: str,
        local: BufferDescriptor,
        remote: BufferDescriptor,
        regions: Sequence[Region],
    ) -> TransferHandle:
        """Copy each region from ``remote`` (``peer_name``'s) into ``local`` (ours)."""
        return self._start(TransferOp.READ, peer_name, local, remote, regions)

    def is_done(self, handle: TransferHandle) -> bool:
        """True once the bytes have landed; raises the transfer's error if it failed."""
        self._check_handle(handle)
        error = self._transfer_id_to_error.get(handle.transfer_id)
        if error is not None:
            raise error
        state = self._transfer_id_to_pending.get(handle.transfer_id)
        if state is None:
            return True
        try:
            is_done = self._poll(handle, state)
        except TransferError as exc:
            exc.peer_name = handle.peer_name
            del self._transfer_id_to_pending[handle.transfer_id]
            self._transfer_id_to_error[handle.transfer_id] = exc
            raise
        if is_done:
            del self._transfer_id_to_pending[handle.transfer_id]
        return is_done

    def abandon(self, handle: TransferHandle) -> None:
        """Give up a transfer without waiting for it (its peer is gone): a pending one is
        cancelled; a finished or failed one is forgotten."""
        self._check_handle(handle)
        self._transfer_id_to_error.pop(handle.transfer_id, None)
        state = self._transfer_id_to_pending.pop(handle.transfer_id, None)
        if state is not None:
            self._abort(state)

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Block until ``handle`` is done; ``TransferTimeout`` after ``timeout_s`` seconds."""
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        deadline_s = time.monotonic() + timeout_s
        sleep_s = 0.0
        while not self.is_done(handle):
            if time.monotonic() >= deadline_s:
                self._fail(handle, TransferTimeout(f"{_describe(handle)} not done in {timeout_s}s"))
            time.sleep(sleep_s)
            sleep_s = min(max(2 * sleep_s, 1e-5), _MAX_POLL_SLEEP_S)

    def close(self) -> None:
        """Cancel pending transfers, deregister every buffer, disconnect. May repeat."""
        if self._is_closed:
            return
        for transfer_id, state in list(self._transfer_id_to_pending.items()):
            self._abort(state)
            del self._transfer_id_to_pending[transfer_id]
        self._close()
        self._is_closed = True

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- what an implementation provides ----------------------------------------------------

    @abc.abstractmethod
    def _register(self, descriptor: BufferDescriptor, buffer: Buffer) -> Any:
        """Register with the backend; the result is kept as ``_Registration.backend_state``."""

    @abc.abstractmethod
    def _connect(self, peer_name: str, peer_metadata: bytes) -> None: ...

    @abc.abstractmethod
    def _post(
        self,
        op: TransferOp,
        peer_name: str,
        local: BufferDescriptor,
        remote: BufferDescriptor,
        regions: np.ndarray,  # int64 [num_regions, 3], validated, num_regions > 0
    ) -> Any:
        """Start the transfer; the result is the state ``_poll`` and ``_abort`` get."""

    @abc.abstractmethod
    def _poll(self, handle: TransferHandle, state: Any) -> bool:
        """True when done, False while in progress; raise ``TransferError`` on failure."""

    @abc.abstractmethod
    def _abort(self, state: Any) -> None:
        """Cancel a transfer that is still pending; it will never be polled again."""

    @abc.abstractmethod
    def _close(self) -> None: ...

    # --- shared helpers ---------------------------------------------------------------------

    def _registration(self, buffer_id: str) -> _Registration:
        return self._buffer_id_to_registration[buffer_id]

    def _start(
        self,
        op: TransferOp,
        peer_name: str,
        local: BufferDescriptor,
        remote: BufferDescriptor,
        regions: Sequence[Region],
    ) -> TransferHandle:
        self._check_open()
        if peer_name not in self._peer_names:
            raise RuntimeError(f"caller bug: {self.name!r} never connected to {peer_name!r}")
        registration = self._buffer_id_to_registration.get(local.buffer_id)
        if registration is None or registration.descriptor != local:
            raise ValueError(f"local buffer {local} is not registered with {self.name!r}")
        if remote.owner_name != peer_name:
            raise ValueError(f"remote buffer {remote} does not belong to {peer_name!r}")
        region_array = _validated_regions(regions, local, remote)
        handle = TransferHandle(
            transport_name=self.name,
            transfer_id=self._next_transfer_id,
            peer_name=peer_name,
            op=op,
            num_bytes=int(region_array[:, 2].sum()),
            num_regions=len(region_array),
        )
        self._next_transfer_id += 1
        if len(region_array) > 0:
            try:
                state = self._post(op, peer_name, local, remote, region_array)
            except TransferError as exc:
                exc.peer_name = peer_name
                raise
            self._transfer_id_to_pending[handle.transfer_id] = state
        return handle

    def _fail(self, handle: TransferHandle, error: TransferError) -> None:
        """Cancel a pending transfer, remember ``error`` for later calls, and raise it."""
        error.peer_name = handle.peer_name
        self._abort(self._transfer_id_to_pending.pop(handle.transfer_id))
        self._transfer_id_to_error[handle.transfer_id] = error
        raise error

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError(f"caller bug: transport {self.name!r} is closed")

    def _check_handle(self, handle: TransferHandle) -> None:
        self._check_open()
        if handle.transport_name != self.name or handle.transfer_id >= self._next_transfer_id:
            raise RuntimeError(f"caller bug: {handle} was not returned by {self.name!r}")


@dataclass(frozen=True, slots=True)
class _Registration:
    descriptor: BufferDescriptor
    buffer: Any  # keeps the memory alive while it is registered
    backend_state: Any


def _validated_regions(
    regions: Sequence[Region], local: BufferDescriptor, remote: BufferDescriptor
) -> np.ndarray:
    """Regions as int64 ``[n, 3]``; ``ValueError`` for any that is empty or out of bounds."""
    array = np.asarray(regions, dtype=np.int64).reshape(-1, 3)
    local_offsets, remote_offsets, sizes = array[:, 0], array[:, 1], array[:, 2]
    is_bad = (
        (sizes <= 0)
        | (local_offsets < 0)
        | (remote_offsets < 0)
        | (local_offsets + sizes > local.num_bytes)
        | (remote_offsets + sizes > remote.num_bytes)
    )
    if is_bad.any():
        index = int(np.flatnonzero(is_bad)[0])
        raise ValueError(
            f"region {index} {tuple(array[index].tolist())} is empty or outside the local "
            f"buffer {local.buffer_id!r} ({local.num_bytes} bytes) or the remote buffer "
            f"{remote.buffer_id!r} ({remote.num_bytes} bytes)"
        )
    return array


def _describe(handle: TransferHandle) -> str:
    return (
        f"{handle.op.value} of {handle.num_bytes} bytes in {handle.num_regions} regions "
        f"between {handle.transport_name!r} and {handle.peer_name!r}"
    )


# --- buffers ------------------------------------------------------------------------------------


def buffer_placement(buffer: Buffer) -> tuple[int, int, str, int]:
    """``(address, num_bytes, mem_type, device_id)`` of a contiguous array or tensor."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("a registered numpy buffer must be C-contiguous")
        placement = (buffer.ctypes.data, buffer.nbytes, "DRAM", 0)
    elif _is_torch_tensor(buffer):
        if not buffer.is_contiguous():
            raise ValueError("a registered torch buffer must be contiguous")
        num_bytes = buffer.numel() * buffer.element_size()
        if buffer.device.type == "cuda":
            placement = (buffer.data_ptr(), num_bytes, "VRAM", buffer.device.index or 0)
        elif buffer.device.type == "cpu":
            placement = (buffer.data_ptr(), num_bytes, "DRAM", 0)
        else:
            raise ValueError(f"cannot register a tensor on device {buffer.device}")
    else:
        raise ValueError(f"a buffer must be a numpy array or torch tensor, got {type(buffer)}")
    if placement[1] == 0:
        raise ValueError("cannot register an empty buffer")
    return placement


def host_bytes(buffer: Buffer) -> np.ndarray:
    """A flat ``uint8`` numpy view of a host buffer's memory (no copy)."""
    if _is_torch_tensor(buffer):
        if buffer.device.type != "cpu":
            raise ValueError(f"this transport moves host memory only, got a {buffer.device} tensor")
        buffer = buffer.detach().reshape(-1).view(sys.modules["torch"].uint8).numpy()
    return buffer.reshape(-1).view(np.uint8)


def copy_regions(
    op: TransferOp, local_bytes: np.ndarray, remote_bytes: np.ndarray, regions: np.ndarray
) -> None:
    """Move validated ``regions`` between two flat byte views (numpy releases the GIL)."""
    source, destination = (
        (local_bytes, remote_bytes) if op is TransferOp.WRITE else (remote_bytes, local_bytes)
    )
    source_column, destination_column = (0, 1) if op is TransferOp.WRITE else (1, 0)
    for region in regions.tolist():
        start, end, num_bytes = region[source_column], region[destination_column], region[2]
        destination[end : end + num_bytes] = source[start : start + num_bytes]


def _is_torch_tensor(obj: object) -> bool:
    # A tensor can only exist if torch is already imported, so this never imports torch.
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(obj, torch_module.Tensor)


# --- regions of the Full Block layout -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Where the Layer Block ``(slot, layer)`` of a buffer of block slots sits::

        offset_bytes(slot, layer) = base_offset_bytes + slot * slot_stride_bytes
                                                      + layer * layer_stride_bytes

    ``full_blocks``: a buffer of Full Blocks (PE/DE buffers, ``PagedKVCache.kv``), where one
    slot is ``[num_layers, block_size, bpt]``. ``layer_blocks``: a buffer holding one layer's
    Layer Blocks (the PE's per-layer device staging), where ``layer`` is ignored.
    """

    layer_block_bytes: int
    slot_stride_bytes: int
    layer_stride_bytes: int
    base_offset_bytes: int = 0

    @classmethod
    def full_blocks(cls, layout: KVLayout, base_offset_bytes: int = 0) -> SlotLayout:
        return cls(
            layout.layer_block_bytes,
            layout.full_block_bytes,
            layout.layer_block_bytes,
            base_offset_bytes,
        )

    @classmethod
    def layer_blocks(cls, layout: KVLayout, base_offset_bytes: int = 0) -> SlotLayout:
        return cls(layout.layer_block_bytes, layout.layer_block_bytes, 0, base_offset_bytes)

    def offset_bytes(self, slot: int, layer: int) -> int:
        return (
            self.base_offset_bytes + slot * self.slot_stride_bytes + layer * self.layer_stride_bytes
        )


def layer_block_regions(
    layer: int,
    local: SlotLayout,
    local_slots: Sequence[int],
    remote: SlotLayout,
    remote_slots: Sequence[int],
) -> list[Region]:
    """Regions moving Layer Block ``layer`` of ``local_slots[i]`` <-> ``remote_slots[i]``.

    One region per Layer Block, then runs that are adjacent on both sides are merged (e.g.
    consecutive slots of two ``layer_blocks`` buffers become one region).
    """
    if len(local_slots) != len(remote_slots):
        raise ValueError(f"{len(local_slots)} local slots but {len(remote_slots)} remote slots")
    if local.layer_block_bytes != remote.layer_block_bytes:
        raise ValueError(
            f"layer blocks differ: {local.layer_block_bytes} local bytes, "
            f"{remote.layer_block_bytes} remote bytes"
        )
    if layer < 0 or min(local_slots, default=0) < 0 or min(remote_slots, default=0) < 0:
        raise ValueError(f"layer and slots must be >= 0, got layer {layer}")
    return coalesce_regions(
        Region(
            local.offset_bytes(local_slot, layer),
            remote.offset_bytes(remote_slot, layer),
            local.layer_block_bytes,
        )
        for local_slot, remote_slot in zip(local_slots, remote_slots, strict=True)
    )


def coalesce_regions(regions: Iterable[Region]) -> list[Region]:
    """Merge each region into the previous one when both sides continue it; order is kept."""
    merged: list[Region] = []
    for region in regions:
        if merged:
            last = merged[-1]
            if (
                last.local_offset_bytes + last.num_bytes == region.local_offset_bytes
                and last.remote_offset_bytes + last.num_bytes == region.remote_offset_bytes
            ):
                merged[-1] = last._replace(num_bytes=last.num_bytes + region.num_bytes)
                continue
        merged.append(Region(*region))
    return merged


# --- factory and fake ---------------------------------------------------------------------------


def create_transport(kind: str, name: str) -> Transport:
    """A real transport by kind: ``"nixl"`` (needs nixl-cu12) or ``"shm"`` (one host)."""
    if kind == "nixl":
        from dualpath.transfer.nixl_transport import NixlTransport

        return NixlTransport(name)
    if kind == "shm":
        from dualpath.transfer.shm_transport import ShmTransport

        return ShmTransport(name)
    raise ValueError(f"transport kind must be one of {TRANSPORT_KINDS}, got {kind!r}")


class FakeNetwork:
    """The in-process wire ``FakeTransport`` s find each other on; one per test."""

    def __init__(self) -> None:
        self.name_to_transport: dict[str, FakeTransport] = {}


class FakeTransport(Transport):
    """A real ``Transport`` over in-process buffers. With ``holds_transfers`` set, posted
    transfers wait (bytes unmoved) until ``complete_held_transfers()``; the fake has no clock,
    so a ``wait`` on a held transfer times out at once, deterministically."""

    def __init__(self, name: str, network: FakeNetwork, *, holds_transfers: bool = False) -> None:
        super().__init__(name)
        if name in network.name_to_transport:
            raise ValueError(f"a fake transport named {name!r} is already on this network")
        network.name_to_transport[name] = self
        self.holds_transfers = holds_transfers
        self._network = network
        self._held: list[_FakeTransfer] = []
        self._peer_name_to_buffer_ids: dict[str, set[str]] = {}

    def metadata(self) -> bytes:
        self._check_open()
        buffer_ids = sorted(self._buffer_id_to_registration)
        return msgpack.packb({"kind": "fake", "name": self.name, "buffer_ids": buffer_ids})

    def complete_held_transfers(self) -> int:
        """Move the bytes of every held transfer, oldest first; how many there were."""
        held, self._held = self._held, []
        for transfer in held:
            self._run(transfer)
        return len(held)

    def _register(self, descriptor: BufferDescriptor, buffer: Buffer) -> np.ndarray:
        return host_bytes(buffer)

    def _connect(self, peer_name: str, peer_metadata: bytes) -> None:
        metadata = msgpack.unpackb(peer_metadata)
        if metadata.get("kind") != "fake" or metadata.get("name") != peer_name:
            raise ValueError(f"metadata is not a fake transport's named {peer_name!r}")
        if self._live_peer(peer_name) is None:
            raise PeerUnavailable(f"fake peer {peer_name!r} is not on the network")
        self._peer_name_to_buffer_ids[peer_name] = set(metadata["buffer_ids"])

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Nothing moves a held transfer while we wait, so it times out at once."""
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        if not self.is_done(handle):
            self._fail(handle, TransferTimeout(f"{_describe(handle)} is held by the fake"))

    def _post(
        self,
        op: TransferOp,
        peer_name: str,
        local: BufferDescriptor,
        remote: BufferDescriptor,
        regions: np.ndarray,
    ) -> _FakeTransfer:
        if self._live_peer(peer_name) is None:
            raise PeerUnavailable(f"fake peer {peer_name!r} is closed")
        if remote.buffer_id not in self._peer_name_to_buffer_ids[peer_name]:
            raise TransferError(f"{peer_name!r} published no buffer {remote.buffer_id!r}")
        transfer = _FakeTransfer(op, peer_name, local.buffer_id, remote.buffer_id, regions)
        if self.holds_transfers:
            self._held.append(transfer)
        else:
            self._run(transfer)
        return transfer

    def _poll(self, handle: TransferHandle, state: _FakeTransfer) -> bool:
        if state.error is not None:
            raise state.error
        return state.is_done

    def _abort(self, state: _FakeTransfer) -> None:
        if state in self._held:
            self._held.remove(state)

    def _close(self) -> None:
        del self._network.name_to_transport[self.name]

    def _live_peer(self, peer_name: str) -> FakeTransport | None:
        return self._network.name_to_transport.get(peer_name)

    def _run(self, transfer: _FakeTransfer) -> None:
        peer = self._live_peer(transfer.peer_name)
        if peer is None:
            transfer.error = PeerUnavailable(f"fake peer {transfer.peer_name!r} closed")
            return
        copy_regions(
            transfer.op,
            self._registration(transfer.local_buffer_id).backend_state,
            peer._registration(transfer.remote_buffer_id).backend_state,
            transfer.regions,
        )
        transfer.is_done = True


@dataclass(eq=False, slots=True)
class _FakeTransfer:
    op: TransferOp
    peer_name: str
    local_buffer_id: str
    remote_buffer_id: str
    regions: np.ndarray
    is_done: bool = False
    error: TransferError | None = None

"""``Transport`` over POSIX shared memory, for one host and platforms without the NIXL wheel.

Buffers must come from ``allocate_host_buffer`` (a ``multiprocessing.shared_memory`` segment
each; a CPU tensor made with ``torch.from_numpy`` of one works too), because a peer can only
reach memory that lives in a segment. ``metadata()`` names the segments of the buffers
registered so far; ``connect`` maps them. ``write``/``read`` then copy with numpy in the
calling process (GIL released), so a posted transfer is already done.

A peer is alive while its process runs (pid plus start time, so a reused pid is not mistaken
for it) and its transport is open (a flag in a small control segment it clears on ``close``).
Transfers check both before and after copying and raise ``PeerUnavailable`` otherwise.
"""

from __future__ import annotations

import _posixshmem  # the stdlib's shm_open, as multiprocessing.shared_memory uses it
import mmap
import os
import socket
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING

import msgpack
import numpy as np

from dualpath.errors import PeerUnavailable, TransferError
from dualpath.transfer.transport import (
    BufferDescriptor,
    TransferHandle,
    TransferOp,
    Transport,
    buffer_placement,
    copy_regions,
    host_bytes,
)

if TYPE_CHECKING:
    from dualpath.transfer.transport import Buffer

_IS_OPEN = 1  # control segment byte 0 while the owner's transport is open
_LINUX_SHM_DIR = "/dev/shm"


@dataclass(frozen=True, slots=True)
class _ShmRegistration:
    segment_name: str
    offset_bytes: int  # of the buffer inside its segment
    data: np.ndarray  # flat uint8 view of the buffer


@dataclass(slots=True)
class _ShmPeer:
    pid: int
    start_time: int | None  # clock ticks after boot, from /proc; None where unknown
    control: np.ndarray
    buffer_id_to_data: dict[str, np.ndarray] = field(default_factory=dict)
    segment_name_to_data: dict[str, np.ndarray] = field(default_factory=dict)


class ShmTransport(Transport):
    """Shared-memory transport between processes of one host; see ``Transport``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._control_segment, self._control = _create_segment(1)
        self._control[0] = _IS_OPEN
        # (segment, its bytes, address of its first byte), for every allocate_host_buffer.
        self._segments: list[tuple[SharedMemory, np.ndarray, int]] = []
        self._peer_name_to_peer: dict[str, _ShmPeer] = {}

    def allocate_host_buffer(self, num_bytes: int) -> np.ndarray:
        """A zeroed ``uint8`` array in a new shared-memory segment; valid until ``close``."""
        self._check_open()
        if num_bytes <= 0:
            raise ValueError(f"num_bytes must be > 0, got {num_bytes}")
        segment, data = _create_segment(num_bytes)
        self._segments.append((segment, data, data.ctypes.data))
        return data

    def metadata(self) -> bytes:
        self._check_open()
        buffers = {}
        for buffer_id, registration in self._buffer_id_to_registration.items():
            state = registration.backend_state
            buffers[buffer_id] = [state.segment_name, state.offset_bytes, state.data.size]
        return msgpack.packb(
            {
                "kind": "shm",
                "name": self.name,
                "host_id": _host_id(),
                "pid": os.getpid(),
                "start_time": _process_start_time(os.getpid()),
                "control_segment": self._control_segment.name,
                "buffers": buffers,
            }
        )

    def _register(self, descriptor: BufferDescriptor, buffer: Buffer) -> _ShmRegistration:
        address, num_bytes, _, _ = buffer_placement(buffer)
        for segment, data, segment_address in self._segments:
            offset_bytes = address - segment_address
            if offset_bytes >= 0 and offset_bytes + num_bytes <= data.size:
                return _ShmRegistration(segment.name, offset_bytes, host_bytes(buffer))
        raise ValueError(
            f"{descriptor.buffer_id!r} is not in shared memory: ShmTransport registers only "
            "buffers from its allocate_host_buffer()"
        )

    def _connect(self, peer_name: str, peer_metadata: bytes) -> None:
        metadata = msgpack.unpackb(peer_metadata)
        if metadata.get("kind") != "shm" or metadata.get("name") != peer_name:
            raise ValueError(f"metadata is not a shared-memory transport's named {peer_name!r}")
        if metadata["host_id"] != _host_id():
            raise ValueError(f"{peer_name!r} is on another host; shared memory needs one host")
        peer = self._peer_name_to_peer.get(peer_name)
        if peer is None or (peer.pid, peer.start_time) != (metadata["pid"], metadata["start_time"]):
            peer = _ShmPeer(
                metadata["pid"],
                metadata["start_time"],
                self._map(peer_name, metadata["control_segment"]),
            )
        for buffer_id, (segment_name, offset_bytes, num_bytes) in metadata["buffers"].items():
            if segment_name not in peer.segment_name_to_data:
                peer.segment_name_to_data[segment_name] = self._map(peer_name, segment_name)
            data = peer.segment_name_to_data[segment_name]
            peer.buffer_id_to_data[buffer_id] = data[offset_bytes : offset_bytes + num_bytes]
        self._peer_name_to_peer[peer_name] = peer

    def _post(
        self,
        op: TransferOp,
        peer_name: str,
        local: BufferDescriptor,
        remote: BufferDescriptor,
        regions: np.ndarray,
    ) -> None:
        peer = self._peer_name_to_peer[peer_name]
        self._check_alive(peer_name, peer)
        remote_data = peer.buffer_id_to_data.get(remote.buffer_id)
        if remote_data is None or remote_data.size != remote.num_bytes:
            raise TransferError(
                f"{peer_name!r} published no buffer {remote.buffer_id!r} of {remote.num_bytes} "
                "bytes (connect again with fresh metadata)"
            )
        copy_regions(
            op, self._registration(local.buffer_id).backend_state.data, remote_data, regions
        )
        self._check_alive(peer_name, peer)  # the bytes may have gone to a dying peer

    def _poll(self, handle: TransferHandle, state: None) -> bool:
        return True  # _post copied already

    def _abort(self, state: None) -> None:
        pass  # nothing is ever in flight

    def _close(self) -> None:
        self._control[0] = 0  # peers stop writing here from now on
        self._peer_name_to_peer.clear()
        # Unlinked names are gone; each mapping goes with the last array that uses it.
        for segment in [self._control_segment] + [segment for segment, _, _ in self._segments]:
            segment.unlink()
        self._segments.clear()

    def _map(self, peer_name: str, segment_name: str) -> np.ndarray:
        try:
            return _map_segment(segment_name)
        except FileNotFoundError as exc:
            raise PeerUnavailable(f"{peer_name!r}'s segment {segment_name} is gone") from exc

    def _check_alive(self, peer_name: str, peer: _ShmPeer) -> None:
        if peer.control[0] != _IS_OPEN:
            raise PeerUnavailable(f"{peer_name!r} closed its transport")
        if not _is_process_alive(peer.pid, peer.start_time):
            raise PeerUnavailable(f"{peer_name!r} (pid {peer.pid}) has exited")


def _create_segment(num_bytes: int) -> tuple[SharedMemory, np.ndarray]:
    """A new segment (unlinked by the resource tracker if this process dies) and its bytes."""
    segment = SharedMemory(create=True, size=num_bytes)
    segment.close()  # drop SharedMemory's own mapping: it cannot close while arrays use it
    return segment, _map_segment(segment.name)[:num_bytes]


def _map_segment(segment_name: str) -> np.ndarray:
    """Map a segment by name; the returned array keeps the mapping alive, nothing to close.

    NOTE: not SharedMemory(name): before Python 3.13 that registers the segment with this
    process's resource tracker, which unlinks it under its owner when this process exits
    (or, with a tracker shared with the owner, drops the owner's registration).
    """
    fd = _posixshmem.shm_open("/" + segment_name, os.O_RDWR, mode=0o600)
    try:
        mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=np.uint8)


def _host_id() -> str:
    """Same value in every process of one boot of one machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            boot_id = file.read().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def _process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot (``/proc``); None if unknown or gone."""
    stat = _read_proc_stat(pid)
    return None if stat is None else int(stat[19])


def _is_process_alive(pid: int, start_time: int | None) -> bool:
    stat = _read_proc_stat(pid)
    if stat is not None:  # Linux: a zombie or a new process under a reused pid is not alive
        return stat[0] not in ("Z", "X") and (start_time is None or int(stat[19]) == start_time)
    if os.path.isdir(f"/proc/{os.getpid()}"):
        return False  # /proc works here, and has no entry for pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after the command name), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            stat = file.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()

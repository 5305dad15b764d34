"""A peer engine in its own OS process for transport tests, driven over a pipe.

The peer owns one registered host buffer (``PEER_BUFFER_ID``). Everything on the pipe is
msgpack, as on the real control channel: the peer's metadata and descriptor go out once, then
commands come in and replies go out.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass

import msgpack
import numpy as np

from dualpath.transfer.transport import BufferDescriptor, Region, create_transport

PEER_BUFFER_ID = "peer-buffer"
_REPLY_TIMEOUT_S = 30.0  # a peer that stops answering fails the test instead of hanging it


def serve(
    conn: multiprocessing.connection.Connection,
    kind: str,
    name: str,
    num_bytes: int,
    env: dict[str, str],
) -> None:
    """The peer process's main: register one buffer, publish it, then obey commands."""
    os.environ.update(env)
    transport = create_transport(kind, name)
    buffer = transport.allocate_host_buffer(num_bytes)
    descriptor = transport.register(PEER_BUFFER_ID, buffer)
    conn.send_bytes(msgpack.packb([transport.metadata(), descriptor.to_dict()]))
    while True:
        command, *args = msgpack.unpackb(conn.recv_bytes())
        reply: object = None
        if command == "fill":  # seed -> buffer = seeded random bytes
            buffer[:] = np.random.default_rng(args[0]).integers(0, 256, num_bytes, np.uint8)
        elif command == "get":  # offset, num_bytes -> those bytes
            reply = bytes(buffer[args[0] : args[0] + args[1]])
        elif command == "write":  # metadata, descriptor, regions -> write ours into theirs
            metadata, remote, regions = args
            remote = BufferDescriptor.from_dict(remote)
            transport.connect(remote.owner_name, metadata)
            regions = [Region(*region) for region in regions]
            handle = transport.write(remote.owner_name, descriptor, remote, regions)
            transport.wait(handle, timeout_s=10.0)
        elif command == "close":
            transport.close()
            conn.send_bytes(msgpack.packb(None))
            return
        conn.send_bytes(msgpack.packb(reply))


@dataclass
class PeerProcess:
    """The test side of a peer: its process, its metadata and its buffer's descriptor."""

    kind: str  # "nixl" or "shm"
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    metadata: bytes
    descriptor: BufferDescriptor

    def call(self, *command: object) -> object:
        self.conn.send_bytes(msgpack.packb(list(command)))
        if not self.conn.poll(_REPLY_TIMEOUT_S):
            raise TimeoutError(f"peer {self.descriptor.owner_name!r} did not answer {command[0]}")
        return msgpack.unpackb(self.conn.recv_bytes())

    def fill(self, seed: int) -> np.ndarray:
        """Fill the peer's buffer with seeded bytes; returns the same bytes made here."""
        self.call("fill", seed)
        return np.random.default_rng(seed).integers(0, 256, self.descriptor.num_bytes, np.uint8)

    def get(self) -> np.ndarray:
        """A copy of the peer's whole buffer."""
        data = self.call("get", 0, self.descriptor.num_bytes)
        return np.frombuffer(data, dtype=np.uint8)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=_REPLY_TIMEOUT_S)

    def stop(self) -> None:
        if self.process.is_alive():
            self.call("close")
            self.process.join(timeout=_REPLY_TIMEOUT_S)
        self.conn.close()


def start_peer(
    kind: str, name: str, num_bytes: int, env: dict[str, str] | None = None
) -> PeerProcess:
    """Spawn a fresh interpreter running ``serve`` and wait for its metadata."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    process = context.Process(
        target=serve, args=(child_conn, kind, name, num_bytes, env or {}), daemon=True
    )
    process.start()
    child_conn.close()
    if not conn.poll(_REPLY_TIMEOUT_S):
        process.kill()
        raise TimeoutError(f"peer {name!r} ({kind}) did not start")
    metadata, descriptor = msgpack.unpackb(conn.recv_bytes())
    return PeerProcess(kind, process, conn, metadata, BufferDescriptor.from_dict(descriptor))

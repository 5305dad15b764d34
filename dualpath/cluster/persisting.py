"""Blocks the decode engines are still writing, and the requests that wait for them.

A DE persists a request's new blocks write-behind (``KVStoreIO``), so a request can finish
before its last blocks are in the store. An agent sends its next turn at once: the turn's
lookup then stops at the first block still being written, and the prefill engine would
recompute everything from there, often most of the context (with a 3-turn-old block late,
nearly all of it). On a capped SNIC that write can take a while behind the node's reads.

Instead the scheduler keeps, per finished request, the keys its DE reported as still being
written (``TokenUpdate.persisting_keys``) until the DE reports them done (``KVPersisted``).
A new request whose hit prefix stops at such a key waits for that request's writes, then is
looked up again and placed: a short wait instead of a long recomputation. Waits are bounded:
a request whose writes are not confirmed within ``wait_s`` of its finish, or whose DE dies,
is forgotten and its waiters are placed with whatever the store holds then.

Pure bookkeeping: no I/O, no clock of its own; the coordinator drives it from its loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dualpath.kv.hashing import BlockKey

W = TypeVar("W")  # what waits: the coordinator's request state


@dataclass
class _Writer(Generic[W]):
    """A finished request whose blocks are being written."""

    decode_engine_id: int
    keys: tuple[BlockKey, ...]
    since_s: float
    waiters: list[W] = field(default_factory=list)


class PersistingBlocks(Generic[W]):
    def __init__(self, wait_s: float) -> None:
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self.wait_s = wait_s
        self._key_to_writer: dict[BlockKey, int] = {}
        # request id -> writer, oldest first (``expire`` pops from the front).
        self._writers: dict[int, _Writer[W]] = {}
        self.num_waits = 0  # requests that waited (each wait counted)
        self.num_expired = 0  # writers never confirmed within wait_s

    @property
    def is_enabled(self) -> bool:
        return self.wait_s > 0

    def __len__(self) -> int:
        """Requests whose blocks are still being written."""
        return len(self._writers)

    def add(
        self, request_id: int, decode_engine_id: int, keys: Sequence[BlockKey], now_s: float
    ) -> None:
        """``request_id`` finished with ``keys`` still being written by its DE."""
        if not self.is_enabled or not keys:
            return
        if request_id in self._writers:
            raise RuntimeError(f"caller bug: request {request_id} finished twice")
        self._writers[request_id] = _Writer(decode_engine_id, tuple(keys), now_s)
        for key in keys:  # a later writer of the same block takes it over
            self._key_to_writer[key] = request_id

    def writer_of(self, key: BlockKey) -> int | None:
        """The finished request still writing ``key``, or None."""
        return self._key_to_writer.get(key)

    def wait(self, writer_id: int, waiter: W) -> None:
        """Hold ``waiter`` until ``writer_id``'s writes are done (see ``written``)."""
        self._writers[writer_id].waiters.append(waiter)
        self.num_waits += 1

    def written(self, request_ids: Sequence[int]) -> list[W]:
        """The DE reports these requests' blocks written; returns the released waiters."""
        return self._forget([r for r in request_ids if r in self._writers])

    def engine_lost(self, decode_engine_id: int) -> list[W]:
        """The DE died: its writes will never be confirmed; returns the released waiters."""
        lost = [r for r, w in self._writers.items() if w.decode_engine_id == decode_engine_id]
        return self._forget(lost)

    def expire(self, now_s: float) -> list[W]:
        """Forget writers unconfirmed for ``wait_s``; returns the released waiters."""
        expired = []
        for request_id, writer in self._writers.items():  # oldest first
            if now_s - writer.since_s < self.wait_s:
                break
            expired.append(request_id)
        self.num_expired += len(expired)
        return self._forget(expired)

    def _forget(self, request_ids: list[int]) -> list[W]:
        released: list[W] = []
        for request_id in request_ids:
            writer = self._writers.pop(request_id)
            released += writer.waiters
            for key in writer.keys:
                if self._key_to_writer.get(key) == request_id:
                    del self._key_to_writer[key]
        return released

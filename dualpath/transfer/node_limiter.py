"""One storage-NIC cap per node, shared by all engine processes on that node (SPEC §1, §4).

A node has one SNIC for all its engines, so emulating it takes one limiter per node, not one
per engine process. The engines are separate OS processes, perhaps started independently
(``dualpath engine ... --node 3``), so the limiter's state is a 24-byte file (by default under
``/dev/shm``) updated under ``fcntl.flock``::

    offset 0  next_free_s      f64   when the link is free again, in CLOCK_MONOTONIC seconds
           8  rate_bytes_per_s f64   the cap; every user must agree on it
          16  num_users        i64   open NodeLimiter objects; the last to close removes the file

A movement of B bytes atomically reserves ``[max(now, next_free), +B/rate]``, performs the real
I/O, then sleeps until its interval ends (minus what the I/O already took), so the node's
storage traffic never exceeds the cap. (A link that went free less than ``gap_fill_s`` ago is
booked from ``next_free``: that gap is a caller's overhead, e.g. a sleep's overshoot.)

Storage traffic is all in the KV class (SPEC §4), so the limiter knows only the cap: first
come, first served, no traffic classes. An uncapped limiter (``bandwidth_gbps == 0``) has no
file, takes no lock and never sleeps.

Lifetime: the file lives while any user has it open. A process that dies without ``close``
leaves its count behind, so the file stays until the host reboots (``/dev/shm``) or someone
deletes it; that is harmless, because a ``next_free_s`` in the past is ignored. Clusters that
share a host must use distinct directories (node ids repeat across clusters).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from dualpath.errors import StorageTimeout
from dualpath.transfer.clock import Clock, MonotonicClock
from dualpath.units import gbps_to_bytes_per_s

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_LIMITER_DIR = Path("/dev/shm")
_RECORD = struct.Struct("<ddq")  # see the layout in the module docstring
# How often a process waiting for the file lock retries; the lock is held for microseconds.
_LOCK_RETRY_S = 0.000_2


class NodeLimiter:
    """The SNIC cap of one node, shared through a lock file by every process that opens it.

    Thread-safe; one object per engine process is enough. Times are the clock's seconds:
    across processes that must be ``MonotonicClock`` (one system-wide clock on Linux); a
    ``VirtualClock`` is for single-process tests.
    """

    def __init__(
        self,
        path: Path,
        bandwidth_gbps: float,
        *,
        clock: Clock | None = None,
        lock_timeout_s: float = 5.0,  # for joining and leaving; reserve() takes its own
        # The longest idle gap the link treats as a caller's overhead between back-to-back
        # movements (as TrafficManager's gap_fill_s): a booking may start at the gap's start.
        gap_fill_s: float = 0.001,
    ) -> None:
        if not bandwidth_gbps >= 0:
            raise ValueError(f"bandwidth_gbps must be >= 0 (0 = no cap), got {bandwidth_gbps}")
        if not gap_fill_s >= 0:
            raise ValueError(f"gap_fill_s must be >= 0, got {gap_fill_s}")
        self.path = path
        self.bandwidth_gbps = bandwidth_gbps
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self._rate_bytes_per_s = gbps_to_bytes_per_s(bandwidth_gbps)
        self._lock_timeout_s = lock_timeout_s
        self._gap_fill_s = gap_fill_s
        self._thread_lock = threading.Lock()  # flock does not exclude threads sharing one fd
        self._fd: int | None = self._join() if self.is_capped else None

    @classmethod
    def for_node(
        cls,
        node_id: int,
        bandwidth_gbps: float,
        *,
        directory: Path = DEFAULT_LIMITER_DIR,
        clock: Clock | None = None,
        gap_fill_s: float = 0.001,
        cluster_id: str = "",
    ) -> NodeLimiter:
        """The limiter of node ``node_id``: ``directory/dualpath-[<cluster_id>-]node<id>.snic``.

        ``cluster_id`` keeps two clusters on one host (or a crashed run's leftover file) from
        sharing a node's limiter."""
        prefix = f"dualpath-{cluster_id}-" if cluster_id else "dualpath-"
        path = directory / f"{prefix}node{node_id}.snic"
        return cls(path, bandwidth_gbps, clock=clock, gap_fill_s=gap_fill_s)

    @property
    def is_capped(self) -> bool:
        return self.bandwidth_gbps > 0

    def reserve(self, num_bytes: int, *, timeout_s: float) -> tuple[float, float]:
        """Book the link for ``num_bytes``; return the interval ``(start_s, end_s)``.

        The caller's movement counts as finished at ``end_s``. Raises ``StorageTimeout``, with
        nothing booked, when the interval would end more than ``timeout_s`` from now or the
        file lock is not free within ``timeout_s``. Uncapped: ``(now, now)``, no file access.
        """
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        if not self.is_capped:
            now_s = self.clock.now_s()
            return now_s, now_s
        with self._thread_lock, self._file_locked(timeout_s):
            now_s = self.clock.now_s()
            next_free_s, rate_bytes_per_s, num_users = self._read()
            # A booking starts when the link is free; one that went free less than gap_fill_s
            # ago is treated as busy through the gap (never booked twice either way).
            start_s = next_free_s if next_free_s >= now_s - self._gap_fill_s else now_s
            end_s = start_s + num_bytes / rate_bytes_per_s
            if end_s - now_s > timeout_s:
                raise StorageTimeout(
                    f"SNIC limiter {self.path}: {num_bytes} bytes would finish in "
                    f"{end_s - now_s:.3f} s, past the {timeout_s:.3f} s timeout"
                )
            self._write(end_s, rate_bytes_per_s, num_users)
        return start_s, end_s

    def move(self, num_bytes: int, do_move: Callable[[], T], *, timeout_s: float) -> T:
        """Reserve, run the real movement ``do_move``, then sleep out the rest of the interval."""
        _, end_s = self.reserve(num_bytes, timeout_s=timeout_s)
        result = do_move()
        remaining_s = end_s - self.clock.now_s()
        if remaining_s > 0:
            self.clock.sleep(remaining_s)
        return result

    def close(self) -> None:
        """Leave the limiter; the last user removes the file. Safe to call twice."""
        with self._thread_lock:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            try:
                with self._file_locked(self._lock_timeout_s, fd=fd):
                    next_free_s, rate_bytes_per_s, num_users = self._read(fd)
                    if num_users <= 1 and self._is_current_file(fd):
                        os.unlink(self.path)  # under the lock: a joiner re-checks the inode
                    else:
                        self._write(next_free_s, rate_bytes_per_s, num_users - 1, fd)
            except StorageTimeout:
                logger.warning("SNIC limiter %s: lock busy at close; leaving the file", self.path)
            finally:
                os.close(fd)

    def __enter__(self) -> NodeLimiter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _join(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                with self._file_locked(self._lock_timeout_s, fd=fd):
                    if self._is_current_file(fd):
                        self._add_user(fd)
                        return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the last user unlinked the file between our open and our lock

    def _add_user(self, fd: int) -> None:
        if os.fstat(fd).st_size < _RECORD.size:  # we created it
            self._write(0.0, self._rate_bytes_per_s, 0, fd)
        next_free_s, rate_bytes_per_s, num_users = self._read(fd)
        if rate_bytes_per_s != self._rate_bytes_per_s:
            raise ValueError(
                f"SNIC limiter {self.path} has a cap of {rate_bytes_per_s:.6g} bytes/s; this "
                f"process asked for {self._rate_bytes_per_s:.6g} ({self.bandwidth_gbps} Gbps): "
                f"every engine on a node must agree"
            )
        self._write(next_free_s, rate_bytes_per_s, num_users + 1, fd)

    @contextlib.contextmanager
    def _file_locked(self, timeout_s: float, *, fd: int | None = None) -> Iterator[None]:
        fd = self._fd if fd is None else fd
        assert fd is not None, "the limiter is closed"
        deadline_s = self.clock.now_s() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if self.clock.now_s() >= deadline_s:
                    raise StorageTimeout(
                        f"SNIC limiter {self.path}: lock not free within {timeout_s:.3f} s"
                    ) from None
                self.clock.sleep(_LOCK_RETRY_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _is_current_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _read(self, fd: int | None = None) -> tuple[float, float, int]:
        data = os.pread(self._fd if fd is None else fd, _RECORD.size, 0)
        next_free_s, rate_bytes_per_s, num_users = _RECORD.unpack(data)
        return next_free_s, rate_bytes_per_s, num_users

    def _write(
        self, next_free_s: float, rate_bytes_per_s: float, num_users: int, fd: int | None = None
    ) -> None:
        os.pwrite(
            self._fd if fd is None else fd,
            _RECORD.pack(next_free_s, rate_bytes_per_s, num_users),
            0,
        )

"""Injected time for the traffic manager and the node limiter (STYLE.md principle 7).

Everything in ``dualpath.transfer`` that waits or paces reads time only through a ``Clock``.
The engine passes a ``MonotonicClock``; unit tests pass a ``VirtualClock``, whose time moves
only when the test advances it or when code asks to sleep, so pacing tests run instantly and
give the same numbers on every machine.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    """Seconds as a float and a way to wait for them."""

    def now_s(self) -> float:
        """The current time in seconds; never decreases."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (>= 0) of this clock's time."""
        ...


@dataclass(frozen=True, slots=True)
class MonotonicClock:
    """Real time: ``time.monotonic`` and ``time.sleep``.

    On Linux ``time.monotonic`` is ``CLOCK_MONOTONIC``, one clock for every process on the host,
    so the node limiter can store these times in a file that several processes share. All
    instances are equal (the node limiter and the traffic manager check they share a clock).
    """

    def now_s(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot sleep a negative time, got {seconds} s")
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """Deterministic test time: it moves only through ``advance`` or ``sleep``.

    ``sleep(d)`` returns at once with the time moved forward by ``d``, so a caller that paces a
    transfer sees exactly the emulated duration. Meant for single-threaded drivers: the
    components under test offer non-blocking calls (``TrafficManager.start``/``poll``) so a
    test can keep several transfers in flight from one thread. The clock is safe to call from
    several threads (a lock keeps ``now_s`` monotone), but it has no notion of concurrent
    sleepers: two threads that each sleep 1 s move the time by 2 s, not 1 s. Tests that need
    real concurrency use ``MonotonicClock`` and assert on counts, not durations.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s
        self._lock = threading.Lock()
        self.num_sleeps = 0  # sleep() calls, for tests that check a path never waits
        self.slept_s = 0.0  # total time requested through sleep()

    def now_s(self) -> float:
        with self._lock:
            return self._now_s

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot sleep a negative time, got {seconds} s")
        with self._lock:
            self._now_s += seconds
            self.num_sleeps += 1
            self.slept_s += seconds

    def advance(self, seconds: float) -> None:
        """Move the time forward as the outside world would (not counted as a sleep)."""
        if seconds < 0:
            raise ValueError(f"cannot move time backwards, got {seconds} s")
        with self._lock:
            self._now_s += seconds

    def advance_to(self, time_s: float) -> None:
        """Set the time to ``time_s`` (not before now); exact, unlike repeated ``advance``."""
        with self._lock:
            if time_s < self._now_s:
                raise ValueError(f"cannot move time backwards from {self._now_s} to {time_s} s")
            self._now_s = time_s

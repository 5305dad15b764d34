"""The event queue of the cluster simulator: one heap keyed by ``(time_s, priority, seq_no)``.

Tie rule (pinned by ``tests/sim/test_events.py``): events at the same ``time_s`` run in
``EventPriority`` order, lower first; events of equal time and priority run in the order they
were pushed (``seq_no`` is a counter owned by the queue, never by a class). A handler that
schedules a zero-delay event enqueues it; nothing runs inline, so handlers never re-enter each
other (splitwise's bug). There is no global simulator: every component gets the queue it
pushes to.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from heapq import heappop, heappush
from typing import Any


class EventPriority(IntEnum):
    """Lower runs first at equal ``time_s``."""

    TRANSFER_DONE = 0  # release link bandwidth and buffer space before anyone asks for them
    STEP_DONE = 1  # a prefill step or a decode segment ends: engines free memory and tokens
    ARRIVAL = 2  # a new turn is submitted once the state at this instant is settled
    FETCH = 3  # group leaders fetch last, when the snapshot at this instant is final


class EventQueue:
    """A min-heap of pending events; ``run`` pops and calls them in order.

    ``push`` returns nothing: cancelling is done by the owner (a version number it checks),
    which keeps the heap free of deletions.
    """

    __slots__ = ("_heap", "_seq_no", "now_s", "num_events")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Callable[[Any], None], Any]] = []
        self._seq_no = 0
        self.now_s = 0.0
        self.num_events = 0  # events popped and run (stale ones included)

    def push(
        self, time_s: float, priority: EventPriority, handler: Callable[[Any], None], arg: Any
    ) -> None:
        """Schedule ``handler(arg)`` at ``time_s`` (>= now; ``RuntimeError`` otherwise, a
        caller bug: the simulator never schedules into the past)."""
        if time_s < self.now_s:
            raise RuntimeError(f"caller bug: event at {time_s} s is before now ({self.now_s} s)")
        seq_no = self._seq_no + 1
        self._seq_no = seq_no
        heappush(self._heap, (time_s, priority, seq_no, handler, arg))

    def reserve_seq_no(self) -> int:
        """The ``seq_no`` of an event scheduled now but pushed later (``push_reserved``): a
        caller that keeps a run of events of one time and priority outside the heap, and
        pushes only the first, keeps the order they would have had as separate pushes."""
        seq_no = self._seq_no + 1
        self._seq_no = seq_no
        return seq_no

    def push_reserved(
        self,
        time_s: float,
        priority: EventPriority,
        seq_no: int,
        handler: Callable[[Any], None],
        arg: Any,
    ) -> None:
        """``push`` with a ``seq_no`` from ``reserve_seq_no`` (each used once)."""
        if time_s < self.now_s:
            raise RuntimeError(f"caller bug: event at {time_s} s is before now ({self.now_s} s)")
        heappush(self._heap, (time_s, priority, seq_no, handler, arg))

    def is_next(self, time_s: float, priority: EventPriority, seq_no: int) -> bool:
        """Whether an event with this key would run next: no pending event comes before it.
        A handler may then run that event's work at once (and count it in ``num_events``)
        instead of pushing it: the order is the same."""
        heap = self._heap
        return not heap or heap[0] > (time_s, priority, seq_no)

    def __len__(self) -> int:
        return len(self._heap)

    def next_time_s(self) -> float:
        """When the next pending event runs (``inf`` when none is pending)."""
        heap = self._heap
        return heap[0][0] if heap else float("inf")

    def run(self, until_s: float = float("inf")) -> None:
        """Run events in order until the heap is empty or the next one is after ``until_s``."""
        heap = self._heap
        pop = heappop
        num_events = 0
        while heap and heap[0][0] <= until_s:
            time_s, _, _, handler, arg = pop(heap)
            self.now_s = time_s
            handler(arg)
            num_events += 1
        self.num_events += num_events

"""Links as shared bandwidth: byte-sized flows, fair share within a class, 99:1 between classes.

A ``SimLink`` is one direction of one NIC (or a storage service) with a capacity in bytes/s.
Every flow on it belongs to a traffic class (SPEC §4: ``INFERENCE`` above ``KV``). At any
instant the link is work-conserving and shares its capacity

* between classes by weight (99 : 1 by default) when both have flows, all to one class when
  only it has flows: the high class gets ~99% and the low class is never starved;
* within a class equally among its flows (processor sharing = max-min fair share on a single
  link).

Implementation: per class a virtual clock ``V`` that grows at the per-flow rate of that class;
a flow of ``size_bytes`` started when the clock reads ``V0`` ends when it reads ``V0 + size``.
Each class keeps a heap of those finish tags, so a start or a finish costs O(log n) and the
link keeps one live completion event (no later than the next completion; superseded ones
carry a stale version and are ignored). A flow occupies one link: the simulator charges each transfer to the link where its
bytes converge (see ``docs/simulator.md``), which keeps max-min exact and the loop cheap.

An uncapped link (``capacity_bytes_per_s = inf``) completes every flow after zero delay (as an
event, never inline) and still counts its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import IntEnum
from heapq import heappop, heappush
from typing import Any, Final

from dualpath.sim.events import EventPriority, EventQueue

_EPSILON_BYTES: Final = 1e-3  # finish tags within this of the clock are due (float rounding)
_TOLERANCE_S: Final = 1e-9  # ... or within this many seconds at the flow's rate
_INF: Final = math.inf
# An Enum member looked up on its class costs ~0.2 us; a module constant a few ns (Final: the
# compiled build keeps it in a C static instead of looking it up in the module's dict).
_TRANSFER_DONE: Final = EventPriority.TRANSFER_DONE

# NOTE(compiled): in the per-event methods below, ``x / float(len(heap))`` and
# ``a[i] = a[i] + x`` are ``x / len(heap)`` and ``a[i] += x`` (the same floats: a list's
# length converts to a float exactly) in the form mypyc compiles to C arithmetic; it
# compiles a float divided by an int, and ``+=`` on a list item, as generic Python calls.

# A flow in its class's heap: (finish tag, seq_no, size_bytes, on_done, token). Typed, so the
# compiled build (mypyc) compares and unpacks the tags natively.
_Flow = tuple[float, int, float, Callable[[Any], None], Any]


class TrafficClass(IntEnum):
    """SPEC §4: model-inference collectives above KV movement."""

    INFERENCE = 0
    KV = 1


class SimLink:
    """One link: capacity, two classes, flows with completion callbacks."""

    __slots__ = (
        "name",
        "capacity_bytes_per_s",
        "_queue",
        "_weights",
        "_shared_rates",
        "_shared_total",
        "_clocks",
        "_heaps",
        "_last_s",
        "_version",
        "_pending_s",
        "_seq_no",
        "started_bytes",
        "finished_bytes",
        "window_s",
        "window_bytes",
    )

    def __init__(
        self,
        name: str,
        capacity_bytes_per_s: float,
        queue: EventQueue,
        *,
        inference_weight: int = 99,
        kv_weight: int = 1,
        window_s: float | None = None,
    ) -> None:
        if not capacity_bytes_per_s > 0:
            raise ValueError(f"link {name}: capacity must be > 0 B/s, got {capacity_bytes_per_s}")
        if inference_weight <= 0 or kv_weight <= 0:
            raise ValueError(f"link {name}: class weights must be > 0")
        self.name = name
        self._queue = queue
        self._weights = (float(inference_weight), float(kv_weight))
        self._set_rates(capacity_bytes_per_s)
        self._clocks = [0.0, 0.0]  # per-class virtual clock: bytes served to each flow
        self._heaps: tuple[list[_Flow], list[_Flow]] = ([], [])
        self._last_s = 0.0
        self._version = 0
        self._pending_s = math.inf  # time of the live completion event; inf = none
        self._seq_no = 0
        self.started_bytes = [0.0, 0.0]  # per class, bytes of flows started
        self.finished_bytes = [0.0, 0.0]  # per class, bytes of flows finished
        # Bytes carried per window of ``window_s`` (SNIC balance, SPEC §7); None = not kept.
        self.window_s = window_s
        self.window_bytes: list[float] = []

    @property
    def num_flows(self) -> int:
        return len(self._heaps[0]) + len(self._heaps[1])

    def class_rates_bytes_per_s(self) -> tuple[float, float]:
        """Each class's share of the capacity now (0 for a class without flows)."""
        n0, n1 = len(self._heaps[0]), len(self._heaps[1])
        if n0 and n1:
            return self._shared_rates
        if n0:
            return (self.capacity_bytes_per_s, 0.0)
        if n1:
            return (0.0, self.capacity_bytes_per_s)
        return (0.0, 0.0)

    def start(
        self,
        size_bytes: float,
        traffic_class: TrafficClass,
        on_done: Callable[[Any], None],
        token: Any,
    ) -> None:
        """Start a flow now; ``on_done(token)`` runs as a TRANSFER_DONE event when it ends."""
        if size_bytes < 0:
            raise ValueError(f"link {self.name}: flow size must be >= 0, got {size_bytes}")
        queue = self._queue
        now_s = queue.now_s
        self.started_bytes[traffic_class] += size_bytes
        if size_bytes == 0 or self.capacity_bytes_per_s == _INF:
            self.finished_bytes[traffic_class] += size_bytes
            self._count_window_bytes(now_s, now_s, size_bytes)
            queue.push(now_s, _TRANSFER_DONE, on_done, token)
            return
        if now_s != self._last_s:
            self._advance(now_s)
        seq_no = self._seq_no + 1
        self._seq_no = seq_no
        heappush(
            self._heaps[traffic_class],
            (self._clocks[traffic_class] + size_bytes, seq_no, size_bytes, on_done, token),
        )
        self._reschedule(now_s)

    def set_capacity(self, capacity_bytes_per_s: float) -> None:
        """Change the capacity from now on (a shared upstream, e.g. the store's service rate,
        giving this link a different share): bytes served so far stay served, every flow's
        remaining bytes go at the new rates."""
        if not 0 < capacity_bytes_per_s < _INF or self.capacity_bytes_per_s == _INF:
            raise ValueError(
                f"link {self.name}: capacity can change between finite values only, "
                f"{self.capacity_bytes_per_s} -> {capacity_bytes_per_s}"
            )
        now_s = self._queue.now_s
        if now_s != self._last_s:
            self._advance(now_s)
        self._set_rates(capacity_bytes_per_s)
        # Completions may now come earlier: drop the pending event and schedule afresh.
        self._version += 1
        self._pending_s = _INF
        self._reschedule(now_s)

    def _set_rates(self, capacity_bytes_per_s: float) -> None:
        self.capacity_bytes_per_s = capacity_bytes_per_s
        w0, w1 = self._weights
        # Each class's rate while both have flows, and their sum (computed once per capacity:
        # the hot paths below use these instead of calling class_rates_bytes_per_s).
        self._shared_rates = (
            capacity_bytes_per_s * w0 / (w0 + w1),
            capacity_bytes_per_s * w1 / (w0 + w1),
        )
        self._shared_total = self._shared_rates[0] + self._shared_rates[1]

    def _advance(self, now_s: float) -> None:
        """Move the class clocks (and window byte counts) from the last change to now."""
        elapsed_s = now_s - self._last_s
        if elapsed_s > 0:
            heap0, heap1 = self._heaps
            if heap0 and heap1:
                rate0, rate1 = self._shared_rates
                clocks = self._clocks
                clocks[0] = clocks[0] + elapsed_s * rate0 / float(len(heap0))
                clocks[1] = clocks[1] + elapsed_s * rate1 / float(len(heap1))
                total_rate = self._shared_total
            elif heap0 or heap1:
                total_rate = self.capacity_bytes_per_s
                traffic_class = 0 if heap0 else 1
                clocks = self._clocks
                clocks[traffic_class] = clocks[traffic_class] + elapsed_s * total_rate / float(
                    len(self._heaps[traffic_class])
                )
            else:
                total_rate = 0.0
            window_s = self.window_s
            if total_rate and window_s is not None:
                # _count_window_bytes's common case inline (the same arithmetic, one call
                # less per SNIC change): both ends in one window already counted.
                index = int(now_s / window_s)
                windows = self.window_bytes
                if index == int(self._last_s / window_s) and index < len(windows):
                    windows[index] = windows[index] + elapsed_s * total_rate
                else:
                    self._count_window_bytes(self._last_s, now_s, elapsed_s * total_rate)
        self._last_s = now_s

    def count_unpaced(
        self, size_bytes: float, traffic_class: TrafficClass, since_s: float | None = None
    ) -> None:
        """Account bytes that move outside the fluid model (they take no bandwidth here): the
        simulator uses it for persistence writes, ~3% of an SNIC's reads. The bytes are
        spread evenly over [``since_s``, now] in the windows (all now when None)."""
        now_s = self._queue.now_s
        start_s = now_s if since_s is None else since_s
        if start_s > now_s:
            raise ValueError(f"link {self.name}: since_s {since_s} is after now ({now_s})")
        self.started_bytes[traffic_class] += size_bytes
        self.finished_bytes[traffic_class] += size_bytes
        self._count_window_bytes(start_s, now_s, size_bytes)

    def _count_window_bytes(self, start_s: float, end_s: float, num_bytes: float) -> None:
        """Spread ``num_bytes`` carried uniformly over [start_s, end_s] into 1 s windows."""
        window_s = self.window_s
        if window_s is None or num_bytes <= 0:
            return
        first = int(start_s / window_s)
        last = int(end_s / window_s)
        windows = self.window_bytes
        if len(windows) <= last:
            windows.extend([0.0] * (last + 1 - len(windows)))
        if first == last:
            windows[first] += num_bytes
            return
        rate = num_bytes / (end_s - start_s)
        windows[first] += rate * ((first + 1) * window_s - start_s)
        if last - first > 1:
            # Each whole window in between gets rate * window_s added, as a loop of
            # ``windows[i] += rate * window_s`` would (the same float additions, faster).
            full_window_bytes = rate * window_s
            windows[first + 1 : last] = [b + full_window_bytes for b in windows[first + 1 : last]]
        windows[last] += rate * (end_s - last * window_s)

    def _reschedule(self, now_s: float) -> None:
        """Make sure an event fires no later than the next completion. A pending event that
        fires earlier is kept (it re-checks and reschedules when it fires): adding a flow only
        delays completions, so most starts push nothing."""
        heap0, heap1 = self._heaps
        if heap0 and heap1:
            rate0, rate1 = self._shared_rates
        else:
            rate0 = rate1 = self.capacity_bytes_per_s  # only the class with flows reads it
        # ``x if x > 0.0 else 0.0`` is max(0.0, x) (the same float in every case) without
        # the builtin's call.
        next_s = _INF
        if heap0:
            left = heap0[0][0] - self._clocks[0]
            next_s = now_s + (left if left > 0.0 else 0.0) / (rate0 / float(len(heap0)))
        if heap1:
            left = heap1[0][0] - self._clocks[1]
            due_s = now_s + (left if left > 0.0 else 0.0) / (rate1 / float(len(heap1)))
            if due_s < next_s:
                next_s = due_s
        if next_s < self._pending_s:
            version = self._version + 1
            self._version = version
            self._pending_s = next_s
            self._queue.push(next_s, _TRANSFER_DONE, self._on_due, version)

    def _on_due(self, version: int) -> None:
        if version != self._version:
            return  # superseded by an earlier event
        self._pending_s = _INF
        now_s = self._queue.now_s
        if now_s != self._last_s:
            self._advance(now_s)
        heaps = self._heaps
        if heaps[0] and heaps[1]:
            rate0, rate1 = self._shared_rates
        else:
            rate0 = rate1 = self.capacity_bytes_per_s  # see _reschedule
        clocks = self._clocks
        finished_bytes = self.finished_bytes
        done: list[_Flow] = []
        for traffic_class in range(2):
            heap = heaps[traffic_class]
            if not heap:
                continue
            # Due: ends within a nanosecond (covers float rounding of the event time).
            rate = rate0 if traffic_class == 0 else rate1
            slack = rate / float(len(heap)) * _TOLERANCE_S
            limit = clocks[traffic_class] + (slack if slack > _EPSILON_BYTES else _EPSILON_BYTES)
            while heap and heap[0][0] <= limit:
                flow = heappop(heap)
                finished_bytes[traffic_class] = finished_bytes[traffic_class] + flow[2]
                done.append(flow)
            if not heap:
                clocks[traffic_class] = 0.0  # keep tags small: no float drift
        self._reschedule(now_s)
        for flow in done:
            flow[3](flow[4])  # on_done(token)

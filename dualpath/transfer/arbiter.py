"""The pure policy of one capped link (SPEC §4): who gets how many bytes when.

``WeightedArbiter`` has no clock, no threads and no I/O: given the queued transfers per traffic
class and a time step, it serves them by fluid weighted fair sharing (generalised processor
sharing, the ideal that WFQ and deficit round robin approximate with packets). The backlogged
classes share the rate in proportion to their weights, 99:1 by default, so inference gets 99%
under contention and KV is never starved; a class alone gets the whole cap (work-conserving).
Within a class, transfers go first come, first served. ``traffic.TrafficManager`` runs one per
capped link on a clock; the simulator can run the same arbiter on its links.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dualpath.transfer.links import TrafficClass

# SPEC §4: inference gets about 99% of a contended link, KV uses what is left.
DEFAULT_CLASS_WEIGHTS: Mapping[TrafficClass, int] = MappingProxyType(
    {TrafficClass.INFERENCE: 99, TrafficClass.KV: 1}
)
_CLASSES = tuple(TrafficClass)  # iterating an Enum class is slow on the per-movement path
# A transfer this close (in time at its current rate) to its end counts as finished, so float
# rounding of clock readings can never leave a sliver of bytes that no sleep can move.
_FINISH_TOLERANCE_S = 1e-9


@dataclass(frozen=True, slots=True)
class ServedSegment:
    """``num_bytes`` of one transfer carried evenly over ``duration_s`` from ``offset_s``.

    Offsets are seconds from the start of the ``advance`` call that served them.
    """

    transfer_id: int
    traffic_class: TrafficClass
    offset_s: float
    duration_s: float
    num_bytes: float


@dataclass(frozen=True, slots=True)
class ArbiterStep:
    """What one ``WeightedArbiter.advance`` call served, in time order."""

    segments: tuple[ServedSegment, ...]
    finished_transfer_ids: tuple[int, ...]


class _Queued:
    __slots__ = ("transfer_id", "remaining_bytes")

    def __init__(self, transfer_id: int, remaining_bytes: float) -> None:
        self.transfer_id = transfer_id
        self.remaining_bytes = remaining_bytes


class WeightedArbiter:
    """Weighted fair sharing of one link's rate between traffic classes (SPEC §4).

    Pure and deterministic: the caller tells it how much time passed. While classes C are
    backlogged, class c's head transfer is served at ``rate * w_c / sum(w over C)``; when a
    head finishes, the shares are recomputed. So under contention the 99:1 split holds at every
    instant (not just on average over rounds), and the link never carries more than its rate.
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        weights: Mapping[TrafficClass, int] = DEFAULT_CLASS_WEIGHTS,
    ) -> None:
        if not rate_bytes_per_s > 0:
            raise ValueError(f"rate_bytes_per_s must be > 0, got {rate_bytes_per_s}")
        if set(weights) != set(TrafficClass) or min(weights.values()) <= 0:
            raise ValueError(f"need a weight > 0 for every traffic class, got {dict(weights)}")
        self.rate_bytes_per_s = rate_bytes_per_s
        self._weights = dict(weights)
        self._queues: dict[TrafficClass, deque[_Queued]] = {c: deque() for c in _CLASSES}
        self._transfer_id_to_class: dict[int, TrafficClass] = {}

    def __contains__(self, transfer_id: int) -> bool:
        return transfer_id in self._transfer_id_to_class

    @property
    def is_idle(self) -> bool:
        return not self._transfer_id_to_class

    def queued_bytes(self, traffic_class: TrafficClass) -> float:
        return sum(queued.remaining_bytes for queued in self._queues[traffic_class])

    def enqueue(self, transfer_id: int, traffic_class: TrafficClass, num_bytes: int) -> None:
        if transfer_id in self._transfer_id_to_class:
            raise ValueError(f"transfer {transfer_id} is already queued")
        if num_bytes < 0:
            raise ValueError(f"transfer {transfer_id}: num_bytes must be >= 0, got {num_bytes}")
        self._queues[traffic_class].append(_Queued(transfer_id, float(num_bytes)))
        self._transfer_id_to_class[transfer_id] = traffic_class

    def cancel(self, transfer_id: int) -> float:
        """Drop a queued transfer; return the bytes it had left (already carried ones stay)."""
        traffic_class = self._transfer_id_to_class.pop(transfer_id)
        queue = self._queues[traffic_class]
        queued = next(queued for queued in queue if queued.transfer_id == transfer_id)
        queue.remove(queued)
        return queued.remaining_bytes

    def class_rates(self) -> dict[TrafficClass, float]:
        """Bytes/s each backlogged class gets right now (absent classes are idle)."""
        backlogged = [c for c in _CLASSES if self._queues[c]]
        total_weight = sum(self._weights[c] for c in backlogged)
        return {c: self.rate_bytes_per_s * self._weights[c] / total_weight for c in backlogged}

    def advance(self, duration_s: float) -> ArbiterStep:
        """Serve the queues for ``duration_s`` seconds (0 finishes empty transfers only)."""
        if not duration_s >= 0:
            raise ValueError(f"duration_s must be >= 0, got {duration_s}")
        segments: list[ServedSegment] = []
        finished: list[int] = []
        elapsed_s = 0.0
        while True:
            finished.extend(self._pop_finished_heads())
            rates = self.class_rates()
            if not rates or elapsed_s >= duration_s:
                break
            # Until the first head finishes (or the time is up), every rate is constant.
            step_s = min(
                duration_s - elapsed_s,
                *(self._queues[c][0].remaining_bytes / rate for c, rate in rates.items()),
            )
            for traffic_class, rate in rates.items():
                head = self._queues[traffic_class][0]
                num_bytes = rate * step_s
                if head.remaining_bytes <= rate * (step_s + _FINISH_TOLERANCE_S):
                    num_bytes = head.remaining_bytes
                head.remaining_bytes -= num_bytes
                segments.append(
                    ServedSegment(head.transfer_id, traffic_class, elapsed_s, step_s, num_bytes)
                )
            # Land exactly on duration_s: a step below float resolution must not loop forever.
            is_last = step_s >= duration_s - elapsed_s
            elapsed_s = duration_s if is_last else elapsed_s + step_s
        return ArbiterStep(tuple(segments), tuple(finished))

    def finish_offset_s(self, transfer_id: int) -> float:
        """Seconds until ``transfer_id`` finishes if nothing else arrives.

        A lower bound of the real finish: a later arrival can only take bandwidth away.
        """
        if transfer_id not in self._transfer_id_to_class:
            raise ValueError(f"transfer {transfer_id} is not queued")
        traffic_class = self._transfer_id_to_class[transfer_id]
        if len(self._transfer_id_to_class) == len(self._queues[traffic_class]):
            # Its class is alone on the link (the common case): FIFO at the full rate.
            num_bytes_ahead = 0.0
            for queued in self._queues[traffic_class]:
                num_bytes_ahead += queued.remaining_bytes
                if queued.transfer_id == transfer_id:
                    return num_bytes_ahead / self.rate_bytes_per_s
        projection = WeightedArbiter(self.rate_bytes_per_s, self._weights)
        for traffic_class, queue in self._queues.items():
            for queued in queue:
                projection._queues[traffic_class].append(
                    _Queued(queued.transfer_id, queued.remaining_bytes)
                )
                projection._transfer_id_to_class[queued.transfer_id] = traffic_class
        offset_s = 0.0
        while transfer_id in projection:
            rates = projection.class_rates()
            step_s = min(projection._queues[c][0].remaining_bytes / r for c, r in rates.items())
            projection.advance(step_s)  # finishes at least the head that sets step_s
            offset_s += step_s
        return offset_s

    def _pop_finished_heads(self) -> list[int]:
        finished = []
        for queue in self._queues.values():
            while queue and queue[0].remaining_bytes <= 0:
                finished.append(queue.popleft().transfer_id)
                del self._transfer_id_to_class[finished[-1]]
        return finished

"""The traffic manager: every byte an engine moves goes through it (SPEC §4).

It accounts each movement (storage read/write, host->device, device->host, PE<->DE) to a link
and a traffic class, and on a capped link paces movements so the link never exceeds its cap:
bandwidth emulation, one host standing in for a cluster. Uncapped links only count.

Two layers: the pure policy of one capped link is ``arbiter.WeightedArbiter`` (weighted fair
sharing between traffic classes, no clock, no threads); ``TrafficManager`` here is thread-safe,
one per engine. ``move`` starts the movement on its link's arbiter, runs the real movement (a
callable) at once, then sleeps (injected clock) until the emulated link has carried the bytes,
so the caller sees the capped link's timing. A link of the node's SNIC can instead be paced by
the node-wide ``NodeLimiter`` that all the node's engine processes share.
``start``/``poll``/``wait``/``cancel`` are the non-blocking pieces of ``move``, for event loops
and single-threaded tests on a ``VirtualClock``.
"""

from __future__ import annotations

import itertools
import math
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from dualpath.config import TrafficConfig
from dualpath.errors import StorageTimeout, TransferTimeout
from dualpath.transfer.arbiter import DEFAULT_CLASS_WEIGHTS, WeightedArbiter
from dualpath.transfer.clock import Clock, MonotonicClock
from dualpath.transfer.links import LinkCounter, LinkKind, LinkSpec, LinkStats, TrafficClass
from dualpath.transfer.node_limiter import NodeLimiter

T = TypeVar("T")

# Shortest sleep of a waiter; guarantees progress when a finish is a rounding error away.
_MIN_SLEEP_S = 1e-6
# A capped link idle for at most this long between two movements counts as busy through the
# gap (see _ArbitratedLink.start). time.sleep overshoots by 60-180 us on Linux, and a caller
# moving back to back would otherwise get ~45% of a 1 GB/s cap with 100 KB movements.
DEFAULT_GAP_FILL_S = 0.001


# How KV code charges a movement to a link: (link name, number of bytes, the movement) -> what
# the movement returns. In an engine process it is the engine's KV traffic (accounting and
# pacing, SPEC §4: ``TrafficManager.move`` in the KV class); alone, a plain call.
Mover = Callable[[str, int, Callable[[], object]], object]


def direct_move(link: str, num_bytes: int, do_move: Callable[[], object]) -> object:
    """The ``Mover`` of an engine with no links: the movement, uncounted."""
    return do_move()


# --- the traffic manager --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MoveTicket:
    """One movement on one link, from ``start`` until ``poll``/``wait`` sees it done or
    ``cancel`` drops it. Every ticket must end one of these ways (an open one is tracked)."""

    transfer_id: int
    link_name: str
    traffic_class: TrafficClass
    num_bytes: int
    start_s: float
    deadline_s: float  # start_s + the movement's timeout_s


@dataclass(frozen=True, slots=True)
class TrafficStats:
    """Every link's counters at ``now_s``, in the order the links were given."""

    now_s: float
    links: tuple[LinkStats, ...]

    def link(self, name: str) -> LinkStats:
        for stats in self.links:
            if stats.name == name:
                return stats
        raise KeyError(f"no link named {name!r}")


class TrafficManager:
    """Accounts and paces every byte one engine moves (SPEC §4). Thread-safe.

    Several threads (storage readers, the writer, the transfer thread) may call ``move`` at
    once. Each link has its own lock, held only for bookkeeping, never across the real
    movement or a sleep, so movements on one link never block another link. Every movement
    has a ``timeout_s``: when its emulated finish would come later, it is dropped and the
    call raises ``StorageTimeout`` (SNIC links) or ``TransferTimeout`` (the others).
    """

    @classmethod
    def from_config(
        cls,
        links: Sequence[LinkSpec],
        config: TrafficConfig,
        *,
        clock: Clock,
        node_limiters: Mapping[str, NodeLimiter] | None = None,
    ) -> TrafficManager:
        """A manager with ``config``'s class weights, utilisation window and gap fill."""
        return cls(
            links,
            clock=clock,
            weights=config.class_weights,
            window_s=config.utilisation_window_s,
            gap_fill_s=config.gap_fill_s,
            node_limiters=node_limiters,
        )

    def __init__(
        self,
        links: Sequence[LinkSpec],
        *,
        clock: Clock | None = None,
        weights: Mapping[TrafficClass, int] = DEFAULT_CLASS_WEIGHTS,
        window_s: float = 1.0,
        gap_fill_s: float = DEFAULT_GAP_FILL_S,
        node_limiters: Mapping[str, NodeLimiter] | None = None,
    ) -> None:
        """``window_s`` is the span of the utilisation figure; ``gap_fill_s`` the longest idle
        gap a capped link treats as the caller's overhead (0 = none). ``node_limiters`` maps
        a link's name to the node-wide limiter that paces it instead of a per-process arbiter
        (the node's SNIC); its cap must equal the link's."""
        if not gap_fill_s >= 0:
            raise ValueError(f"gap_fill_s must be >= 0, got {gap_fill_s}")
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        node_limiters = dict(node_limiters or {})
        names = [spec.name for spec in links]
        if len(set(names)) != len(names):
            raise ValueError(f"link names must be unique, got {names}")
        if unknown := sorted(set(node_limiters) - set(names)):
            raise ValueError(f"node limiters for unknown links {unknown}")
        now_s = self.clock.now_s()
        self._links: dict[str, _Link] = {}
        for spec in links:
            counter = LinkCounter(spec, window_s=window_s)
            limiter = node_limiters.get(spec.name)
            if limiter is not None and spec.is_capped:
                if limiter.bandwidth_gbps != spec.bandwidth_gbps or limiter.clock != self.clock:
                    raise ValueError(
                        f"link {spec.name!r} ({spec.bandwidth_gbps} Gbps) and its node limiter "
                        f"({limiter.bandwidth_gbps} Gbps) must share the cap and the clock"
                    )
                self._links[spec.name] = _SharedLink(counter, limiter)
            elif spec.is_capped:
                self._links[spec.name] = _ArbitratedLink(counter, weights, gap_fill_s, now_s)
            else:
                self._links[spec.name] = _UncappedLink(counter)
        self._transfer_ids = itertools.count()
        self._id_lock = threading.Lock()

    def move(
        self,
        link_name: str,
        traffic_class: TrafficClass,
        num_bytes: int,
        do_move: Callable[[], T],
        *,
        timeout_s: float,
    ) -> T:
        """Run ``do_move`` (the real movement of ``num_bytes``) as traffic on ``link_name``.

        Returns what ``do_move`` returns, once the link has carried the bytes: at once on an
        uncapped link, at the emulated finish on a capped one (the real movement's own time
        counts towards it). If ``do_move`` raises, the movement is dropped and not counted.
        """
        ticket = self.start(link_name, traffic_class, num_bytes, timeout_s=timeout_s)
        try:
            result = do_move()
        except BaseException:
            self.cancel(ticket)
            raise
        self.wait(ticket)
        return result

    def start(
        self, link_name: str, traffic_class: TrafficClass, num_bytes: int, *, timeout_s: float
    ) -> MoveTicket:
        """Put a movement on its link now; it shares the link from this instant.

        Raises the link's timeout error (nothing started) when it could not finish within
        ``timeout_s`` even if nothing else arrived.
        """
        link = self._links.get(link_name)
        if link is None:
            raise ValueError(f"no link named {link_name!r}; links: {sorted(self._links)}")
        if not isinstance(num_bytes, numbers.Integral) or num_bytes < 0:
            raise ValueError(f"num_bytes must be an integer >= 0, got {num_bytes!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        with self._id_lock:
            transfer_id = next(self._transfer_ids)
        with link.lock:
            now_s = self.clock.now_s()
            ticket = MoveTicket(
                transfer_id,
                link_name,
                TrafficClass(traffic_class),
                int(num_bytes),
                start_s=now_s,
                deadline_s=now_s + timeout_s,
            )
            link.start(ticket, now_s)
            link.open_ids.add(transfer_id)
        return ticket

    def poll(self, ticket: MoveTicket) -> bool:
        """Whether the link has carried the whole movement (then it is counted and closed)."""
        link = self._open_link(ticket)
        with link.lock:
            now_s = self.clock.now_s()
            if link.remaining_s(ticket, now_s) > 0:
                return False
            link.settle(ticket, now_s)
            return True

    def wait(self, ticket: MoveTicket) -> None:
        """Sleep until the link has carried the movement; raise on its deadline."""
        link = self._open_link(ticket)
        while True:
            with link.lock:
                now_s = self.clock.now_s()
                remaining_s = link.remaining_s(ticket, now_s)
                if remaining_s <= 0:
                    link.settle(ticket, now_s)
                    return
                # Later arrivals only push a finish back, so a projection past the deadline
                # will not come true: give up now instead of sleeping to find out.
                if now_s + remaining_s > ticket.deadline_s:
                    link.drop(ticket, now_s)
                    raise _timeout_error(link.counter.spec, ticket, now_s, remaining_s)
            self.clock.sleep(max(remaining_s, _MIN_SLEEP_S))

    def cancel(self, ticket: MoveTicket) -> None:
        """Drop a movement; bytes already carried stay counted as carried, not as moved."""
        link = self._open_link(ticket)
        with link.lock:
            link.drop(ticket, self.clock.now_s())

    def stats(self) -> TrafficStats:
        """Per-link, per-class bytes and utilisation, with in-flight progress up to now."""
        snapshots = []
        for link in self._links.values():
            with link.lock:
                now_s = self.clock.now_s()
                link.advance(now_s)
                snapshots.append(link.counter.snapshot(now_s))
        return TrafficStats(self.clock.now_s(), tuple(snapshots))

    def _open_link(self, ticket: MoveTicket) -> _Link:
        link = self._links[ticket.link_name]
        with link.lock:
            if ticket.transfer_id not in link.open_ids:
                raise RuntimeError(
                    f"caller bug: transfer {ticket.transfer_id} on {ticket.link_name!r} "
                    f"is already finished or cancelled"
                )
        return link


def _timeout_error(
    spec: LinkSpec, ticket: MoveTicket, now_s: float, remaining_s: float
) -> StorageTimeout | TransferTimeout:
    """The error of a movement that would finish past its deadline: a storage timeout on an
    SNIC (the engine recomputes blocks it cannot read), a transfer timeout elsewhere."""
    message = (
        f"{ticket.num_bytes} bytes of {ticket.traffic_class.name} traffic on link "
        f"{ticket.link_name!r} would finish {now_s + remaining_s - ticket.start_s:.3f} s "
        f"after their start, past the {ticket.deadline_s - ticket.start_s:.3f} s timeout"
    )
    return StorageTimeout(message) if spec.kind == LinkKind.SNIC else TransferTimeout(message)


class _Link:
    """One link's bookkeeping; every method runs under ``lock``."""

    def __init__(self, counter: LinkCounter) -> None:
        self.counter = counter
        self.lock = threading.Lock()
        self.open_ids: set[int] = set()

    def start(self, ticket: MoveTicket, now_s: float) -> None:
        """Begin carrying ``ticket``; may raise the link's timeout error."""

    def advance(self, now_s: float) -> None:
        """Account what the link carried up to ``now_s``."""

    def remaining_s(self, ticket: MoveTicket, now_s: float) -> float:
        """Seconds until ``ticket`` is carried if nothing else arrives; <= 0 when done."""
        raise NotImplementedError

    def settle(self, ticket: MoveTicket, now_s: float) -> None:
        """The movement is done: count it and close it."""
        self.open_ids.remove(ticket.transfer_id)
        self.counter.add_moved(ticket.traffic_class, ticket.num_bytes)

    def drop(self, ticket: MoveTicket, now_s: float) -> None:
        """Close the movement without counting it as moved."""
        self.open_ids.remove(ticket.transfer_id)


class _UncappedLink(_Link):
    """No cap: the movement takes the real transport's time and is only counted."""

    def remaining_s(self, ticket: MoveTicket, now_s: float) -> float:
        return 0.0

    def settle(self, ticket: MoveTicket, now_s: float) -> None:
        super().settle(ticket, now_s)
        self.counter.add_carried(ticket.traffic_class, ticket.num_bytes, ticket.start_s, now_s)


class _ArbitratedLink(_Link):
    """A capped link of this process, shared by the classes through a ``WeightedArbiter``."""

    def __init__(
        self,
        counter: LinkCounter,
        weights: Mapping[TrafficClass, int],
        gap_fill_s: float,
        now_s: float,
    ) -> None:
        super().__init__(counter)
        self._arbiter = WeightedArbiter(counter.spec.bandwidth_bytes_per_s, weights)
        self._gap_fill_s = gap_fill_s
        self._advanced_to_s = now_s
        self._busy_until_s = -math.inf  # end of the last byte carried
        self._finished_ids: set[int] = set()

    def start(self, ticket: MoveTicket, now_s: float) -> None:
        self.advance(now_s)  # serve the queue as it was up to now before this one joins
        if self._arbiter.is_idle and now_s - self._busy_until_s <= self._gap_fill_s:
            # NOTE(transfer): a gap this short is the caller's own overhead between back-to-back
            # movements (a sleep's overshoot, Python), not a lack of demand: serve the new
            # movement from the gap's start. The link is idle then, so it is never booked
            # twice and no window exceeds the cap; a movement ends at most gap_fill_s early.
            self._advanced_to_s = self._busy_until_s
        self._arbiter.enqueue(ticket.transfer_id, ticket.traffic_class, ticket.num_bytes)
        remaining_s = self.remaining_s(ticket, now_s)
        if now_s + remaining_s > ticket.deadline_s:
            self._arbiter.cancel(ticket.transfer_id)
            raise _timeout_error(self.counter.spec, ticket, now_s, remaining_s)

    def advance(self, now_s: float) -> None:
        origin_s = self._advanced_to_s
        step = self._arbiter.advance(max(0.0, now_s - origin_s))
        for segment in step.segments:
            start_s = origin_s + segment.offset_s
            end_s = start_s + segment.duration_s
            self.counter.add_carried(segment.traffic_class, segment.num_bytes, start_s, end_s)
            self._busy_until_s = max(self._busy_until_s, end_s)
        self._finished_ids.update(step.finished_transfer_ids)
        self._advanced_to_s = max(origin_s, now_s)

    def remaining_s(self, ticket: MoveTicket, now_s: float) -> float:
        self.advance(now_s)
        if ticket.transfer_id in self._finished_ids:
            return 0.0
        return self._arbiter.finish_offset_s(ticket.transfer_id)

    def settle(self, ticket: MoveTicket, now_s: float) -> None:
        super().settle(ticket, now_s)
        self._finished_ids.remove(ticket.transfer_id)

    def drop(self, ticket: MoveTicket, now_s: float) -> None:
        super().drop(ticket, now_s)
        self.advance(now_s)
        if ticket.transfer_id in self._arbiter:
            self._arbiter.cancel(ticket.transfer_id)
        self._finished_ids.discard(ticket.transfer_id)


class _SharedLink(_Link):
    """A capped link paced by the node-wide ``NodeLimiter`` (the SNIC; class-blind FIFO)."""

    def __init__(self, counter: LinkCounter, limiter: NodeLimiter) -> None:
        super().__init__(counter)
        self._limiter = limiter
        self._transfer_id_to_interval: dict[int, tuple[float, float]] = {}

    def start(self, ticket: MoveTicket, now_s: float) -> None:
        # Raises StorageTimeout, with nothing booked, if the booking would end too late.
        interval = self._limiter.reserve(ticket.num_bytes, timeout_s=ticket.deadline_s - now_s)
        self._transfer_id_to_interval[ticket.transfer_id] = interval

    def remaining_s(self, ticket: MoveTicket, now_s: float) -> float:
        return self._transfer_id_to_interval[ticket.transfer_id][1] - now_s

    def settle(self, ticket: MoveTicket, now_s: float) -> None:
        super().settle(ticket, now_s)
        start_s, end_s = self._transfer_id_to_interval.pop(ticket.transfer_id)
        self.counter.add_carried(ticket.traffic_class, ticket.num_bytes, start_s, end_s)

    def drop(self, ticket: MoveTicket, now_s: float) -> None:
        # The booked interval stays used on the node's link, like a real transfer that timed
        # out after occupying the wire.
        super().drop(ticket, now_s)
        del self._transfer_id_to_interval[ticket.transfer_id]

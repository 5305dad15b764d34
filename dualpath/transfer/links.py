"""Links, traffic classes and their byte counters (SPEC §4), and the P/D safety check (SPEC §5).

Every byte an engine moves is accounted to a **link** and a **traffic class**:

* links: the node's storage NIC (``SNIC``: storage reads and writes, shared by the node's
  engines), the engine's compute NIC (``CNIC``: PE<->DE transfers and host<->device copies,
  which the paper also routes through the CNIC as RDMA writes) and host memory;
* classes: ``INFERENCE`` (latency-critical) above ``KV`` (bulk KV-cache traffic).

A ``LinkSpec`` with ``bandwidth_gbps == 0`` is uncapped: movements run at the real transport's
speed and are only counted. A cap emulates a cluster's link on one host. ``LinkCounter`` keeps
the per-class totals and a sliding-window rate; ``dualpath.transfer.traffic`` does the pacing.
``TrafficConfig`` holds the caps and class weights, and ``engine_link_specs`` names one
engine's links. ``bottleneck_free_pd_range``/``check_pd_ratio`` implement SPEC §5.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum

from dualpath.config import TrafficConfig
from dualpath.units import gbps_to_bytes_per_s


class TrafficClass(IntEnum):
    """Traffic classes, highest priority first (SPEC §4: weights 99:1 under contention)."""

    # Control messages, per-step token streaming, tensor-parallel collectives.
    INFERENCE = 0
    # KV cache: storage reads/writes, host<->device copies of KV, PE<->DE layer blocks.
    KV = 1


class LinkKind(IntEnum):
    SNIC = 0  # one per node, shared by its engine processes: storage reads and writes
    CNIC = 1  # one per engine: PE<->DE transfers and host<->device copies


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One link an engine moves bytes over. ``bandwidth_gbps`` in 1e9 bit/s; 0 = no cap."""

    name: str  # unique within a traffic manager, e.g. "node3.snic" or "engine12.cnic"
    kind: LinkKind
    bandwidth_gbps: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a link needs a name")
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps >= 0):
            raise ValueError(
                f"link {self.name!r}: bandwidth_gbps must be >= 0 (0 = no cap), "
                f"got {self.bandwidth_gbps}"
            )

    @property
    def is_capped(self) -> bool:
        return self.bandwidth_gbps > 0

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """The cap in bytes/s; 0.0 when uncapped."""
        return gbps_to_bytes_per_s(self.bandwidth_gbps)


@dataclass(frozen=True, slots=True)
class LinkStats:
    """A snapshot of one link's counters; never updated in place.

    *Moved* bytes count finished movements exactly (what benchmarks report). *Carried* bytes
    are what the link has transported so far, including the part of movements still in flight
    on a capped link (which carries bytes at a steady rate); windows and utilisation use them.
    """

    name: str
    kind: LinkKind
    bandwidth_gbps: float
    class_to_num_moves: Mapping[TrafficClass, int]  # finished movements
    class_to_moved_bytes: Mapping[TrafficClass, int]  # bytes of finished movements
    class_to_carried_bytes: Mapping[TrafficClass, float]
    window_s: float  # the span the two figures below average over
    window_bytes_per_s: float  # carried bytes per second over the last window_s
    utilisation: float | None  # window_bytes_per_s / cap; None when uncapped

    @property
    def moved_bytes(self) -> int:
        return sum(self.class_to_moved_bytes.values())

    @property
    def carried_bytes(self) -> float:
        return sum(self.class_to_carried_bytes.values())


class LinkCounter:
    """Per-class byte counters of one link and its carried rate over a sliding window.

    Not thread-safe: the owner (a ``TrafficManager``) calls it under its lock. The window is
    kept as ``num_buckets`` time buckets; bytes carried over an interval are spread over the
    buckets it overlaps, so the rate is exact for a link that carries at a steady rate.
    """

    def __init__(self, spec: LinkSpec, *, window_s: float = 1.0, num_buckets: int = 10) -> None:
        if not window_s > 0 or num_buckets <= 0:
            raise ValueError(
                f"window_s and num_buckets must be > 0, got {window_s} and {num_buckets}"
            )
        self.spec = spec
        self._num_buckets = num_buckets
        self._bucket_s = window_s / num_buckets
        self._class_to_num_moves = dict.fromkeys(TrafficClass, 0)
        self._class_to_moved_bytes = dict.fromkeys(TrafficClass, 0)
        self._class_to_carried_bytes = dict.fromkeys(TrafficClass, 0.0)
        self._bucket_index_to_bytes: dict[int, float] = {}

    def add_moved(self, traffic_class: TrafficClass, num_bytes: int) -> None:
        """A movement of ``num_bytes`` finished."""
        self._class_to_num_moves[traffic_class] += 1
        self._class_to_moved_bytes[traffic_class] += num_bytes

    def add_carried(
        self, traffic_class: TrafficClass, num_bytes: float, start_s: float, end_s: float
    ) -> None:
        """The link carried ``num_bytes`` evenly over ``[start_s, end_s]`` (a point if equal)."""
        self._class_to_carried_bytes[traffic_class] += num_bytes
        last = math.floor(end_s / self._bucket_s)
        if end_s <= start_s:
            self._add_to_bucket(last, num_bytes)
            return
        # Buckets older than the window are never read again: skip them.
        first = max(math.floor(start_s / self._bucket_s), last - self._num_buckets)
        for index in range(first, last + 1):
            overlap_s = min(end_s, (index + 1) * self._bucket_s) - max(
                start_s, index * self._bucket_s
            )
            if overlap_s > 0:
                self._add_to_bucket(index, num_bytes * overlap_s / (end_s - start_s))

    def _add_to_bucket(self, index: int, num_bytes: float) -> None:
        self._bucket_index_to_bytes[index] = self._bucket_index_to_bytes.get(index, 0.0) + num_bytes
        if len(self._bucket_index_to_bytes) > 4 * self._num_buckets:
            oldest_kept = max(self._bucket_index_to_bytes) - self._num_buckets
            for old in [i for i in self._bucket_index_to_bytes if i < oldest_kept]:
                del self._bucket_index_to_bytes[old]

    def snapshot(self, now_s: float) -> LinkStats:
        # The window is the current (partial) bucket and the num_buckets - 1 before it.
        current = math.floor(now_s / self._bucket_s)
        first = current - self._num_buckets + 1
        span_s = now_s - first * self._bucket_s
        window_bytes = sum(
            num_bytes
            for index, num_bytes in self._bucket_index_to_bytes.items()
            if first <= index <= current
        )
        window_bytes_per_s = window_bytes / span_s
        cap_bytes_per_s = self.spec.bandwidth_bytes_per_s
        return LinkStats(
            name=self.spec.name,
            kind=self.spec.kind,
            bandwidth_gbps=self.spec.bandwidth_gbps,
            class_to_num_moves=dict(self._class_to_num_moves),
            class_to_moved_bytes=dict(self._class_to_moved_bytes),
            class_to_carried_bytes=dict(self._class_to_carried_bytes),
            window_s=span_s,
            window_bytes_per_s=window_bytes_per_s,
            utilisation=window_bytes_per_s / cap_bytes_per_s if cap_bytes_per_s else None,
        )


@dataclass(frozen=True, slots=True)
class EngineLinks:
    """The links one engine's traffic manager moves bytes over. Host memory (SPEC §5's M) is
    not one of them: every byte of KV crosses it on its way to or from a NIC, so no movement
    of its own can be charged to it; its bandwidth enters only ``check_pd_ratio``."""

    snic: LinkSpec  # the node's, shared with the node's other engines
    cnic: LinkSpec

    def all(self) -> tuple[LinkSpec, ...]:
        return (self.snic, self.cnic)


def engine_link_specs(config: TrafficConfig, *, node_id: int, engine_id: int) -> EngineLinks:
    """Link specs of engine ``engine_id`` on node ``node_id``, named uniquely cluster-wide."""
    return EngineLinks(
        snic=LinkSpec(f"node{node_id}.snic", LinkKind.SNIC, config.snic_bandwidth_gbps),
        cnic=LinkSpec(f"engine{engine_id}.cnic", LinkKind.CNIC, config.cnic_bandwidth_gbps),
    )


# SPEC §5 (paper §4.2): when the dual path cannot congest any link.


def bottleneck_free_pd_range(
    num_gpus_per_node: int,
    storage_to_cnic_ratio: float,
    host_memory_bytes_per_s: float,
    cnic_bytes_per_s: float,
) -> tuple[float, float]:
    """The range ``(low, high)`` of P/D (prefill nodes / decode nodes) in which no link congests.

    SPEC §5 with g = ``num_gpus_per_node``, s = ``storage_to_cnic_ratio`` (a node's storage
    bandwidth is s·B), M = ``host_memory_bytes_per_s`` per node, B = ``cnic_bytes_per_s``::

        s/(g−s)  ≤  P/D  ≤  min{ (g−2s)/s ,  (g−s)/(2s) ,  (M/(B·s) − 3)/2 }

    Assumes balanced load, saturated storage reads and no compute-network congestion. The range
    is empty (``low > high``) when no ratio is safe.
    """
    g, s = num_gpus_per_node, storage_to_cnic_ratio
    if g <= 0 or not s > 0:
        raise ValueError(f"need num_gpus_per_node > 0 and storage_to_cnic_ratio > 0, got {g}, {s}")
    if not (host_memory_bytes_per_s > 0 and cnic_bytes_per_s > 0):
        raise ValueError(
            f"bandwidths must be > 0, got host memory {host_memory_bytes_per_s} B/s "
            f"and CNIC {cnic_bytes_per_s} B/s"
        )
    if not g > s:
        raise ValueError(f"storage bandwidth s·B must be below the node's g·B, got g={g}, s={s}")
    low = s / (g - s)
    high = min(
        (g - 2 * s) / s,
        (g - s) / (2 * s),
        (host_memory_bytes_per_s / (cnic_bytes_per_s * s) - 3) / 2,
    )
    return low, high


def check_pd_ratio(
    num_prefill_nodes: int,
    num_decode_nodes: int,
    *,
    num_gpus_per_node: int,
    snic_bandwidth_gbps: float,
    cnic_bandwidth_gbps: float,
    host_memory_bandwidth_gbps: float,
) -> list[str]:
    """Warnings when P/D lies outside the bottleneck-free range of SPEC §5; empty when safe.

    Bandwidths are per link as configured (SNIC per node, CNIC per GPU, host memory per node),
    in 1e9 bit/s. The check needs all three: with any of them uncapped (0) the real speeds are
    unknown and it returns no warnings.
    """
    if num_prefill_nodes <= 0 or num_decode_nodes <= 0:
        raise ValueError(
            f"need at least one prefill and one decode node, "
            f"got {num_prefill_nodes}P{num_decode_nodes}D"
        )
    if 0 in (snic_bandwidth_gbps, cnic_bandwidth_gbps, host_memory_bandwidth_gbps):
        return []
    storage_to_cnic_ratio = snic_bandwidth_gbps / cnic_bandwidth_gbps
    if storage_to_cnic_ratio >= num_gpus_per_node:
        return [
            f"SNIC {snic_bandwidth_gbps} Gbps is not below the node's {num_gpus_per_node} CNICs "
            f"of {cnic_bandwidth_gbps} Gbps: SPEC §5's bottleneck-free bounds do not apply"
        ]
    low, high = bottleneck_free_pd_range(
        num_gpus_per_node,
        storage_to_cnic_ratio,
        gbps_to_bytes_per_s(host_memory_bandwidth_gbps),
        gbps_to_bytes_per_s(cnic_bandwidth_gbps),
    )
    ratio = num_prefill_nodes / num_decode_nodes
    setting = (
        f"{num_prefill_nodes}P{num_decode_nodes}D (P/D = {ratio:.3g}; g={num_gpus_per_node}, "
        f"s={storage_to_cnic_ratio:.3g}, SNIC {snic_bandwidth_gbps} Gbps, CNIC "
        f"{cnic_bandwidth_gbps} Gbps, host memory {host_memory_bandwidth_gbps} Gbps)"
    )
    if low > high:
        return [
            f"{setting}: no P/D ratio is bottleneck-free (range {low:.3g}..{high:.3g} is empty)"
        ]
    if not low <= ratio <= high:
        return [
            f"{setting} is outside the bottleneck-free range {low:.3g} <= P/D <= {high:.3g} "
            f"(SPEC §5): a CNIC or host memory may congest under saturated storage reads"
        ]
    return []

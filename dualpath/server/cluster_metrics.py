"""The cluster's series of /metrics (links, queues, engines, the store), read from the
scheduler's latest ``ClusterSnapshot`` when /metrics is scraped, and the link-rate window they
use (``ServerMetrics`` registers the collector)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from dualpath.cluster.coordinator import ClusterSnapshot
from dualpath.kv.store import StoreStats
from dualpath.protocol import (
    DECODE,
    PREFILL,
    TRANSPORT_READ_PREFIX,
    TRANSPORT_WRITTEN_PREFIX,
)
from dualpath.units import gbps_to_bytes_per_s

STORE_READ_KEY = "store_read_bytes"  # EngineReport.link_bytes: hit KV an engine read
# EngineReport.link_bytes: hit KV counted cached that no side read (the engine held it)
ENGINE_CACHED_KEY = "engine_cached_bytes"


class LinkRateTracker:
    """Bytes per second per (link, traffic class) over a sliding window of snapshots."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, dict[tuple[str, str], int]]] = deque()

    def observe(self, time_s: float, totals: dict[tuple[str, str], int]) -> None:
        """Add cumulative totals taken at ``time_s`` (non-decreasing across calls)."""
        if self._samples and time_s <= self._samples[-1][0]:
            return
        self._samples.append((time_s, totals))
        while len(self._samples) > 2 and time_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rates_bytes_per_s(self) -> dict[tuple[str, str], float]:
        if len(self._samples) < 2:
            return {}
        (first_s, first), (last_s, last) = self._samples[0], self._samples[-1]
        span_s = last_s - first_s
        # A counter that went down belongs to a restarted engine: no rate for it this window.
        return {
            key: (total - first.get(key, 0)) / span_s
            for key, total in last.items()
            if total >= first.get(key, 0)
        }


def link_totals(link_bytes: dict[int, dict[str, int]]) -> dict[tuple[str, str], int]:
    """Cumulative bytes by (link, traffic class), summed over engines.

    Link names are unique cluster-wide ("node0.snic" is the node's shared storage NIC,
    "engine3.cnic" one engine's), so engines on one node add up to the node's SNIC.
    """
    totals: dict[tuple[str, str], int] = {}
    for counters in link_bytes.values():
        for key, value in counters.items():
            link, _, traffic_class = key.rpartition(".")
            if not link:  # not "link.class", e.g. store_read_bytes
                continue
            totals[(link, traffic_class)] = totals.get((link, traffic_class), 0) + value
    return totals


class ClusterCollector(Collector):
    """Scheduler-side metrics, read from the latest snapshot at scrape time."""

    def __init__(
        self,
        snapshot: Callable[[], ClusterSnapshot],
        links: LinkRateTracker,
        *,
        engine_id_to_role: dict[int, str],
        link_capacity_bytes_per_s: Callable[[str], float],
        store_stats: Callable[[], StoreStats | None],
    ) -> None:
        self._snapshot = snapshot
        self._links = links
        self._engine_id_to_role = engine_id_to_role
        self._capacity = link_capacity_bytes_per_s
        self._store_stats = store_stats

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        yield _gauge("dualpath_engines_live", "Engines alive.", snapshot.num_live_engines)
        yield _gauge(
            "dualpath_engines_expected", "Engines in the topology.", snapshot.num_expected_engines
        )
        queues = GaugeMetricFamily(
            "dualpath_scheduler_queue_requests",
            "Requests queued in the scheduler: 'prefill' = not placed on a PE yet, 'decode' = "
            "placed on a PE, waiting for a DE.",
            labels=["queue"],
        )
        queues.add_metric(["prefill"], snapshot.num_waiting_prefill)
        queues.add_metric(["decode"], snapshot.num_waiting_decode)
        yield queues
        yield CounterMetricFamily(
            "dualpath_scheduler_assigned_requests",
            "Requests sent to a (PE, DE) pair.",
            value=snapshot.num_assigned,
        )
        yield CounterMetricFamily(
            "dualpath_scheduler_local_prefills",
            "Of the assigned requests, those sent to their decode engine alone, which "
            "prefilled them itself (a short append, --local-prefill-tokens).",
            value=snapshot.num_local_prefills,
        )
        yield CounterMetricFamily(
            "dualpath_scheduler_persist_waits",
            "Requests whose cached prefix stopped at a block a decode engine was still "
            "writing, and that waited for it instead of recomputing it.",
            value=snapshot.num_persist_waits,
        )
        yield CounterMetricFamily(
            "dualpath_scheduler_persist_wait_expired",
            "Finished requests whose store writes were not confirmed within --persist-wait-s "
            "(their waiters were placed with what the store held).",
            value=snapshot.num_persist_expired,
        )
        yield CounterMetricFamily(
            "dualpath_scheduler_replaced_requests",
            "Requests placed again because an engine they needed died (a streaming one goes on "
            "from the tokens already sent).",
            value=snapshot.num_replaced,
        )
        yield CounterMetricFamily(
            "dualpath_scheduler_unavailable_failures",
            "Requests failed because no engine of a role they needed was alive.",
            value=snapshot.num_failed_unavailable,
        )
        yield SummaryMetricFamily(
            "dualpath_scheduler_replacement_first_token_seconds",
            "From an engine's loss to the first token of each request placed again after it.",
            count_value=snapshot.num_replacement_delays,
            sum_value=snapshot.replacement_delay_s_sum,
        )
        stages = SummaryMetricFamily(
            "dualpath_first_token_stage_seconds",
            "Each stage of a request's path to its first token as the scheduler sees it, each "
            "from the end of the last: placement (submit to assignment), decode_ready (to the "
            "DE's buffer slots and its side's reads), prefill (to the PE's first token, its KV "
            "sent to the DE). First placements only.",
            labels=["stage"],
        )
        for stage, (count, sum_s) in snapshot.first_token_stages.items():
            stages.add_metric([stage], count_value=count, sum_value=sum_s)
        yield stages
        yield _gauge(
            "dualpath_scheduler_replacement_first_token_max_seconds",
            "The longest time from an engine's loss to a re-placed request's next token.",
            snapshot.replacement_delay_s_max,
        )
        yield _per_engine_counter(
            "dualpath_engine_restarts",
            "Times an engine this server started was started again after it died.",
            snapshot.engine_restarts,
        )
        yield _per_engine_counter(
            "dualpath_engine_deaths",
            "Times an engine was declared dead: its process exited, it went silent, or it "
            "joined again as a new process before either was noticed.",
            snapshot.engine_deaths,
        )
        busy = GaugeMetricFamily(
            "dualpath_engine_busy_step_seconds",
            "How long each engine has been in one step that outlasts the heartbeat timeout "
            "(its heartbeats say so: busy, not dead); 0 for the others.",
            labels=["engine"],
        )
        for engine_id in sorted(self._engine_id_to_role):
            busy.add_metric([str(engine_id)], snapshot.busy_engines.get(engine_id, 0.0))
        yield busy
        held = GaugeMetricFamily(
            "dualpath_engine_requests",
            "Requests in flight that each engine's loss would place again: a decode engine's "
            "from assignment to their last token, a prefill engine's until prefilled.",
            labels=["engine", "role"],
        )
        for engine_id, role in sorted(self._engine_id_to_role.items()):
            held.add_metric(
                [str(engine_id), role], snapshot.engine_id_to_num_requests.get(engine_id, 0)
            )
        yield held
        yield _gauge(
            "dualpath_sessions_active",
            "Agent sessions (requests naming a session id) seen within --session-retention-s: "
            "those whose decode engine the scheduler remembers.",
            snapshot.num_active_sessions,
        )
        affinity = CounterMetricFamily(
            "dualpath_session_affinity",
            "Placements of session requests by decode engine: 'same_de' = the engine of the "
            "session's last turn, 'moved' = another (that one was full or lost), 'first' = none "
            "remembered (a new or forgotten session).",
            labels=["outcome"],
        )
        for outcome, count in snapshot.session_affinity.items():
            affinity.add_metric([outcome], count)
        yield affinity
        yield CounterMetricFamily(
            "dualpath_scheduler_reports",
            "Load reports received from engines and group leaders (every 10 ms from a busy "
            "engine; an idle one only keeps alive, every 0.25 s).",
            value=snapshot.num_reports,
        )
        yield from self._link_metrics(snapshot)
        yield from self._store_metrics(snapshot)

    def _link_metrics(self, snapshot: ClusterSnapshot) -> Iterator[Metric]:
        totals = link_totals(snapshot.link_bytes)
        self._links.observe(snapshot.time_s, totals)
        moved = CounterMetricFamily(
            "dualpath_link_bytes",
            "Bytes moved per link and traffic class (inference or kv), as engines report.",
            labels=["link", "traffic_class"],
        )
        for (link, traffic_class), value in sorted(totals.items()):
            moved.add_metric([link, traffic_class], value)
        yield moved
        rate = GaugeMetricFamily(
            "dualpath_link_throughput_bytes_per_second",
            f"Bytes per second per link and traffic class over the last {self._links.window_s:g} s.",
            labels=["link", "traffic_class"],
        )
        utilisation = GaugeMetricFamily(
            "dualpath_link_utilisation_ratio",
            "Throughput over the link's bandwidth cap, per traffic class (capped links only).",
            labels=["link", "traffic_class"],
        )
        for (link, traffic_class), bytes_per_s in sorted(self._links.rates_bytes_per_s().items()):
            rate.add_metric([link, traffic_class], bytes_per_s)
            capacity = self._capacity(link)
            if capacity > 0:
                utilisation.add_metric([link, traffic_class], bytes_per_s / capacity)
        yield rate
        yield utilisation

    @staticmethod
    def _transport_metric(snapshot: ClusterSnapshot) -> Metric:
        moved = CounterMetricFamily(
            "dualpath_transport_bytes",
            "KV each engine moved over the transport with each peer engine, by the engine that "
            "started the transfer: 'written' to the peer or 'read' from it (a PE's sends and "
            "DE-side pulls). Both ends' NICs carry these bytes.",
            labels=["engine", "peer", "op"],
        )
        prefixes = {TRANSPORT_WRITTEN_PREFIX: "written", TRANSPORT_READ_PREFIX: "read"}
        for engine_id, counters in sorted(snapshot.link_bytes.items()):
            for key, value in sorted(counters.items()):
                for prefix, op in prefixes.items():
                    if key.startswith(prefix):
                        moved.add_metric([str(engine_id), key.removeprefix(prefix), op], value)
        return moved

    def _store_metrics(self, snapshot: ClusterSnapshot) -> Iterator[Metric]:
        read_path = CounterMetricFamily(
            "dualpath_read_path_bytes",
            "Hit KV read from the store, by the side that read it (the read-path decisions' "
            "outcome: 'prefill' = PE read path, 'decode' = DE read path).",
            labels=["side"],
        )
        by_role = {PREFILL: 0, DECODE: 0}
        for engine_id, counters in snapshot.link_bytes.items():
            role = self._engine_id_to_role.get(engine_id)
            if role in by_role:
                by_role[role] += counters.get(STORE_READ_KEY, 0)
        for role, value in by_role.items():
            read_path.add_metric([role], value)
        yield read_path
        yield CounterMetricFamily(
            "dualpath_engine_cached_bytes",
            "Hit KV counted as cached that neither side read from the store because the "
            "prefill engine still held it in its own prefix cache (vLLM engines; 0 on ours). "
            "With dualpath_read_path_bytes_total it sums to the cached tokens' KV.",
            value=sum(
                counters.get(ENGINE_CACHED_KEY, 0) for counters in snapshot.link_bytes.values()
            ),
        )
        snic_reads = CounterMetricFamily(
            "dualpath_snic_read_bytes",
            "Hit KV read from the store through each node's SNIC (the read-side choices' "
            "share of the SNIC's bytes; the rest are store writes).",
            labels=["link"],
        )
        by_snic: dict[str, int] = {}
        for counters in snapshot.link_bytes.values():
            snic = _snic_of(counters)
            if snic is not None:
                by_snic[snic] = by_snic.get(snic, 0) + counters.get(STORE_READ_KEY, 0)
        for snic, value in sorted(by_snic.items()):
            snic_reads.add_metric([snic], value)
        yield snic_reads
        yield self._transport_metric(snapshot)
        busy = CounterMetricFamily(
            "dualpath_engine_busy_seconds",
            "Time each engine spent in prefill batches (PE) or decode steps (DE).",
            labels=["engine", "role"],
        )
        for engine_id, counters in sorted(snapshot.link_bytes.items()):
            role = self._engine_id_to_role.get(engine_id, "unknown")
            busy.add_metric([str(engine_id), role], counters.get("busy_us", 0) / 1e6)
        yield busy
        occupancy = GaugeMetricFamily(
            "dualpath_kv_buffer_used_ratio",
            "Occupancy of each engine's host KV buffer (PE or DE buffer), at its last report.",
            labels=["engine", "role"],
        )
        for engine_id, counters in sorted(snapshot.link_bytes.items()):
            capacity = counters.get("buffer_capacity_bytes", 0)
            if capacity:
                role = self._engine_id_to_role.get(engine_id, "unknown")
                occupancy.add_metric(
                    [str(engine_id), role], counters.get("buffer_used_bytes", 0) / capacity
                )
        yield occupancy
        engine_totals = {
            name: sum(c.get(f"store_{name}", 0) for c in snapshot.link_bytes.values())
            for name in (
                "evictions",
                "retained_evictions",
                "corrupt_blocks",
                "write_errors",
                "missing_on_read",
            )
        }
        stats = self._store_stats()
        # Hits and misses are the scheduler's lookups: the cluster's hit/miss decisions.
        if stats is not None:
            yield CounterMetricFamily(
                "dualpath_store_hit_blocks",
                "Full Blocks the scheduler's lookups found.",
                value=stats.hit_blocks,
            )
            yield CounterMetricFamily(
                "dualpath_store_miss_blocks",
                "Full Blocks the scheduler's lookups asked for past the first miss.",
                value=stats.miss_blocks,
            )
        # Evictions and damage happen where blocks are read and written: every engine's store,
        # plus the scheduler's own.
        for name, help_text in (
            ("evictions", "Blocks evicted to stay within the store's capacity."),
            (
                "retained_evictions",
                "Of those, blocks of agent sessions evicted within --session-retention-s: "
                "nothing else was left to evict.",
            ),
            ("corrupt_blocks", "Damaged blocks found (and deleted, then recomputed)."),
            ("write_errors", "Block writes that failed (the store kept serving)."),
            ("missing_on_read", "Reads of blocks that were gone (evicted or deleted elsewhere)."),
        ):
            own = 0 if stats is None else getattr(stats, name)
            yield CounterMetricFamily(
                f"dualpath_store_{name}", help_text, value=own + engine_totals[name]
            )


def _per_engine_counter(name: str, help_text: str, counts: dict[int, int]) -> CounterMetricFamily:
    """A counter with one sample per engine id, in id order."""
    family = CounterMetricFamily(name, help_text, labels=["engine"])
    for engine_id, count in sorted(counts.items()):
        family.add_metric([str(engine_id)], count)
    return family


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def link_capacity_lookup(
    snic_bandwidth_gbps: float, cnic_bandwidth_gbps: float
) -> Callable[[str], float]:
    """Bandwidth cap in bytes/s of a link by name ("node0.snic", "engine2.cnic", ...); 0 =
    uncapped. Names as ``dualpath.transfer.links.engine_link_specs`` gives them."""
    by_kind = {
        "snic": gbps_to_bytes_per_s(snic_bandwidth_gbps),
        "cnic": gbps_to_bytes_per_s(cnic_bandwidth_gbps),
    }

    def capacity(link: str) -> float:
        return by_kind.get(link.rpartition(".")[2], 0.0)

    return capacity


def _snic_of(counters: dict[str, int]) -> str | None:
    """The SNIC ("nodeN.snic") an engine's counters account to, or None."""
    for key in counters:
        link, _, traffic_class = key.rpartition(".")
        if traffic_class and link.endswith(".snic"):
            return link
    return None

"""The simulated cluster's description and its engine groups (plain state, no behaviour).

``ClusterModel`` is everything ``Simulator`` needs that is not the workload or a cost model;
``RequestRecord`` is what a finished request leaves for the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

from dualpath.config import SchedulerConfig
from dualpath.scheduler import ClusterTopology, EngineSnapshot, GroupSnapshot
from dualpath.sim.engines import SimDecodeEngine, SimEngine, SimNode, SimPrefillEngine

# The engine type of a group: typed lists let the compiled build (mypyc) read the engines'
# attributes and call their methods natively instead of through generic Python look-ups.
EngineT = TypeVar("EngineT", bound=SimEngine)


@dataclass(frozen=True, slots=True)
class ClusterModel:
    """Everything about the simulated cluster that is not the workload or the cost model."""

    topology: ClusterTopology
    scheduler: SchedulerConfig
    mode: str
    kv_bytes_per_token: int
    all_to_all_bytes_per_token: float  # MoE dispatch + combine over all layers (inference)
    snic_read_bytes_per_s: float  # per node, storage efficiency applied
    snic_write_bytes_per_s: float  # per node
    cnic_bytes_per_s: float  # per engine
    num_decode_kv_blocks: int  # per DE
    prefill_kv_capacity_bytes: float  # per PE: HBM left for KV
    max_inflight_reads_per_node: int = 32  # storage reads in flight per node (I/O depth)
    # The store's aggregate read throughput, shared by the nodes reading (inf = no limit
    # beyond the SNICs; ``engines.StorageService``).
    storage_service_bytes_per_s: float = math.inf
    snic_window_s: float = 1.0  # SPEC §7: SNIC balance over 1 s windows
    # The serving path outside the engines (the ``local`` profile's probes; 0 elsewhere): a
    # turn reaches the scheduler ``turn_latency_s`` after the agent sends it, and a DE starts
    # a request ``handoff_s`` after its prompt KV is complete.
    turn_latency_s: float = 0.0
    handoff_s: float = 0.0
    # The front end admits submitted turns one after another, each taking this long, before
    # ``turn_latency_s``; 0 = all at once. Agents that "start together" (SPEC §7) reach the
    # scheduler as a stream, not in one instant (docs/simulator-analysis.md, "Scale").
    frontend_s_per_request: float = 0.0
    # SPEC §6: leaders fetch every interval "or when idle". True: a group none of whose
    # engines holds a request fetches at once (our runtime's coordinator does, ``local``);
    # False: every fetch waits for the grid (the paper profiles, calibrated that way).
    fetch_when_idle: bool = False
    # True: a node's storage reads and writes share one SNIC cap, as the benchmark's emulated
    # SNIC (one token bucket per node, ``transfer.node_limiter``) does (``local``): the DE's
    # persistence writes are flows on the node's SNIC, slow its reads, and count in the
    # node's write_q, which the read-side choice adds to read_q (``scheduler.cluster_view``).
    # False (the paper profiles): a full-duplex SNIC, on which the writes take no bandwidth
    # (NOTE(sim) in ``Simulator._persist``) and write_q stays 0.
    is_snic_shared: bool = False
    inference_weight: int = 99
    kv_weight: int = 1


@dataclass(frozen=True, slots=True, init=False)
class RequestRecord:
    """One finished request, for metrics (seconds of simulated time)."""

    agent_index: int
    turn_index: int
    submit_s: float
    first_token_s: float
    decode_start_s: float
    finish_s: float
    num_output_tokens: int

    def __init__(
        self,
        agent_index: int,
        turn_index: int,
        submit_s: float,
        first_token_s: float,
        decode_start_s: float,
        finish_s: float,
        num_output_tokens: int,
    ) -> None:
        object.__setattr__(self, "agent_index", agent_index)
        object.__setattr__(self, "turn_index", turn_index)
        object.__setattr__(self, "submit_s", submit_s)
        object.__setattr__(self, "first_token_s", first_token_s)
        object.__setattr__(self, "decode_start_s", decode_start_s)
        object.__setattr__(self, "finish_s", finish_s)
        object.__setattr__(self, "num_output_tokens", num_output_tokens)

    def __reduce__(self) -> tuple:  # see cost.EfficiencyFactors.__reduce__
        times = (self.submit_s, self.first_token_s, self.decode_start_s, self.finish_s)
        return (RequestRecord, (self.agent_index, self.turn_index, *times, self.num_output_tokens))


class EngineGroup(Generic[EngineT]):
    """The engines of one scheduler group (all PEs or all DEs): they fetch together.

    The group owns its engines (``engine.group``, ``engine.position``) and nodes
    (``node.group``) and keeps its last report (``simulator._group_snapshot``): a fetch
    rebuilds only the snapshots of the engines in ``changed_engines`` (``SimEngine.change_load``
    adds an engine there once per report), not all 16 of a full-size group, and reuses the
    whole report when neither an engine nor a node's ``read_q`` changed (``snapshot`` None)."""

    __slots__ = (
        "group_id",
        "engines",
        "nodes",
        "is_fetch_pending",
        "engine_snapshots",
        "changed_engines",
        "snapshot",
        "fetch_phase_s",
        "num_tokens",
    )

    def __init__(self, group_id: int, engines: list[EngineT], nodes: list[SimNode]):
        self.group_id = group_id
        self.engines = engines
        self.nodes = nodes
        self.is_fetch_pending = False
        for position, engine in enumerate(engines):
            engine.group = self
            engine.position = position
        for node in nodes:
            node.group = self
        # Per position, the engine's snapshot as the next report will send it, except for the
        # engines in changed_engines (their load changed since: rebuilt at the next report).
        self.engine_snapshots: list[EngineSnapshot] = [engine.snapshot() for engine in engines]
        self.changed_engines: list[EngineT] = []
        # The last report; None once a node's read_q changed.
        self.snapshot: GroupSnapshot | None = None
        self.fetch_phase_s = 0.0  # its leader fetches at fetch_phase_s + k * fetch_interval_s
        # Σ tok_e over its engines, kept by SimEngine.change_load (what a report would sum).
        self.num_tokens = sum(engine.num_tokens for engine in engines)

    def is_idle(self) -> bool:
        """No engine of the group holds a request."""
        return all(engine.num_seqs == 0 for engine in self.engines)


class PrefillGroup(EngineGroup[SimPrefillEngine]):
    """The PEs of one scheduler group: they also step in lockstep."""

    __slots__ = ("is_busy", "is_full", "num_awaiting_decode")

    def __init__(self, group_id: int, engines: list[SimPrefillEngine], nodes: list[SimNode]):
        super().__init__(group_id, engines, nodes)
        self.is_busy = False
        # Its last fetch placed nothing from a non-empty FIFO (Algorithm 1: every PE over β).
        self.is_full = False
        self.num_awaiting_decode = 0  # requests placed on its PEs, not yet on a DE

    def is_idle(self) -> bool:
        """No PE holds a request and no step runs."""
        return not self.is_busy and super().is_idle()


class DecodeGroup(EngineGroup[SimDecodeEngine]):
    """The DEs of one scheduler group."""

    __slots__ = ()

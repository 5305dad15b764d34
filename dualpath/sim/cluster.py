"""The simulated cluster's description (plain state, no behaviour).

``ClusterModel`` is everything ``Simulator`` needs that is not the workload or a cost model;
``RequestRecord`` is what a finished request leaves for the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dualpath.config import SchedulerConfig
from dualpath.scheduler import ClusterTopology


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

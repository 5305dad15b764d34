"""The scheduler side of the scheduler-over-the-wire bench (``scheduler_wire``): SPEC §7's 64K
workload it submits, the store that holds exactly the hit each request drew (the scheduler
only looks it up), and the scheduler process's Coordinator built on that store."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dualpath.bench.leader_protocol import LeaderCoordinator
from dualpath.bench.paper_cluster import KV_BYTES_PER_TOKEN, SNIC_BANDWIDTH_GBPS
from dualpath.bench.wire_leaders import BLOCK_SIZE_TOKENS, DriverConfig, LeaderPlan
from dualpath.cluster.coordinator import Coordinator
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.control.channel import new_cluster_token
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import KVStore, StoreStats
from dualpath.model.identity import KVIdentity
from dualpath.protocol import DECODE, PREFILL
from dualpath.scheduler import EngineRole, storage_read_tokens_per_s
from dualpath.types import SamplingParams

# SPEC §7, 64K workload: mean context (prompt) per turn, appended and generated tokens per turn.
MEAN_CONTEXT_TOKENS = 32_721
MEAN_APPEND_TOKENS = 429
MEAN_GEN_TOKENS = 176


class DrawnHitStore(KVStore):
    """A store holding exactly the hit the workload drew for the request being submitted.

    ``Coordinator.submit`` looks the prompt up synchronously, so the submitting thread sets
    ``num_hit_blocks`` just before each call. The scheduler only looks up; it never reads or
    writes blocks.
    """

    def __init__(self, layout: KVLayout, fingerprint: str) -> None:
        self.layout = layout
        self.fingerprint = fingerprint
        self.num_hit_blocks = 0
        self._num_lookups = 0

    def lookup(self, keys: Sequence[str]) -> int:
        self._num_lookups += 1
        return min(len(keys), self.num_hit_blocks)

    def contains(self, key: str) -> bool:
        # Nothing is ever written here, so no block lands after a submit's lookup: the
        # scheduler's recheck of the first missing block always finds it absent.
        return False

    def read(self, key: str, out: np.ndarray | None = None) -> np.ndarray:
        raise RuntimeError("caller bug: the wire bench's store only answers lookups")

    def write(self, key: str, full_block: object) -> bool:
        raise RuntimeError("caller bug: the wire bench's store only answers lookups")

    def retain(self, keys: Sequence[str], retention_s: float) -> None:
        raise RuntimeError("caller bug: the wire bench's store only answers lookups")

    def stats(self) -> StoreStats:
        return StoreStats(lookups=self._num_lookups)

    def close(self) -> None:
        pass


class Workload:
    """SPEC §7's 64K workload as (hit blocks, new tokens, output tokens) per request.

    Hits are whole blocks, uniform on [0, 2 x mean]; new tokens uniform on [1, 857] (mean 429);
    output tokens uniform on [1, 351] (mean 176). Token ids are one seeded sequence cut to each
    prompt's length: placement sees only lengths and hits.
    """

    def __init__(self, rng: np.random.Generator, mean_context_tokens: int) -> None:
        self._rng = rng
        mean_hit_tokens = mean_context_tokens - MEAN_APPEND_TOKENS
        self._max_hit_blocks = 2 * mean_hit_tokens // BLOCK_SIZE_TOKENS
        max_context_tokens = self._max_hit_blocks * BLOCK_SIZE_TOKENS + 2 * MEAN_APPEND_TOKENS
        self._token_ids = rng.integers(0, 150_000, max_context_tokens).tolist()
        self.num_submitted = 0
        self.num_prompt_tokens = 0
        self.num_hit_tokens = 0
        self.num_output_tokens = 0

    def next_gap_s(self, requests_per_s: float) -> float:
        return float(self._rng.exponential(1.0 / requests_per_s))

    def submit(self, coordinator: Coordinator, store: DrawnHitStore) -> None:
        num_hit_blocks = int(self._rng.integers(0, self._max_hit_blocks + 1))
        num_new_tokens = int(self._rng.integers(1, 2 * MEAN_APPEND_TOKENS))
        num_output_tokens = int(self._rng.integers(1, 2 * MEAN_GEN_TOKENS))
        num_prompt_tokens = num_hit_blocks * BLOCK_SIZE_TOKENS + num_new_tokens
        store.num_hit_blocks = num_hit_blocks
        coordinator.submit(
            self._token_ids[:num_prompt_tokens], SamplingParams(max_tokens=num_output_tokens)
        )
        self.num_submitted += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_hit_tokens += num_hit_blocks * BLOCK_SIZE_TOKENS
        self.num_output_tokens += num_output_tokens


def make_cluster(
    cluster: ClusterConfig, scheduler_config: SchedulerConfig, link_bytes_interval_s: float
) -> tuple[Coordinator, DrawnHitStore, DriverConfig]:
    """The scheduler process's Coordinator (taking groups through their leaders:
    ``leader_protocol``), its store and what the driver needs to join it."""
    layout = KVLayout(61, BLOCK_SIZE_TOKENS, KV_BYTES_PER_TOKEN // 61)  # DeepSeek-V3.2 (SPEC §7)
    identity = KVIdentity("0" * 32, layout, "float8")
    store = DrawnHitStore(layout, identity.fingerprint)
    read_tokens_per_s = storage_read_tokens_per_s(SNIC_BANDWIDTH_GBPS, KV_BYTES_PER_TOKEN)
    token = new_cluster_token()
    coordinator = LeaderCoordinator(
        cluster,
        scheduler_config,
        identity,
        store,
        token,
        storage_read_tokens_per_s=read_tokens_per_s,
    )
    engine_id_to_node = {e: n.node_id for n in coordinator.topology.nodes for e in n.engine_ids}
    leaders = tuple(
        LeaderPlan(
            group.group_id,
            PREFILL if group.role == EngineRole.PREFILL else DECODE,
            group.engine_ids,
            tuple(engine_id_to_node[e] for e in group.engine_ids),
        )
        for group in coordinator.topology.groups
    )
    driver_config = DriverConfig(
        coordinator.endpoint,
        token,
        leaders,
        scheduler_config.fetch_interval_s,
        link_bytes_interval_s,
        read_tokens_per_s / cluster.engines_per_node,
    )
    return coordinator, store, driver_config

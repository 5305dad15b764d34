"""One engine process's traffic: its links (SPEC §1, §4), their traffic classes and the
node-wide SNIC limiter it shares with its node's other engines.

    traffic, link_names, limiter = make_engine_traffic(config, token)
"""

from __future__ import annotations

import hashlib

from dualpath.config import EngineProcessConfig, TrafficConfig
from dualpath.transfer.clock import MonotonicClock
from dualpath.transfer.links import engine_link_specs
from dualpath.transfer.node_limiter import NodeLimiter
from dualpath.transfer.traffic import TrafficManager


def make_engine_traffic(
    config: EngineProcessConfig, token: str
) -> tuple[TrafficManager, dict[str, str], NodeLimiter | None]:
    """The engine's traffic manager, its short link names ("snic", "cnic") -> link names,
    and the node-wide SNIC limiter shared with the node's other engines (SPEC §1)."""
    cluster = config.cluster
    traffic_config = cluster.traffic
    if cluster.settings.is_io_free:  # oracle: no link costs anything
        traffic_config = TrafficConfig()
    links = engine_link_specs(traffic_config, node_id=config.node_id, engine_id=config.engine_id)
    clock = MonotonicClock()
    node_limiters = {}
    limiter = None
    if links.snic.is_capped:
        # Named after the cluster (a hash of its token, which must not leak into a file name).
        cluster_id = hashlib.sha256(token.encode()).hexdigest()[:12]
        limiter = NodeLimiter.for_node(
            config.node_id, links.snic.bandwidth_gbps, clock=clock, cluster_id=cluster_id
        )
        node_limiters[links.snic.name] = limiter
    traffic = TrafficManager.from_config(
        links.all(), traffic_config, clock=clock, node_limiters=node_limiters
    )
    return traffic, {"snic": links.snic.name, "cnic": links.cnic.name}, limiter

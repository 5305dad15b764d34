"""An engine process is built from its launcher's configs, whole: a changed compute quota
reaches the PE's batcher as it reaches the simulator's."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dualpath.cli import build_parser, engine_process_config
from dualpath.cluster.launcher import LocalCluster
from dualpath.config import (
    ClusterConfig,
    EngineConfig,
    KVStoreConfig,
    SchedulerConfig,
    TrafficConfig,
    config_to_dict,
)
from dualpath.engine.role import prefill_batcher
from dualpath.scheduler.attention_predictor import ConstantAttentionTimePredictor
from dualpath.sim.runner import build_simulator
from tests.sim.test_simulator import small_spec

QUOTA_S = 0.123


def _engine_side(config, monkeypatch):
    """What ``dualpath engine --config -`` builds from what the launcher writes to it."""
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(config_to_dict(config))))
    return engine_process_config(build_parser().parse_args(["engine", "--config", "-"]))


def test_the_launcher_sends_each_engine_its_whole_configs(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = ClusterConfig(
        traffic=TrafficConfig(snic_bandwidth_gbps=3.0, kv_weight=2, gap_fill_s=0.004),
        heartbeat_timeout_s=9.0,
    )
    store = KVStoreConfig(root_dir=tmp_path / "kv", verify_checksums=False, fsync_writes=True)
    engine = EngineConfig(num_threads=2, num_decode_threads=1, max_num_seqs=7, num_io_threads=2)
    scheduler = SchedulerConfig(attention_quota_s=QUOTA_S, prefill_tokens_per_s=1000.0)
    local = LocalCluster(
        cluster,
        model_dir=tiny_model_dir,
        store=store,
        engine=engine,
        scheduler=scheduler,
        spawn_engines=False,  # not started: only what it would send is needed
    )
    try:
        sent = local.engine_process_config("prefill", 0, 0)
        decode = local.engine_process_config("decode", 1, 1)
    finally:
        local.close()
    # A DE runs its own thread count (serve --decode-threads); everything else is the same.
    assert decode.engine == EngineConfig(
        num_threads=1, num_decode_threads=1, max_num_seqs=7, num_io_threads=2
    )
    assert _engine_side(decode, monkeypatch).engine.num_threads == 1
    got = _engine_side(sent, monkeypatch)
    assert got == sent
    assert (got.cluster, got.store, got.engine, got.scheduler) == (
        cluster,
        store,
        engine,
        scheduler,
    )
    # The PE's batcher packs to the changed quota, and the simulator's PEs do too.
    batcher = prefill_batcher(got, ConstantAttentionTimePredictor(0.001))
    assert batcher.quota_s == QUOTA_S
    simulator = build_simulator(small_spec(attention_quota_s=QUOTA_S))
    sim_batchers = [engine.batcher for engine in simulator._prefill_engines.values()]
    assert sim_batchers and all(b.quota_s == QUOTA_S for b in sim_batchers)

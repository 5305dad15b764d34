from __future__ import annotations

import dataclasses

import pytest

from dualpath.config import (
    MODES,
    ClusterConfig,
    EngineConfig,
    KVStoreConfig,
    SchedulerConfig,
    TrafficConfig,
    mode_settings,
    parse_node_shape,
)


def test_modes_build_on_each_other() -> None:
    settings = [mode_settings(m) for m in MODES]
    assert [(s.scheduler, s.read_path, s.is_layerwise, s.is_io_free) for s in settings] == [
        ("round_robin", "pe", False, False),
        ("round_robin", "pe", True, False),
        ("round_robin", "round_robin", True, False),
        ("dualpath", "dual", True, False),
        ("dualpath", "dual", True, True),
    ]
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        mode_settings("fast")


@pytest.mark.parametrize(
    ("shape", "expected"), [("2P4D", (2, 4)), ("1p2d", (1, 2)), ("48P96D", (48, 96))]
)
def test_parse_node_shape(shape: str, expected: tuple[int, int]) -> None:
    assert parse_node_shape(shape) == expected


@pytest.mark.parametrize("shape", ["", "2P", "P4D", "0P1D", "2x4", "aPbD", "2P-1D"])
def test_parse_node_shape_rejects(shape: str) -> None:
    with pytest.raises(ValueError, match="2P4D|prefill"):
        parse_node_shape(shape)


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (ClusterConfig, {"num_decode_nodes": 3, "nodes_per_group": 2}, "groups of 2"),
        (TrafficConfig, {"snic_bandwidth_gbps": -1.0}, "snic_bandwidth_gbps"),
        (TrafficConfig, {"kv_weight": 0}, "starves"),
        (ClusterConfig, {"mode": "turbo"}, "unknown mode"),
        (ClusterConfig, {"engines_per_node": 0}, "engines_per_node"),
        (ClusterConfig, {"session_retention_s": -1.0}, "session_retention_s"),
        (ClusterConfig, {"session_retention_s": float("inf")}, "session_retention_s"),
        (EngineConfig, {"dtype": "int8"}, "dtype"),
        (EngineConfig, {"device": "tpu"}, "device"),
        (EngineConfig, {"block_size_tokens": 0}, "block_size_tokens"),
        (EngineConfig, {"num_decode_threads": 0}, "num_decode_threads"),
        (EngineConfig, {"vllm_prefill_batching": "quota"}, "give it with engine 'vllm'"),
        (KVStoreConfig, {"capacity_bytes": 0}, "capacity_bytes"),
        (SchedulerConfig, {"read_path": "both"}, "read_path"),
        (SchedulerConfig, {"z_factor": 0.9}, "z_factor"),
    ],
)
def test_configs_reject_bad_values(cls, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_a_decode_engine_runs_its_own_thread_count_where_one_is_set() -> None:
    config = EngineConfig(num_threads=2, num_decode_threads=1)
    assert config.for_role("decode").num_threads == 1
    assert config.for_role("prefill") is config
    assert EngineConfig(num_threads=2).for_role("decode").num_threads == 2


def test_configs_are_frozen() -> None:
    config = ClusterConfig()
    assert config.node_shape == "1P2D" and config.settings.mode == "dualpath"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "basic"  # type: ignore[misc]


# Every field of every config an engine process is built from, each at a value other than its
# default. A field added to a config and left out here fails
# ``test_the_table_covers_every_field``: add it, and the round trip below proves it arrives.
def _non_default_configs() -> dict[type, dict]:
    from pathlib import Path

    from dualpath.config import (
        ClusterConfig,
        EngineConfig,
        EngineProcessConfig,
        KVStoreConfig,
        SchedulerConfig,
        TrafficConfig,
    )

    traffic = dict(
        snic_bandwidth_gbps=1.5,
        cnic_bandwidth_gbps=2.5,
        host_memory_bandwidth_gbps=3.5,
        inference_weight=90,
        kv_weight=10,
        utilisation_window_s=2.0,
        gap_fill_s=0.002,
    )
    cluster = dict(
        num_prefill_nodes=2,
        num_decode_nodes=4,
        engines_per_node=2,
        nodes_per_group=2,
        mode="layerwise",
        read_path="split",
        traffic=TrafficConfig(**traffic),
        prefill_buffer_bytes=3 << 20,
        decode_buffer_bytes=5 << 20,
        control_endpoint="tcp://10.0.0.1:5555",
        heartbeat_timeout_s=7.0,
        persist_wait_s=1.5,
        session_retention_s=60.0,
        local_prefill_tokens=256,
    )
    store = dict(
        root_dir=Path("/mnt/kv"),
        capacity_bytes=123 << 20,
        verify_checksums=False,
        fsync_writes=True,
    )
    engine = dict(
        block_size_tokens=32,
        device="cuda:1",
        dtype="bfloat16",
        num_device_blocks=77,
        kv_cache_bytes=1 << 20,
        num_io_threads=3,
        max_pending_write_bytes=1 << 21,
        num_threads=2,
        num_decode_threads=1,
        max_num_seqs=9,
        max_num_batched_tokens=1000,
        max_model_len=4096,
        engine="vllm",
        vllm_args={"max_num_seqs": 8},
        vllm_prefill_batching="quota",
    )
    scheduler = dict(
        scheduler="round_robin",
        read_path="pe",
        block_size_tokens=32,
        alpha_window_s=2.0,
        beta_window_s=4.0,
        alpha_tokens=1000,
        beta_tokens=2000,
        prefill_tokens_per_s=1234.5,
        z_factor=1.1,
        fetch_interval_s=0.02,
        attention_quota_s=0.45,
        min_prefill_chunk_tokens=32,
    )
    process = dict(
        role="decode",
        engine_id=5,
        node_id=3,
        scheduler_endpoint="tcp://10.0.0.1:5555",
        model_dir=Path("/models/m"),
        store=KVStoreConfig(**store),
        engine=EngineConfig(**engine),
        cluster=ClusterConfig(**cluster),
        scheduler=SchedulerConfig(**scheduler),
        transport="shm",
        report_keepalive_s=0.5,
        peer_timeout_s=12.0,
        store_flush_timeout_s=3.0,
        url="http://10.0.0.3:8000",
    )
    return {
        TrafficConfig: traffic,
        ClusterConfig: cluster,
        KVStoreConfig: store,
        EngineConfig: engine,
        SchedulerConfig: scheduler,
        EngineProcessConfig: process,
    }


def test_the_table_covers_every_field() -> None:
    for cls, values in _non_default_configs().items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert set(values) == set(fields), f"{cls.__name__}: fields not in the table"
        for name, value in values.items():
            default = fields[name].default
            assert value != default, f"{cls.__name__}.{name} is at its default"


def test_an_engine_gets_every_field_of_its_config(tmp_path, monkeypatch) -> None:
    """What the launcher sends (JSON on the engine's stdin) is what ``dualpath engine
    --config`` builds, every field of every nested config included."""
    import io
    import json

    from dualpath.cli import build_parser, engine_process_config
    from dualpath.config import EngineProcessConfig, config_to_dict

    config = EngineProcessConfig(**_non_default_configs()[EngineProcessConfig])
    text = json.dumps(config_to_dict(config))
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert engine_process_config(build_parser().parse_args(["engine", "--config", "-"])) == config
    # Its identity may come along (a process list shows it), agreeing with the config.
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    identity = ["--role", "decode", "--engine-id", "5", "--node-id", "3"]
    args = build_parser().parse_args(["engine", "--config", "-", *identity])
    assert engine_process_config(args) == config
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    args = build_parser().parse_args(["engine", "--config", "-", "--engine-id", "6"])
    with pytest.raises(ValueError, match="--engine-id 6 differs from the --config's 5"):
        engine_process_config(args)
    args = build_parser().parse_args(["engine", "--config", "-", "--snic-gbps", "1"])
    with pytest.raises(ValueError, match="leave out --snic-gbps"):
        engine_process_config(args)
    path = tmp_path / "engine.json"
    path.write_text(text)
    assert engine_process_config(build_parser().parse_args(["engine", "--config", str(path)])) == (
        config
    )


def test_config_from_dict_refuses_what_it_does_not_know() -> None:
    from dualpath.config import EngineConfig, KVStoreConfig, config_from_dict

    assert config_from_dict(EngineConfig, {"max_num_seqs": 3}) == EngineConfig(max_num_seqs=3)
    with pytest.raises(ValueError, match="EngineConfig has no field 'max_num_seq'"):
        config_from_dict(EngineConfig, {"max_num_seq": 3})
    with pytest.raises(ValueError, match="EngineConfig.max_num_seqs cannot be '3'"):
        config_from_dict(EngineConfig, {"max_num_seqs": "3"})
    with pytest.raises(ValueError, match="KVStoreConfig.fsync_writes cannot be 1"):
        config_from_dict(KVStoreConfig, {"fsync_writes": 1})

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
        (EngineConfig, {"dtype": "int8"}, "dtype"),
        (EngineConfig, {"device": "tpu"}, "device"),
        (EngineConfig, {"block_size_tokens": 0}, "block_size_tokens"),
        (KVStoreConfig, {"capacity_bytes": 0}, "capacity_bytes"),
        (SchedulerConfig, {"read_path": "both"}, "read_path"),
        (SchedulerConfig, {"z_factor": 0.9}, "z_factor"),
    ],
)
def test_configs_reject_bad_values(cls, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_configs_are_frozen() -> None:
    config = ClusterConfig()
    assert config.node_shape == "1P2D" and config.settings.mode == "dualpath"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "basic"  # type: ignore[misc]

"""Link specs, byte counters, the traffic config, and SPEC §5's bottleneck-free P/D range."""

from __future__ import annotations

import pytest

from dualpath.config import TrafficConfig
from dualpath.transfer.links import (
    LinkCounter,
    LinkKind,
    LinkSpec,
    TrafficClass,
    bottleneck_free_pd_range,
    check_pd_ratio,
    engine_link_specs,
)
from dualpath.units import GB, gbps_to_bytes_per_s


def test_link_spec_converts_gbps_and_zero_means_uncapped() -> None:
    capped = LinkSpec("node0.snic", LinkKind.SNIC, bandwidth_gbps=400.0)
    assert capped.is_capped
    assert capped.bandwidth_bytes_per_s == 50 * GB
    uncapped = LinkSpec("engine0.cnic", LinkKind.CNIC)
    assert not uncapped.is_capped
    assert uncapped.bandwidth_bytes_per_s == 0.0


@pytest.mark.parametrize("bandwidth_gbps", [-1.0, float("nan"), float("inf")])
def test_link_spec_rejects_bad_bandwidth(bandwidth_gbps: float) -> None:
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        LinkSpec("x", LinkKind.CNIC, bandwidth_gbps)


def test_counter_keeps_moved_and_carried_bytes_per_class() -> None:
    counter = LinkCounter(LinkSpec("l", LinkKind.CNIC, 8.0))  # 1e9 bytes/s
    counter.add_moved(TrafficClass.KV, 300)
    counter.add_moved(TrafficClass.KV, 200)
    counter.add_carried(TrafficClass.KV, 500.0, 0.0, 0.5)
    stats = counter.snapshot(1.0)
    assert stats.class_to_num_moves == {TrafficClass.INFERENCE: 0, TrafficClass.KV: 2}
    assert stats.class_to_moved_bytes == {TrafficClass.INFERENCE: 0, TrafficClass.KV: 500}
    assert stats.carried_bytes == 500.0


def test_counter_window_rate_and_utilisation() -> None:
    # 0.5e9 bytes carried evenly over [10, 11]: half the 1e9 bytes/s cap over the last second.
    counter = LinkCounter(LinkSpec("l", LinkKind.CNIC, 8.0), window_s=1.0, num_buckets=10)
    counter.add_carried(TrafficClass.KV, 5e8, 9.0, 10.0)  # the second before: out of the window
    counter.add_carried(TrafficClass.KV, 5e8, 10.0, 11.0)
    stats = counter.snapshot(11.0)
    assert stats.window_bytes_per_s == pytest.approx(5e8)
    assert stats.utilisation == pytest.approx(0.5)
    uncapped = LinkCounter(LinkSpec("u", LinkKind.CNIC), window_s=1.0)
    uncapped.add_carried(TrafficClass.KV, 100.0, 0.5, 0.5)
    assert uncapped.snapshot(1.0).utilisation is None


def test_traffic_config_validates_and_names_links() -> None:
    config = TrafficConfig(snic_bandwidth_gbps=100.0, cnic_bandwidth_gbps=200.0)
    assert config.class_weights == {TrafficClass.INFERENCE: 99, TrafficClass.KV: 1}
    links = engine_link_specs(config, node_id=3, engine_id=12)
    assert [spec.name for spec in links.all()] == ["node3.snic", "engine12.cnic"]
    assert (links.snic.bandwidth_gbps, links.cnic.bandwidth_gbps) == (100.0, 200.0)
    with pytest.raises(ValueError, match="kv 0"):
        TrafficConfig(kv_weight=0)
    with pytest.raises(ValueError, match="cnic_bandwidth_gbps"):
        TrafficConfig(cnic_bandwidth_gbps=-1.0)


def test_spec_example_gives_one_seventh_to_seven_halves() -> None:
    # SPEC §5: g = 8, s = 1, M ≈ 500 GB/s, B·s ≈ 50 GB/s  ->  1/7 <= P/D <= 7/2.
    low, high = bottleneck_free_pd_range(8, 1.0, 500 * GB, 50 * GB)
    assert low == pytest.approx(1 / 7)
    assert high == pytest.approx(7 / 2)


def test_each_upper_bound_can_bind() -> None:
    # s = 2: (g-s)/(2s) = 1.5 is below (g-2s)/s = 2; host memory is ample.
    assert bottleneck_free_pd_range(8, 2.0, 10_000 * GB, 50 * GB) == (pytest.approx(2 / 6), 1.5)
    # Slow host memory: (M/(B·s) - 3)/2 = (6 - 3)/2 binds.
    assert bottleneck_free_pd_range(8, 1.0, 300 * GB, 50 * GB)[1] == pytest.approx(1.5)
    # Storage as fast as the node's CNICs cannot be bottleneck-free.
    with pytest.raises(ValueError, match="below"):
        bottleneck_free_pd_range(8, 8.0, 500 * GB, 50 * GB)


def test_check_pd_ratio_warns_only_outside_the_range() -> None:
    # The paper's hardware: 400 Gbps SNIC and CNICs (s = 1), M = 500 GB/s, so M/(B·s) = 10.
    bandwidths = {
        "num_gpus_per_node": 8,
        "snic_bandwidth_gbps": 400.0,
        "cnic_bandwidth_gbps": 400.0,
        "host_memory_bandwidth_gbps": 500 * 8.0,
    }
    assert gbps_to_bytes_per_s(bandwidths["host_memory_bandwidth_gbps"]) == 500 * GB
    for num_prefill, num_decode in [(1, 7), (1, 1), (2, 4), (7, 2)]:
        assert check_pd_ratio(num_prefill, num_decode, **bandwidths) == []
    for num_prefill, num_decode in [(1, 8), (4, 1)]:
        [warning] = check_pd_ratio(num_prefill, num_decode, **bandwidths)
        assert f"{num_prefill}P{num_decode}D" in warning and "SPEC §5" in warning
    # Uncapped links: real speeds unknown, nothing to check.
    assert check_pd_ratio(4, 1, **{**bandwidths, "snic_bandwidth_gbps": 0.0}) == []

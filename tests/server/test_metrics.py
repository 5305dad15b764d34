"""Server metrics without a server: exact values through Prometheus' own text parser."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dualpath.cluster.coordinator import ClusterSnapshot
from dualpath.kv.store import StoreStats
from dualpath.server.cluster_metrics import LinkRateTracker, link_capacity_lookup, link_totals
from dualpath.server.metrics import GenerationTimes, ServerMetrics
from dualpath.server.vllm_metrics import VLLM_SERIES, request_tokens_buckets


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def make_metrics(snapshots: list[ClusterSnapshot]) -> ServerMetrics:
    return ServerMetrics(
        lambda: snapshots[-1],
        engine_id_to_role={0: "prefill", 1: "decode"},
        link_capacity_bytes_per_s=link_capacity_lookup(8.0, 0.0),  # SNIC 1 GB/s
        store_stats=lambda: StoreStats(hit_blocks=5, miss_blocks=2, corrupt_blocks=1),
        window_s=10.0,
        model_name="tiny",
        max_model_len=2048,
    )


def snapshot(time_s: float, snic_kv_bytes: int, store_read_bytes: int) -> ClusterSnapshot:
    return ClusterSnapshot(
        time_s=time_s,
        num_live_engines=2,
        num_expected_engines=2,
        num_waiting_prefill=3,
        num_waiting_decode=1,
        num_assigned=7,
        num_persist_waits=4,
        num_persist_expired=1,
        num_replaced=2,
        num_reports=11,
        engine_id_to_num_requests={1: 3},
        link_bytes={
            0: {"node0.snic.kv": snic_kv_bytes, "engine0.cnic.kv": 10, "store_read_bytes": 0},
            1: {"node1.snic.kv": 0, "store_read_bytes": store_read_bytes},
        },
    )


def test_cluster_metrics_come_from_the_snapshot() -> None:
    snapshots = [snapshot(100.0, 0, 0)]
    metrics = make_metrics(snapshots)
    samples(metrics)  # first scrape: one sample, no rate yet
    snapshots.append(snapshot(102.0, 1_000_000_000, 4096))
    values = samples(metrics)
    assert values[("dualpath_engines_live", ())] == 2
    assert values[("dualpath_scheduler_queue_requests", (("queue", "prefill"),))] == 3
    assert values[("dualpath_scheduler_queue_requests", (("queue", "decode"),))] == 1
    assert values[("dualpath_scheduler_persist_waits_total", ())] == 4
    assert values[("dualpath_scheduler_persist_wait_expired_total", ())] == 1
    assert values[("dualpath_scheduler_replaced_requests_total", ())] == 2
    assert values[("dualpath_scheduler_reports_total", ())] == 11
    # Every engine of the topology has a sample, 0 when it holds no request.
    assert values[("dualpath_engine_requests", (("engine", "0"), ("role", "prefill")))] == 0
    assert values[("dualpath_engine_requests", (("engine", "1"), ("role", "decode")))] == 3
    snic = (("link", "node0.snic"), ("traffic_class", "kv"))
    assert values[("dualpath_link_bytes_total", snic)] == 1_000_000_000
    assert values[("dualpath_link_throughput_bytes_per_second", snic)] == 5e8
    assert values[("dualpath_link_utilisation_ratio", snic)] == pytest.approx(0.5)
    # Uncapped links have a throughput but no utilisation.
    cnic = (("link", "engine0.cnic"), ("traffic_class", "kv"))
    assert ("dualpath_link_utilisation_ratio", cnic) not in values
    assert values[("dualpath_read_path_bytes_total", (("side", "decode"),))] == 4096
    assert values[("dualpath_read_path_bytes_total", (("side", "prefill"),))] == 0
    assert values[("dualpath_snic_read_bytes_total", (("link", "node1.snic"),))] == 4096
    assert values[("dualpath_snic_read_bytes_total", (("link", "node0.snic"),))] == 0
    assert values[("dualpath_store_hit_blocks_total", ())] == 5
    assert values[("dualpath_store_corrupt_blocks_total", ())] == 1


def metrics_after_one_generation():
    """Metrics that saw one request of 100 prompt tokens (64 cached) and 9 outputs: first
    token 0.5 s after its arrival, second 0.25 s later, the last 2.5 s after it came."""
    metrics = make_metrics([snapshot(0.0, 0, 0)])
    metrics.on_generation_finished(
        "length",
        GenerationTimes(10.0, 10.5, 10.75, 12.5, num_output_tokens=9),
        num_prompt_tokens=100,
        num_cached_tokens=64,
    )
    return metrics


def test_request_metrics() -> None:
    metrics = metrics_after_one_generation()
    metrics.http_requests.labels("/v1/completions", "429").inc()
    values = samples(metrics)
    assert values[("dualpath_generations_total", (("finish_reason", "length"),))] == 1
    assert values[("dualpath_time_to_first_token_seconds_sum", ())] == 0.5
    assert values[("dualpath_time_to_second_token_seconds_sum", ())] == 0.25
    assert values[("dualpath_time_per_output_token_seconds_sum", ())] == 0.25  # 2 s / 8
    assert values[("dualpath_e2e_request_latency_seconds_sum", ())] == 2.5
    assert values[("dualpath_cached_prompt_tokens_total", ())] == 64
    assert values[("dualpath_generation_tokens_total", ())] == 9
    key = (("route", "/v1/completions"), ("status_code", "429"))
    assert values[("dualpath_http_requests_total", key)] == 1


def vllm_labels(**extra: str) -> tuple:
    return tuple(sorted({"model_name": "tiny", "engine": "0", **extra}.items()))


def test_request_series_under_vllm_names_are_ours() -> None:
    metrics = metrics_after_one_generation()
    metrics.generations.labels("cancelled").inc()
    metrics.inter_token_latency.observe(0.03)
    metrics.waiting.set(3)
    metrics.running.inc()
    values = samples(metrics)
    vllm = vllm_labels()
    for ours, theirs, value in (
        ("dualpath_prompt_tokens_total", "vllm:prompt_tokens_total", 100),
        ("dualpath_prompt_tokens_total", "vllm:prefix_cache_queries_total", 100),
        ("dualpath_cached_prompt_tokens_total", "vllm:prefix_cache_hits_total", 64),
        ("dualpath_cached_prompt_tokens_total", "vllm:prompt_tokens_cached_total", 64),
        ("dualpath_generation_tokens_total", "vllm:generation_tokens_total", 9),
        ("dualpath_requests_waiting", "vllm:num_requests_waiting", 3),
        ("dualpath_requests_running", "vllm:num_requests_running", 1),
        ("dualpath_time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_sum", 0.5),
        ("dualpath_time_per_output_token_seconds_sum",
         "vllm:request_time_per_output_token_seconds_sum", 0.25),
        ("dualpath_inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_sum", 0.03),
        ("dualpath_e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum", 2.5),
    ):  # fmt: skip
        assert values[(ours, ())] == values[(theirs, vllm)] == value, theirs
    # One observation per finished generation, of its tokens, in vLLM's 1-2-5 buckets.
    assert values[("vllm:request_prompt_tokens_bucket", vllm_labels(le="100.0"))] == 1
    assert values[("vllm:request_prompt_tokens_bucket", vllm_labels(le="50.0"))] == 0
    assert values[("vllm:request_generation_tokens_sum", vllm)] == 9
    # vLLM's TTFT buckets, not ours: 0.5 s falls in le=0.5, and ours has no 0.75 bound.
    assert values[("vllm:time_to_first_token_seconds_bucket", vllm_labels(le="0.5"))] == 1
    assert values[("vllm:time_to_first_token_seconds_bucket", vllm_labels(le="0.25"))] == 0
    assert ("vllm:time_to_first_token_seconds_bucket", vllm_labels(le="0.75")) in values
    # vLLM's finish reasons, each from the start; our 'cancelled' is its 'abort'.
    success = {
        dict(labels)["finished_reason"]: value
        for (name, labels), value in values.items()
        if name == "vllm:request_success_total"
    }
    assert success == {"stop": 0, "length": 1, "abort": 1, "error": 0, "repetition": 0}


def test_every_vllm_series_is_exported_with_vllms_type_and_labels() -> None:
    metrics = make_metrics([snapshot(0.0, 0, 0)])
    text = generate_latest(metrics.registry).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for series in VLLM_SERIES:
        family = families[series.name]
        assert family.type == series.kind, series.name
        label_names = {"model_name", "engine"} | ({series.label} if series.label else set())
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == label_names, sample
            assert sample.labels["model_name"] == "tiny" and sample.labels["engine"] == "0"


def test_request_token_buckets_are_vllms_1_2_5_series_up_to_the_context() -> None:
    assert request_tokens_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert request_tokens_buckets(1) == (1,)


def test_two_servers_in_one_process_do_not_share_metrics() -> None:
    first, second = make_metrics([snapshot(0, 0, 0)]), make_metrics([snapshot(0, 0, 0)])
    first.generation_tokens.inc(5)
    assert samples(second)[("dualpath_generation_tokens_total", ())] == 0


def test_link_rates_use_the_window_and_skip_restarted_counters() -> None:
    tracker = LinkRateTracker(window_s=2.0)
    key = ("node0.snic", "kv")
    for time_s, total in ((0.0, 0), (1.0, 100), (2.0, 200), (3.0, 600)):
        tracker.observe(time_s, {key: total})
    assert tracker.rates_bytes_per_s()[key] == 250.0  # (600 - 100) / (3 - 1)
    tracker.observe(4.0, {key: 10})  # the engine restarted: its counter began again
    assert key not in tracker.rates_bytes_per_s()


def test_link_totals_add_up_engines_sharing_a_nodes_snic() -> None:
    totals = link_totals({3: {"node1.snic.kv": 5, "store_read_bytes": 9}, 4: {"node1.snic.kv": 7}})
    assert totals == {("node1.snic", "kv"): 12}

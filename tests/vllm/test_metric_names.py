"""The series /metrics exports under vLLM's names are vLLM 0.32's own: for every row of
``VLLM_SERIES``, vLLM's ``PrometheusStatLogger`` (built here from the tiny checkpoint's config)
exports a series of that name and type, with the same label names, the same label values where
vLLM fixes them (finish reasons) and the same histogram buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Metric

from dualpath.cluster.coordinator import ClusterSnapshot
from dualpath.server.metrics import ServerMetrics
from dualpath.server.vllm_metrics import VLLM_SERIES

pytestmark = pytest.mark.vllm

MODEL = "tiny"
CONTEXT = 2048


def families(registry: CollectorRegistry) -> dict[str, Metric]:
    return {family.name: family for family in registry.collect()}


def shape(family: Metric) -> tuple[str, set[str], set[tuple], list[str]]:
    """Type, label names, label values other than the model's, and bucket bounds."""
    label_names = {name for s in family.samples for name in s.labels} - {"le"}
    values = {
        tuple(v for k, v in sorted(s.labels.items()) if k not in ("le", "model_name", "engine"))
        for s in family.samples
    }
    buckets = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
    return family.type, label_names, values, buckets


def test_every_vllm_named_series_has_vllms_type_labels_and_buckets(tiny_model_dir: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    config = EngineArgs(
        model=str(tiny_model_dir), served_model_name=[MODEL], max_model_len=CONTEXT
    ).create_engine_config()
    PrometheusStatLogger(config)  # into prometheus_client's global registry
    try:
        theirs = families(REGISTRY)
    finally:
        unregister_vllm_metrics()
    metrics = ServerMetrics(
        lambda: ClusterSnapshot(0.0, 2, 2, 0, 0, 0),
        engine_id_to_role={0: "prefill", 1: "decode"},
        link_capacity_bytes_per_s=lambda link: 0.0,
        store_stats=lambda: None,
        window_s=10.0,
        model_name=MODEL,
        max_model_len=CONTEXT,
    )
    ours = families(metrics.registry)
    for series in VLLM_SERIES:
        assert shape(ours[series.name]) == shape(theirs[series.name]), series.name

"""Our request series under vLLM 0.32's names too, so a dashboard made for vLLM reads /metrics.

vLLM's ``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py) exports ``vllm:NAME`` series
labelled ``model_name`` (the served model name) and ``engine`` (the engine core's index).
``VLLM_SERIES`` lists the ones this server has numbers for, each with the series of ours it is
written with; ``twinned`` wraps one of our metrics so that every call on it writes its vLLM
series as well. One call feeds both names, so they cannot disagree:

    ours (dualpath_...)                   vLLM 0.32                                     type
    requests_running                      vllm:num_requests_running                     gauge
    requests_waiting                      vllm:num_requests_waiting                     gauge
    generations{finish_reason}            vllm:request_success{finished_reason}         counter
    prompt_tokens                         vllm:prompt_tokens, vllm:prefix_cache_queries counter
                                          vllm:request_prompt_tokens (per generation)   histogram
    cached_prompt_tokens                  vllm:prefix_cache_hits,                       counter
                                          vllm:prompt_tokens_cached
    generation_tokens                     vllm:generation_tokens                        counter
                                          vllm:request_generation_tokens (per gen.)     histogram
    time_to_first_token_seconds           vllm:time_to_first_token_seconds              histogram
    inter_token_latency_seconds           vllm:inter_token_latency_seconds              histogram
    time_per_output_token_seconds         vllm:request_time_per_output_token_seconds    histogram
    e2e_request_latency_seconds           vllm:e2e_request_latency_seconds              histogram

Types, label names and histogram buckets are vLLM 0.32's defaults (vllm/v1/metrics/buckets.py),
so a quantile or heatmap query reads this server as it reads a vLLM instance, and one that
sums ``le`` over both stays right. The numbers are the server's, over the whole cluster
behind it: a generation waits until its first token (its prefill included) and runs after it,
and its tokens count when it ends. ``engine`` is always "0", as a vLLM instance's series cover
its one engine core. Finish reasons are vLLM's: our "cancelled" is its "abort". vLLM's
``kv_cache_usage_perc`` is left out: it is one engine's share of paged KV cache in use, and no
number here is that (our engines' host buffers are another memory; a decode engine's free
device blocks reach only the scheduler, and a prefill engine reports none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

ENGINE_LABEL_VALUE = "0"
# vLLM's label values by label name (vllm.v1.engine.FinishReason), each present from the
# start at 0 as in vLLM, and ours that vLLM spells otherwise (stop, length, error: the same).
VLLM_LABEL_VALUES = {"finished_reason": ("stop", "length", "abort", "error", "repetition")}
OUR_TO_VLLM_LABEL_VALUE = {"finished_reason": {"cancelled": "abort"}}

# vllm/v1/metrics/buckets.py, vLLM 0.32's defaults by bucket family; "request_tokens" is
# computed from the context length (request_tokens_buckets).
VLLM_BUCKETS: dict[str, tuple[float, ...]] = {
    "time_to_first_token": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ),
    "inter_token_latency": (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ),
    "request_latency": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0,
    ),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class VllmSeries:
    """One series vLLM 0.32 exports, written with one series of ours (the same values, by the
    same call). A histogram beside one of our counters observes each increment: our token
    counters grow once per finished generation, by its tokens."""

    name: str  # vLLM's (a counter's without the _total of its sample)
    kind: Literal["counter", "gauge", "histogram"]  # vLLM's type
    ours: str  # our metric's name (a counter's without _total)
    help_text: str
    buckets: str | None = None  # a histogram's bucket family: VLLM_BUCKETS or "request_tokens"
    label: str | None = None  # vLLM's name for our one label, where ours has one


VLLM_SERIES = (
    VllmSeries(
        "vllm:num_requests_running", "gauge", "dualpath_requests_running",
        "Generations with a first token and no last one yet.",
    ),
    VllmSeries(
        "vllm:num_requests_waiting", "gauge", "dualpath_requests_waiting",
        "Generations accepted without a first token yet.",
    ),
    VllmSeries(
        "vllm:request_success", "counter", "dualpath_generations",
        "Generations ended, by finish reason ('abort': the client went away or the server "
        "stopped).",
        label="finished_reason",
    ),
    VllmSeries(
        "vllm:prompt_tokens", "counter", "dualpath_prompt_tokens",
        "Prompt tokens of finished generations.",
    ),
    VllmSeries(
        "vllm:prefix_cache_queries", "counter", "dualpath_prompt_tokens",
        "Prompt tokens of finished generations: the tokens a cached prefix was looked for in.",
    ),
    VllmSeries(
        "vllm:request_prompt_tokens", "histogram", "dualpath_prompt_tokens",
        "Prompt tokens per finished generation.",
        buckets="request_tokens",
    ),
    VllmSeries(
        "vllm:prefix_cache_hits", "counter", "dualpath_cached_prompt_tokens",
        "Prompt tokens whose KV was not computed: loaded from the store or held by the engine.",
    ),
    VllmSeries(
        "vllm:prompt_tokens_cached", "counter", "dualpath_cached_prompt_tokens",
        "Prompt tokens whose KV was not computed: loaded from the store or held by the engine.",
    ),
    VllmSeries(
        "vllm:generation_tokens", "counter", "dualpath_generation_tokens",
        "Generated tokens.",
    ),
    VllmSeries(
        "vllm:request_generation_tokens", "histogram", "dualpath_generation_tokens",
        "Generated tokens per finished generation.",
        buckets="request_tokens",
    ),
    VllmSeries(
        "vllm:time_to_first_token_seconds", "histogram", "dualpath_time_to_first_token_seconds",
        "Arrival at the server to the first generated token.",
        buckets="time_to_first_token",
    ),
    VllmSeries(
        "vllm:inter_token_latency_seconds", "histogram", "dualpath_inter_token_latency_seconds",
        "Between two deliveries of a generation's tokens to the server, after the first.",
        buckets="inter_token_latency",
    ),
    VllmSeries(
        "vllm:request_time_per_output_token_seconds", "histogram",
        "dualpath_time_per_output_token_seconds",
        "Mean time between output tokens after the first, per generation of 2 tokens or more.",
        buckets="inter_token_latency",
    ),
    VllmSeries(
        "vllm:e2e_request_latency_seconds", "histogram", "dualpath_e2e_request_latency_seconds",
        "Arrival at the server to the last token, per generation with a first token.",
        buckets="request_latency",
    ),
)  # fmt: skip


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Twinned:
    """One of our metrics (or one labelled child of it) and its vLLM series: every call writes
    them all. Offers the calls our metrics get: ``inc``, ``dec``, ``set``, ``observe`` and
    ``labels``."""

    def __init__(
        self,
        ours: MetricWrapperBase,
        twins: tuple[tuple[VllmSeries, MetricWrapperBase], ...],
        model_name: str,
        label_values: tuple[str, ...] = (),
    ) -> None:
        self._ours = ours
        self._twins = twins
        self._model_name = model_name
        self._label_values = label_values

    def labels(self, *values: str) -> Twinned:
        return Twinned(
            self._ours.labels(*values), self._twins, self._model_name, self._label_values + values
        )

    def inc(self, amount: float = 1.0) -> None:
        self._ours.inc(amount)
        for twin in self._children():
            if isinstance(twin, Histogram):
                twin.observe(amount)
            else:
                twin.inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._ours.dec(amount)
        for twin in self._children():
            twin.dec(amount)

    def set(self, value: float) -> None:
        self._ours.set(value)
        for twin in self._children():
            twin.set(value)

    def observe(self, value: float) -> None:
        self._ours.observe(value)
        for twin in self._children():
            twin.observe(value)

    def _children(self) -> list[MetricWrapperBase]:
        return [
            twin.labels(*_vllm_label_values(series, self._model_name, self._label_values))
            for series, twin in self._twins
        ]


def twinned(
    ours: MetricWrapperBase, registry: CollectorRegistry, *, model_name: str, max_model_len: int
) -> Twinned:
    """``ours`` with the vLLM series ``VLLM_SERIES`` writes with it, created in ``registry``
    (with every label value vLLM starts with, at 0)."""
    name = ours.describe()[0].name
    twins = tuple(
        (series, _vllm_metric(series, registry, max_model_len))
        for series in VLLM_SERIES
        if series.ours == name
    )
    assert twins, f"{name} has no vLLM series in VLLM_SERIES"
    for series, twin in twins:
        if series.label is None:
            twin.labels(model_name, ENGINE_LABEL_VALUE)
        for value in VLLM_LABEL_VALUES.get(series.label or "", ()):
            twin.labels(model_name, ENGINE_LABEL_VALUE, value)
    return Twinned(ours, twins, model_name)


def _vllm_metric(
    series: VllmSeries, registry: CollectorRegistry, max_model_len: int
) -> MetricWrapperBase:
    labelnames = ["model_name", "engine"] + ([series.label] if series.label else [])
    if series.kind == "histogram":
        assert series.buckets is not None, f"{series.name}: a histogram needs its buckets"
        buckets = (
            request_tokens_buckets(max_model_len)
            if series.buckets == "request_tokens"
            else VLLM_BUCKETS[series.buckets]
        )
        return Histogram(
            series.name, series.help_text, labelnames, buckets=buckets, registry=registry
        )
    kind = Counter if series.kind == "counter" else Gauge
    return kind(series.name, series.help_text, labelnames, registry=registry)


def _vllm_label_values(
    series: VllmSeries, model_name: str, our_values: tuple[str, ...]
) -> tuple[str, ...]:
    renames = OUR_TO_VLLM_LABEL_VALUE.get(series.label or "", {})
    return (model_name, ENGINE_LABEL_VALUE, *(renames.get(v, v) for v in our_values))

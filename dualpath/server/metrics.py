"""Prometheus metrics of one server, in a registry of its own (two apps in one process never
share a time series).

Request metrics are recorded here as requests finish; cluster metrics (links, queues,
engines) are read from the scheduler's latest ``ClusterSnapshot`` when /metrics is scraped.
Every name is prefixed ``dualpath_``; times are seconds and sizes bytes, per Prometheus'
conventions. The request series (requests running and waiting, finished generations, tokens,
TTFT, inter-token, TPOT and end-to-end latency) also go out under vLLM 0.32's names, written by
the same calls (``dualpath.server.vllm_metrics`` has the mapping), so a vLLM dashboard reads
this server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dualpath.cluster.coordinator import ClusterSnapshot
from dualpath.kv.store import StoreStats
from dualpath.server.cluster_metrics import ClusterCollector, LinkRateTracker
from dualpath.server.vllm_metrics import Twinned, twinned

_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
_TPOT_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class GenerationTimes:
    """One finished generation's timings, seconds on the server's monotonic clock."""

    arrival_s: float
    first_token_s: float | None
    second_token_s: float | None
    finish_s: float
    num_output_tokens: int


class ServerMetrics:
    """Everything /metrics shows. Not thread-safe for writers: call from the event loop."""

    def __init__(
        self,
        snapshot: Callable[[], ClusterSnapshot],
        *,
        engine_id_to_role: dict[int, str],
        link_capacity_bytes_per_s: Callable[[str], float],
        store_stats: Callable[[], StoreStats | None],
        window_s: float,
        model_name: str,
        max_model_len: int,
    ) -> None:
        """``model_name`` (the served name) and ``max_model_len`` label and size the series
        under vLLM's names."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def with_vllm_names(ours: Counter | Gauge | Histogram) -> Twinned:
            return twinned(ours, r, model_name=model_name, max_model_len=max_model_len)

        self.http_requests = Counter(
            "dualpath_http_requests",
            "HTTP requests answered, by route and status code (429s included).",
            ["route", "status_code"],
            registry=r,
        )
        self.generations = with_vllm_names(
            Counter(
                "dualpath_generations",
                "Generations (one prompt x one choice) ended, by finish reason; 'cancelled' "
                "when the client went away or the server stopped.",
                ["finish_reason"],
                registry=r,
            )
        )
        self.rejected = Counter(
            "dualpath_requests_rejected",
            "Requests refused before reaching the scheduler, by reason (queue_full = 429).",
            ["reason"],
            registry=r,
        )
        self.forwarded_replacements = Counter(
            "dualpath_forwarded_replacements",
            "Requests forwarded to vLLM servers that the server placed again after their "
            "engine was lost (a stream goes on from the tokens already sent).",
            registry=r,
        )
        self.forwarded_prompts = Counter(
            "dualpath_forwarded_prompts",
            "Prompts of requests forwarded to vLLM servers, by who made their token ids: "
            "client (ids given), router (a chat rendered by the router), server (a vLLM "
            "server's /tokenize).",
            ["rendered_by"],
            registry=r,
        )
        self.forwarded_prompts_refused = Counter(
            "dualpath_forwarded_prompts_refused",
            "Placements whose DE refused the prompt placed (its server rendered another from "
            "the body) and served the request alone, without the store's KV.",
            registry=r,
        )
        self.ttft = with_vllm_names(
            Histogram(
                "dualpath_time_to_first_token_seconds",
                "Arrival at the server to the first generated token.",
                buckets=_LATENCY_BUCKETS_S,
                registry=r,
            )
        )
        self.time_to_second_token = Histogram(
            "dualpath_time_to_second_token_seconds",
            "First to second generated token: the prefill-to-decode handoff.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.inter_token_latency = with_vllm_names(
            Histogram(
                "dualpath_inter_token_latency_seconds",
                "Between two deliveries of a generation's tokens to the server, after the "
                "first (one engine event each; the first gap is the prefill-to-decode handoff).",
                buckets=_TPOT_BUCKETS_S,
                registry=r,
            )
        )
        self.tpot = with_vllm_names(
            Histogram(
                "dualpath_time_per_output_token_seconds",
                "Mean time between output tokens after the first, per generation.",
                buckets=_TPOT_BUCKETS_S,
                registry=r,
            )
        )
        self.e2e = with_vllm_names(
            Histogram(
                "dualpath_e2e_request_latency_seconds",
                "Arrival at the server to the last token, per generation.",
                buckets=_LATENCY_BUCKETS_S,
                registry=r,
            )
        )
        self.prompt_tokens = with_vllm_names(
            Counter("dualpath_prompt_tokens", "Prompt tokens of finished generations.", registry=r)
        )
        self.cached_prompt_tokens = with_vllm_names(
            Counter(
                "dualpath_cached_prompt_tokens",
                "Prompt tokens whose KV was loaded from the store (store hits, in tokens).",
                registry=r,
            )
        )
        # Not in dualpath_cached_prompt_tokens (the first placement's, vLLM's prefix-cache hits):
        # each placement made again reads its hits again, and the benchmark's hit-KV rule
        # counts those reads.
        self.replaced_hit_tokens = Counter(
            "dualpath_replaced_hit_tokens",
            "Store hits, in prompt tokens, of the placements a front door made again after one "
            "was lost (vLLM servers), of finished generations.",
            registry=r,
        )
        # Generations of requests that name an agent session (X-Session-Id and the like).
        self.session_requests = Counter(
            "dualpath_session_requests",
            "Finished generations of requests naming an agent session.",
            registry=r,
        )
        self.session_prompt_tokens = Counter(
            "dualpath_session_prompt_tokens",
            "Prompt tokens of finished generations of session requests.",
            registry=r,
        )
        self.session_cached_tokens = Counter(
            "dualpath_session_cached_tokens",
            "Prompt tokens of finished generations of session requests whose KV was loaded "
            "from the store (their store hits, in tokens).",
            registry=r,
        )
        self.generation_tokens = with_vllm_names(
            Counter("dualpath_generation_tokens", "Generated tokens.", registry=r)
        )
        self.waiting = with_vllm_names(
            Gauge(
                "dualpath_requests_waiting",
                "Generations accepted by the server without a first token yet (bounded; 429 "
                "beyond the bound).",
                registry=r,
            )
        )
        self.running = with_vllm_names(
            Gauge(
                "dualpath_requests_running",
                "Generations with a first token and no last one yet.",
                registry=r,
            )
        )
        self.links = LinkRateTracker(window_s)
        r.register(
            ClusterCollector(
                snapshot,
                self.links,
                engine_id_to_role=engine_id_to_role,
                link_capacity_bytes_per_s=link_capacity_bytes_per_s,
                store_stats=store_stats,
            )
        )

    def on_generation_finished(
        self,
        finish_reason: str,
        times: GenerationTimes,
        *,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_replaced_hit_tokens: int = 0,
        is_session: bool = False,
    ) -> None:
        """``num_cached_tokens``: the store hits of the generation's (first) placement;
        ``num_replaced_hit_tokens``: those of the placements made again after it;
        ``is_session``: its request names an agent session."""
        self.generations.labels(finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.cached_prompt_tokens.inc(num_cached_tokens)
        if is_session:
            self.session_requests.inc()
            self.session_prompt_tokens.inc(num_prompt_tokens)
            self.session_cached_tokens.inc(num_cached_tokens)
        self.replaced_hit_tokens.inc(num_replaced_hit_tokens)
        self.generation_tokens.inc(times.num_output_tokens)
        if times.first_token_s is None:
            return
        self.ttft.observe(times.first_token_s - times.arrival_s)
        self.e2e.observe(times.finish_s - times.arrival_s)
        if times.second_token_s is not None:
            self.time_to_second_token.observe(times.second_token_s - times.first_token_s)
        if times.num_output_tokens > 1:
            self.tpot.observe(
                (times.finish_s - times.first_token_s) / (times.num_output_tokens - 1)
            )

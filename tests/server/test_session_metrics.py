"""Session metrics without a server: the scheduler's (active sessions, affinity outcomes, the
store's retained evictions) from its snapshot, the requests' from finished generations."""

from __future__ import annotations

from dualpath.cluster.coordinator import ClusterSnapshot
from dualpath.server.metrics import GenerationTimes
from tests.server.test_metrics import make_metrics, samples

TIMES = GenerationTimes(
    arrival_s=0.0, first_token_s=0.5, second_token_s=0.6, finish_s=1.0, num_output_tokens=4
)


def test_session_series_come_from_the_snapshot_and_the_finished_generations() -> None:
    snapshot = ClusterSnapshot(
        time_s=1.0,
        num_live_engines=2,
        num_expected_engines=2,
        num_waiting_prefill=0,
        num_waiting_decode=0,
        num_assigned=5,
        link_bytes={1: {"store_evictions": 9, "store_retained_evictions": 2}},
        num_active_sessions=3,
        session_affinity={"first": 3, "same_de": 4, "moved": 1},
    )
    metrics = make_metrics([snapshot])
    metrics.on_generation_finished(
        "stop", TIMES, num_prompt_tokens=300, num_cached_tokens=256, is_session=True
    )
    metrics.on_generation_finished("stop", TIMES, num_prompt_tokens=100, num_cached_tokens=64)
    values = samples(metrics)
    assert values[("dualpath_sessions_active", ())] == 3
    for outcome, count in {"first": 3, "same_de": 4, "moved": 1}.items():
        assert values[("dualpath_session_affinity_total", (("outcome", outcome),))] == count
    assert values[("dualpath_session_requests_total", ())] == 1
    assert values[("dualpath_session_prompt_tokens_total", ())] == 300
    assert values[("dualpath_session_cached_tokens_total", ())] == 256
    assert values[("dualpath_prompt_tokens_total", ())] == 400  # every request's, as before
    assert values[("dualpath_store_evictions_total", ())] == 9
    assert values[("dualpath_store_retained_evictions_total", ())] == 2

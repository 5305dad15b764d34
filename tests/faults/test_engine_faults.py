"""Engine faults on a multi-host cluster: a decode engine killed mid-run, a decode host cut off.

Expected: requests on the lost engine are placed again once it is declared dead (the engines
are remote: within the heartbeat timeout) and go on from the tokens already sent; every request finishes with the single-node
engine's tokens; new requests are placed on the surviving decode engine; /health and /metrics
report 2 of 3 engines; no process hangs (a cut-off engine exits by itself once the scheduler
is silent).

The fault strikes once the engine decodes and holds requests, seen on /metrics, never after a
fixed time (``strike.py``: it is sure to hit one). The time from the fault to the last answer
is printed, not asserted: the timeouts below are hang guards.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.faults.cluster import MultiHostCluster, random_ids, reference_tokens
from tests.faults.strike import (
    Cut,
    Fault,
    Kill,
    engine_sample,
    snapshot_after_now,
    strike_while_holding,
)

pytest.importorskip("nixl_cu12")

HEARTBEAT_TIMEOUT_S = 4.0
NUM_REQUESTS = 6
# Long enough that the requests on the lost engine have tokens left to go on from elsewhere.
MAX_TOKENS = 1000
LOST_ENGINE_ID = 2  # a decode engine
# Hang guards, far above a loaded 2-core machine's times.
REQUEST_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 120.0


@pytest.fixture
def cluster(test_hosts, gluster_volume, tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    namespace = f"engine-faults-{tmp_path.name}"
    with MultiHostCluster(
        test_hosts.hosts,
        model_dir=tiny_model_dir,
        log_dir=tmp_path,
        store_dir_of=lambda host: gluster_volume.mount_point(host) / namespace,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    ) as started:
        yield started


def run_through_fault(
    cluster: MultiHostCluster, fault: Fault
) -> tuple[list, list[list[int]], float]:
    """Send NUM_REQUESTS at once; once the lost engine decodes and holds some of them, the
    fault. The responses, the reference tokens, and seconds from the fault to the last
    response."""
    prompts = [random_ids(300 + 10 * i, seed=i) for i in range(NUM_REQUESTS)]

    def is_decoding(samples) -> bool:  # its requests have tokens to go on from
        return engine_sample(samples, "dualpath_engine_busy_seconds_total", LOST_ENGINE_ID) > 0

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [
            pool.submit(cluster.complete, p, MAX_TOKENS, timeout=REQUEST_TIMEOUT_S) for p in prompts
        ]
        struck = strike_while_holding(
            cluster.url,
            LOST_ENGINE_ID,
            fault,
            is_ready=is_decoding,
            should_stop=lambda: all(f.done() for f in futures),
        )
        fault_s = time.monotonic()
        assert struck, f"every request ended before engine {LOST_ENGINE_ID} held one"
        responses = [f.result() for f in futures]
        settled_s = time.monotonic() - fault_s
    return responses, reference_tokens(cluster.model_dir, prompts, MAX_TOKENS), settled_s


def check_outcome(cluster: MultiHostCluster, responses, expected, lost_engine_id: int) -> None:
    failed = [r.text for r in responses if r.status_code != 200]
    assert not failed, f"requests failed with engine {lost_engine_id}'s loss: {failed}"
    for response, want in zip(responses, expected, strict=True):
        assert response.json()["choices"][0]["token_ids"] == want
    snapshot_after_now(cluster.url)  # one that counts the last requests placed again
    replaced = cluster.metric("dualpath_scheduler_replaced_requests_total")
    assert replaced >= 1, "the fault hit no request (strike_while_holding should make sure)"
    delays = cluster.metric("dualpath_scheduler_replacement_first_token_seconds_count")
    print(f"{replaced:.0f} requests placed again; {delays:.0f} produced their next token")
    # Serving continues on the surviving decode engine, with correct tokens.
    prompt = random_ids(200, seed=99)
    after = cluster.complete(prompt, 8, timeout=REQUEST_TIMEOUT_S)
    assert after.status_code == 200, after.text
    assert (
        after.json()["choices"][0]["token_ids"]
        == reference_tokens(cluster.model_dir, [prompt], 8)[0]
    )
    health = cluster.health()
    assert (health["num_live_engines"], health["num_expected_engines"]) == (2, 3), health
    assert cluster.metric("dualpath_engines_live") == 2


def test_a_killed_decode_engines_requests_go_on_elsewhere_and_serving_continues(
    cluster: MultiHostCluster,
) -> None:
    victim = cluster.engine_id_to_process[LOST_ENGINE_ID]
    responses, expected, settled_s = run_through_fault(cluster, Kill(lambda: victim.pid))
    print(f"decode engine killed: last response {settled_s:.1f} s after the kill")
    check_outcome(cluster, responses, expected, lost_engine_id=LOST_ENGINE_ID)


def test_a_decode_host_cut_off_its_requests_go_on_and_its_engine_exits(
    cluster: MultiHostCluster, test_hosts
) -> None:
    host = next(s.host for s in cluster.engines if s.engine_id == LOST_ENGINE_ID)
    try:
        responses, expected, settled_s = run_through_fault(cluster, Cut(test_hosts, host))
        print(f"decode host cut off: last response {settled_s:.1f} s after the cut")
        check_outcome(cluster, responses, expected, lost_engine_id=LOST_ENGINE_ID)
        # The isolated engine hears nothing from the scheduler and stops on its own, once its
        # store writes on its cut-off mount have failed (the volume's ping timeout).
        exit_s = time.monotonic()
        cluster.engine_id_to_process[LOST_ENGINE_ID].wait(EXIT_TIMEOUT_S)
        print(
            f"the cut-off engine exited {time.monotonic() - exit_s + settled_s:.1f} s after the cut"
        )
    finally:
        test_hosts.set_link_up(host, True)

"""Engine faults on a multi-host cluster: a decode engine killed mid-run, a decode host cut off.

Expected: requests on the lost engine are placed again once it is declared dead (the engines
are remote: within the heartbeat timeout) and go on from the tokens already sent; every request finishes with the single-node
engine's tokens; new requests are placed on the surviving decode engine; /health and /metrics
report 2 of 3 engines; no process hangs (a cut-off engine exits by itself once the scheduler
is silent).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.faults.cluster import MultiHostCluster, random_ids, reference_tokens
from tests.faults.gluster import PING_TIMEOUT_S

pytest.importorskip("nixl_cu12")

HEARTBEAT_TIMEOUT_S = 4.0
NUM_REQUESTS = 6
# Mid-decode when the fault hits: 300 tokens (6 to 20 ms each) could all end before it.
MAX_TOKENS = 1000
FAULT_AFTER_S = 2.0


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


def run_through_fault(cluster: MultiHostCluster, inject) -> tuple[list, list[list[int]], float]:
    """Send NUM_REQUESTS at once, inject the fault FAULT_AFTER_S later; the responses, the
    reference tokens, and seconds from the fault to the last response."""
    prompts = [random_ids(300 + 10 * i, seed=i) for i in range(NUM_REQUESTS)]
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(cluster.complete, p, MAX_TOKENS, timeout=120) for p in prompts]
        time.sleep(FAULT_AFTER_S)  # let decoding start: the fault must hit running requests
        fault_s = time.monotonic()
        inject()
        responses = [f.result() for f in futures]
        settled_s = time.monotonic() - fault_s
    return responses, reference_tokens(cluster.model_dir, prompts, MAX_TOKENS), settled_s


def check_outcome(cluster: MultiHostCluster, responses, expected, lost_engine_id: int) -> None:
    failed = [r.text for r in responses if r.status_code != 200]
    assert not failed, f"requests failed with engine {lost_engine_id}'s loss: {failed}"
    for response, want in zip(responses, expected, strict=True):
        assert response.json()["choices"][0]["token_ids"] == want
    replaced = cluster.metric("dualpath_scheduler_replaced_requests_total")
    assert replaced >= 1, "the fault hit no request: inject it earlier or send longer requests"
    delays = cluster.metric("dualpath_scheduler_replacement_first_token_seconds_count")
    print(f"{replaced:.0f} requests placed again; {delays:.0f} produced their next token")
    # Serving continues on the surviving decode engine, with correct tokens.
    prompt = random_ids(200, seed=99)
    after = cluster.complete(prompt, 8, timeout=60)
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
    victim = cluster.engine_id_to_process[2]
    responses, expected, settled_s = run_through_fault(
        cluster, lambda: victim.send_signal(signal.SIGKILL)
    )
    print(f"decode engine killed: last response {settled_s:.1f} s after the kill")
    assert settled_s < HEARTBEAT_TIMEOUT_S + 60  # detected, re-placed, decoded to the end
    check_outcome(cluster, responses, expected, lost_engine_id=2)


def test_a_decode_host_cut_off_its_requests_go_on_and_its_engine_exits(
    cluster: MultiHostCluster, test_hosts
) -> None:
    host = next(s.host for s in cluster.engines if s.engine_id == 2)
    try:
        responses, expected, settled_s = run_through_fault(
            cluster, lambda: test_hosts.set_link_up(host, False)
        )
        print(f"decode host cut off: last response {settled_s:.1f} s after the cut")
        assert settled_s < HEARTBEAT_TIMEOUT_S + 60  # detected, re-placed, decoded to the end
        check_outcome(cluster, responses, expected, lost_engine_id=2)
        # The isolated engine hears nothing from the scheduler and stops on its own, once its
        # store writes on its cut-off mount have failed (the volume's ping timeout).
        exit_s = time.monotonic()
        cluster.engine_id_to_process[2].wait(HEARTBEAT_TIMEOUT_S + PING_TIMEOUT_S + 10)
        print(
            f"the cut-off engine exited {time.monotonic() - exit_s + settled_s:.1f} s after the cut"
        )
    finally:
        test_hosts.set_link_up(host, True)

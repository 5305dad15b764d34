"""A router whose engines have not all joined (``dualpath serve --external-engines`` started
before its vLLM servers): /health is 503 naming the roles still missing, generation routes
answer 503 with ``Retry-After`` before reading the body, and it serves once they joined."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx

from dualpath.cluster.coordinator import ClusterSnapshot
from dualpath.protocol import DECODE, PREFILL
from dualpath.server.app import build_app
from dualpath.server.config import ServerConfig
from dualpath.server.context import RETRY_AFTER_S, ServingContext
from tests.server.fake_vllm import HANG_GUARD_S, MODEL, VOCAB_SIZE, FakeCluster, serving


class JoiningCluster(FakeCluster):
    """Engines join when the test says so; ``start`` returns once all have."""

    def __init__(self) -> None:
        super().__init__("", ["", ""])
        self.live = {PREFILL: 0, DECODE: 0}
        self.all_joined = threading.Event()
        self.start_timeout_s: object = "not called"

    def start(self, timeout_s: float | None) -> JoiningCluster:
        self.start_timeout_s = timeout_s
        assert self.all_joined.wait(HANG_GUARD_S), "the test never let the engines join"
        return self

    def join(self, role: str) -> None:
        self.live[role] += 1
        if self.live == {PREFILL: 1, DECODE: 2}:
            self.all_joined.set()

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(
            time_s=time.monotonic(),
            num_live_engines=sum(self.live.values()),
            num_expected_engines=3,
            num_waiting_prefill=0,
            num_waiting_decode=0,
            num_assigned=0,
            num_live_engines_by_role=dict(self.live),
        )


def test_a_router_waits_for_its_engines_and_says_which_roles_are_missing():
    cluster = JoiningCluster()
    config = ServerConfig(
        served_model_name=MODEL, generation_config="none", engine_start_timeout_s=None
    )
    context = ServingContext(config, cluster, SimpleNamespace(vocab_size=VOCAB_SIZE), chat=None)
    ready = threading.Event()
    app = build_app(context, on_fatal=lambda: None, on_ready=ready.set)
    with serving(app) as url, httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
        cluster.join(PREFILL)
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["missing_engines_by_role"] == {DECODE: 2}
        assert "waiting for 2 decode engines to join" in health.json()["reason"]
        # Refused before the body is read: even one we would find invalid is told to retry.
        for body in ({"model": MODEL, "messages": []}, {"not": "a request"}):
            answer = http.post("/v1/chat/completions", json=body)
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == str(RETRY_AFTER_S)
            assert "2 decode engines" in answer.json()["error"]["message"]
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]

        cluster.join(DECODE)
        reason = http.get("/health").json()["reason"]
        assert "waiting for 1 decode engine to join" in reason
        cluster.join(DECODE)
        assert ready.wait(HANG_GUARD_S)
        assert http.get("/health").status_code == 200
        assert "missing_engines_by_role" not in http.get("/health").json()
    assert cluster.start_timeout_s is None  # no deadline was given: none was applied

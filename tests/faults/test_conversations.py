"""32 multi-turn conversations from the agentic trace while engines fail mid-run.

* One host, `dualpath serve` (2P2D, engines restarted when they die): a decode engine, then a
  prefill engine, is SIGKILLed; at the end SIGTERM stops the server with exit code 0 and no
  engine process left behind.
* The multi-host cluster on GlusterFS (1P2D, engines on their own hosts): a decode host is cut
  off, comes back, and its engine is started again there, as its host's supervisor would.

Expected in each: no request lost, no client-visible error, every conversation's tokens those
of an undisturbed run (greedy), the engine back in /health; the time from the fault to the
first re-placed token is measured and printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dualpath.bench.agents import TurnRecord, run_agents
from dualpath.workload.mooncake import load_mooncake_trace, packaged_trace_path
from dualpath.workload.shape import cap_turns, scale_generations
from tests.faults.cluster import MultiHostCluster
from tests.faults.gluster import PING_TIMEOUT_S
from tests.server.serving import API_KEY, MODEL, child_pids, engine_pids, is_running, start_server

pytest.importorskip("nixl_cu12")

NUM_CONVERSATIONS = 32
NUM_TURNS = 3
# A decode engine fails when this many turns have finished: the conversations start together,
# so about as many first turns are still in flight then, on both decode engines.
FAIL_DECODE_AFTER_TURNS = NUM_CONVERSATIONS // 2
# A prefill engine this long after the conversations start, while their first turns queue
# for prefill.
FAIL_PREFILL_AFTER_S = 0.2
HEARTBEAT_TIMEOUT_S = 4.0  # the multi-host cluster's remote engines


@dataclass(frozen=True)
class Target:
    """A serving cluster as the conversations and the checks see it."""

    url: str
    model: str
    api_key: str | None
    health: Callable[[], dict]
    metric: Callable[[str], float]
    num_engines: int


def conversations(model_dir: Path):
    """The trace's first 32 sessions, shaped for the tiny model on a small host: contexts at 1%
    of their length (a few hundred tokens, growing), 3 turns, a fifth of each answer."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workload = load_mooncake_trace(
        packaged_trace_path("agentic_coding_dev"),
        vocab_size=vocab_size,
        max_sessions=NUM_CONVERSATIONS,
        length_scale=0.01,
    )
    return scale_generations(cap_turns(workload, NUM_TURNS), 0.2).sessions


def replay(target: Target, sessions, on_turn=None) -> dict[tuple[int, int], TurnRecord]:
    records = asyncio.run(
        run_agents(
            target.url,
            target.model,
            sessions,
            api_key=target.api_key,
            timeout_s=300,
            on_turn=on_turn,
        )
    )
    return {(r.session, r.turn): r for r in records}


def undisturbed(target: Target, sessions) -> dict[tuple[int, int], TurnRecord]:
    reference = replay(target, sessions)
    assert len(reference) == NUM_CONVERSATIONS * NUM_TURNS
    assert all(r.error is None for r in reference.values())
    return reference


def replay_through_fault(
    target: Target,
    sessions,
    reference,
    engine_id: int,
    fail: Callable[[], None],
    *,
    after_turns: int | None,
) -> float:
    """Replay ``sessions``, calling ``fail`` once ``after_turns`` turns have finished (None:
    ``FAIL_PREFILL_AFTER_S`` after the start), and check the outcome; when the fault was."""
    fault: dict[str, float] = {}
    done: list[TurnRecord] = []
    before = target.metric("dualpath_scheduler_replaced_requests_total")

    def inject() -> None:
        fail()
        fault["at_s"] = time.monotonic()

    def on_turn(record: TurnRecord) -> None:
        done.append(record)
        if after_turns is not None and not fault and len(done) >= after_turns:
            inject()

    start_s = time.monotonic()
    timer = threading.Timer(FAIL_PREFILL_AFTER_S, inject) if after_turns is None else None
    if timer is not None:
        timer.start()
    records = replay(target, sessions, on_turn)
    assert fault, "the run ended before the fault"
    errors = [r.error for r in records.values() if r.error is not None]
    assert errors == [], errors[:3]  # no client-visible error
    assert records.keys() == reference.keys()  # no request lost
    differ = [key for key, r in records.items() if r.output_digest != reference[key].output_digest]
    assert differ == [], f"{len(differ)} turns' tokens differ from the undisturbed run: {differ}"
    replaced = target.metric("dualpath_scheduler_replaced_requests_total") - before
    delay_s = target.metric("dualpath_scheduler_replacement_first_token_max_seconds")
    print(
        f"\nengine {engine_id}'s fault {fault['at_s'] - start_s:.2f} s into the run: "
        f"{replaced:.0f} requests placed again, the longest from a fault to a re-placed "
        f"request's next token {delay_s:.3f} s; the run ended "
        f"{time.monotonic() - fault['at_s']:.1f} s after the fault"
    )
    assert replaced >= 1, "the fault hit no request"
    return fault["at_s"]


def wait_until_back(target: Target, engine_id: int, since_s: float) -> None:
    """Until /health has shown the engine dead and then every engine live."""
    was_dead = False
    while True:
        body = target.health()
        was_dead = was_dead or str(engine_id) in body["dead_engines"]
        if was_dead and body["num_live_engines"] == target.num_engines:
            break
        assert time.monotonic() - since_s < 90, body
        time.sleep(0.02)
    print(f"engine {engine_id} back in /health {time.monotonic() - since_s:.1f} s after the fault")
    assert body["dead_engines"] == {}


def test_conversations_survive_engine_kills_unchanged(tiny_model_dir: Path, tmp_path: Path) -> None:
    sessions = conversations(tiny_model_dir)
    assert len(sessions) == NUM_CONVERSATIONS
    with start_server(tiny_model_dir, tmp_path, "--nodes", "2P2D") as server:

        def metric(name: str) -> float:
            for line in httpx.get(f"{server.url}/metrics").text.splitlines():
                if line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        target = Target(server.url, MODEL, API_KEY, lambda: server.health().json(), metric, 4)
        reference = undisturbed(target, sessions)
        for engine_id, after_turns in ((2, FAIL_DECODE_AFTER_TURNS), (0, None)):  # DE, PE

            def kill(engine_id: int = engine_id) -> None:
                os.kill(engine_pids(server)[engine_id], signal.SIGKILL)

            fault_s = replay_through_fault(
                target, sessions, reference, engine_id, kill, after_turns=after_turns
            )
            wait_until_back(target, engine_id, fault_s)  # restarted under its id
            assert target.health()["engine_restarts"][str(engine_id)] == 1
        engines = child_pids(server.process.pid)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        deadline_s = time.monotonic() + 10
        while any(is_running(pid) for pid in engines):
            assert time.monotonic() < deadline_s, "an engine outlived the server"
            time.sleep(0.05)


def test_conversations_survive_a_decode_host_cut_off_on_the_multi_host_cluster(
    test_hosts, gluster_volume, tiny_model_dir: Path, tmp_path: Path
) -> None:
    sessions = conversations(tiny_model_dir)
    namespace = f"conversations-{tmp_path.name}"
    with MultiHostCluster(
        test_hosts.hosts,
        model_dir=tiny_model_dir,
        log_dir=tmp_path,
        store_dir_of=lambda host: gluster_volume.mount_point(host) / namespace,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    ) as cluster:
        target = Target(cluster.url, "tiny", None, cluster.health, cluster.metric, 3)
        reference = undisturbed(target, sessions)
        host = next(s.host for s in cluster.engines if s.engine_id == 2)
        try:
            fault_s = replay_through_fault(
                target,
                sessions,
                reference,
                2,
                lambda: test_hosts.set_link_up(host, False),
                after_turns=FAIL_DECODE_AFTER_TURNS,
            )
        finally:
            test_hosts.set_link_up(host, True)
        # Cut off, the engine stopped on its own (no scheduler heard); its host's supervisor
        # starts it again and it rejoins the running scheduler.
        cluster.engine_id_to_process[2].wait(HEARTBEAT_TIMEOUT_S + PING_TIMEOUT_S + 30)
        cluster.restart_engine(2)
        wait_until_back(target, 2, fault_s)
        again = replay(target, sessions)  # served with the engine back
        assert all(r.error is None for r in again.values())
        assert {k: r.output_digest for k, r in again.items()} == {
            k: r.output_digest for k, r in reference.items()
        }

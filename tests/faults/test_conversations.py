"""32 multi-turn conversations from the agentic trace through `dualpath serve` (2P2D, engines
restarted when they die) while a decode engine, then a prefill engine, is SIGKILLed mid-run.

Expected in each: no request lost, no client-visible error, every conversation's tokens those
of an undisturbed run (greedy), the killed engine back in /health on its own; the time from
the kill to the first re-placed token is measured and printed. At the end SIGTERM stops the
server with exit code 0 and no engine process left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from dualpath.bench.agents import TurnRecord, run_agents
from dualpath.workload.mooncake import load_mooncake_trace, packaged_trace_path
from dualpath.workload.shape import cap_turns, scale_generations
from tests.server.serving import (
    API_KEY,
    MODEL,
    Server,
    child_pids,
    engine_pids,
    is_running,
    start_server,
)

pytest.importorskip("nixl_cu12")

NUM_CONVERSATIONS = 32
NUM_TURNS = 3
PREFILL_ENGINE_IDS = (0, 1)  # 2P2D
DECODE_ENGINE_IDS = (2, 3)
# A decode engine is killed when this many turns have finished: the conversations start
# together, so about as many first turns are still streaming then, on both decode engines.
KILL_DECODE_AFTER_TURNS = NUM_CONVERSATIONS // 2
# A prefill engine this long after the conversations start, while their first turns queue
# for prefill.
KILL_PREFILL_AFTER_S = 0.2


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


def replay(server: Server, sessions, on_turn=None) -> dict[tuple[int, int], TurnRecord]:
    records = asyncio.run(
        run_agents(server.url, MODEL, sessions, api_key=API_KEY, timeout_s=300, on_turn=on_turn)
    )
    return {(r.session, r.turn): r for r in records}


def metric(server: Server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def replay_through_kill(
    server: Server, sessions, engine_id: int, reference, *, after_turns: int | None
) -> None:
    """Replay ``sessions`` and SIGKILL the engine once ``after_turns`` turns have finished
    (None: ``KILL_PREFILL_AFTER_S`` after the start); check the outcome."""
    killed: dict[str, float] = {}
    done: list[TurnRecord] = []
    before = metric(server, "dualpath_scheduler_replaced_requests_total")

    def watch_health() -> None:
        """When /health showed the engine dead, then back (polled from the kill on)."""
        was_dead = False
        while time.monotonic() - killed["at_s"] < 60:
            body = server.health().json()
            was_dead = was_dead or str(engine_id) in body["dead_engines"]
            if was_dead and body["num_live_engines"] == 4:
                killed["back_s"] = time.monotonic()
                return
            time.sleep(0.02)

    def kill() -> None:
        os.kill(engine_pids(server)[engine_id], signal.SIGKILL)
        killed["at_s"] = time.monotonic()
        threading.Thread(target=watch_health, daemon=True).start()

    def on_turn(record: TurnRecord) -> None:
        done.append(record)
        if after_turns is not None and not killed and len(done) >= after_turns:
            kill()

    timer = threading.Timer(KILL_PREFILL_AFTER_S, kill) if after_turns is None else None
    start_s = time.monotonic()
    if timer is not None:
        timer.start()
    records = replay(server, sessions, on_turn)
    assert killed, "the run ended before the kill"
    errors = [r.error for r in records.values() if r.error is not None]
    assert errors == [], errors[:3]  # no client-visible error
    assert records.keys() == reference.keys()  # no request lost
    differ = [key for key, r in records.items() if r.output_digest != reference[key].output_digest]
    assert differ == [], f"{len(differ)} turns' tokens differ from the undisturbed run: {differ}"
    replaced = metric(server, "dualpath_scheduler_replaced_requests_total") - before
    delay_s = metric(server, "dualpath_scheduler_replacement_first_token_max_seconds")
    print(
        f"\nengine {engine_id} killed {killed['at_s'] - start_s:.2f} s into the run: {replaced:.0f} "
        "requests "
        f"placed again, the longest wait for a re-placed token {delay_s:.3f} s"
    )
    assert replaced >= 1, "the kill hit no request"
    # Back in /health on its own (restarted under its id).
    while "back_s" not in killed:
        assert time.monotonic() - killed["at_s"] < 60, server.health().json()
        time.sleep(0.1)
    print(f"engine {engine_id} back in /health {killed['back_s'] - killed['at_s']:.1f} s after")
    body = server.health().json()
    assert body["engine_restarts"][str(engine_id)] == 1 and body["dead_engines"] == {}


def test_conversations_survive_engine_kills_unchanged(tiny_model_dir: Path, tmp_path: Path) -> None:
    sessions = conversations(tiny_model_dir)
    assert len(sessions) == NUM_CONVERSATIONS
    with start_server(tiny_model_dir, tmp_path, "--nodes", "2P2D") as server:
        reference = replay(server, sessions)  # undisturbed
        assert len(reference) == NUM_CONVERSATIONS * NUM_TURNS
        assert all(r.error is None for r in reference.values())
        replay_through_kill(
            server, sessions, DECODE_ENGINE_IDS[0], reference, after_turns=KILL_DECODE_AFTER_TURNS
        )
        replay_through_kill(server, sessions, PREFILL_ENGINE_IDS[0], reference, after_turns=None)
        engines = child_pids(server.process.pid)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        deadline_s = time.monotonic() + 10
        while any(is_running(pid) for pid in engines):
            assert time.monotonic() < deadline_s, "an engine outlived the server"
            time.sleep(0.05)

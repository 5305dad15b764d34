"""An engine's liveness while one unit of its work outlasts the heartbeat timeout.

A real ``EngineProcess`` loop (the tiny model, the shm transport) whose role is scripted: its
first unit of work blocks until the test lets it go. The engine runs on a thread, over the
real control channel, against a real ``Coordinator``; both read one ``FakeClock``, which only
the test moves. The engine's heartbeat thread sends every heartbeat period of real time, with
the step's time on the fake clock; the test moves the clock on by half a timeout at a time, and
only once a heartbeat was heard at the current time, so no liveness check ever sees more
silence than the test chose, however slow the machine. Waits on real time are hang guards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dualpath.cluster.coordinator import Coordinator
from dualpath.cluster.engine_process import EngineProcess
from dualpath.cluster.engine_processes import EXIT_SCHEDULER_LOST
from dualpath.config import ClusterConfig, EngineProcessConfig, SchedulerConfig
from dualpath.engine.role import RoleEngine, RoleLoad, Send
from dualpath.model.identity import KVIdentity
from dualpath.protocol import PREFILL, Assignment, PeerTable
from tests.cluster.scripted import LAYOUT, SETTLE_BUDGET_S, TOKEN, FakeClock

HEARTBEAT_TIMEOUT_S = 2.0  # the heartbeat period is a quarter of it, in real time
ENGINE_ID = 0


class BlockingRole:
    """A ``RoleEngine`` whose first unit of work blocks until ``release``; idle after."""

    num_kv_blocks = 0
    num_read_bytes = 0
    num_engine_cached_bytes = 0
    transport_bytes: dict[int, tuple[int, int]] = {}  # noqa: RUF012 (never written)
    store = None

    def __init__(self) -> None:
        self.started = threading.Event()
        self.released = threading.Event()
        self._is_done = False

    def add(self, assignment: Assignment) -> None:
        raise ValueError("this engine takes no requests")

    def on_peer_message(self, msg: object) -> None:
        pass

    def connect_peers(self, table: PeerTable) -> None:
        pass

    def cancel(self, request_id: int) -> None:
        pass

    def work(self, send: Send, between_layers: Callable[[], None]) -> bool:
        if self._is_done:
            return False
        self.started.set()
        assert self.released.wait(SETTLE_BUDGET_S * 4), "the test never released the step"
        self._is_done = True
        return True

    def load(self) -> RoleLoad:
        return RoleLoad(0, 0, 0, 0, 0)

    def close(self, flush_timeout_s: float) -> int:
        return 0


class ScriptedEngineProcess(EngineProcess):
    """``dualpath engine``'s loop around a ``BlockingRole``."""

    def _make_role(self, loaded: object, model_config: object, served: object) -> RoleEngine:
        self.blocking_role = BlockingRole()
        return self.blocking_role


class Engine:
    """The scripted engine's loop on a thread; ``exit_code`` once it has returned."""

    def __init__(self, process: ScriptedEngineProcess) -> None:
        self.process = process
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop")
        self._thread.start()

    def _run(self) -> None:
        self.exit_code = self.process.run()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join(SETTLE_BUDGET_S)


@pytest.fixture
def cluster(tiny_model_dir: Path) -> Iterator[tuple[Coordinator, FakeClock, Engine]]:
    clock = FakeClock()
    cluster_config = ClusterConfig(
        num_prefill_nodes=1, num_decode_nodes=1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S
    )
    coordinator = Coordinator(
        cluster_config,
        SchedulerConfig(block_size_tokens=LAYOUT.block_size_tokens, beta_tokens=10_000),
        KVIdentity("", LAYOUT, "float32"),  # "": the engine's KV namespace is not checked
        None,
        TOKEN,
        storage_read_tokens_per_s=1000.0,
        clock=clock,
    )
    config = EngineProcessConfig(
        PREFILL, ENGINE_ID, 0, coordinator.endpoint, tiny_model_dir,
        cluster=cluster_config, transport="shm",
    )  # fmt: skip
    engine = Engine(ScriptedEngineProcess(config, TOKEN, clock=clock))
    try:
        turn_until(coordinator, lambda: engine.process.blocking_role.started.is_set())
        turn_until(coordinator, lambda: coordinator.membership.is_alive(ENGINE_ID))
        yield coordinator, clock, engine
    finally:
        engine.process.blocking_role.released.set()
        coordinator.shutdown()
        turn_until(coordinator, lambda: not engine.is_running)
        engine.join()
        engine.process.close()
        coordinator.close()


def turn_until(coordinator: Coordinator, is_done: Callable[[], bool]) -> None:
    """Turn the coordinator's loop until ``is_done()`` (a hang guard bounds it)."""
    deadline_s = time.monotonic() + SETTLE_BUDGET_S
    while not is_done():
        assert time.monotonic() < deadline_s, "not within the hang guard"
        coordinator.run_once(0.01)


def heard_now(coordinator: Coordinator, clock: FakeClock) -> bool:
    return coordinator.membership.engines[ENGINE_ID].client.last_seen_s == clock.now_s


def test_an_engine_in_a_step_longer_than_the_timeout_is_busy_not_dead(
    cluster: tuple[Coordinator, FakeClock, Engine], caplog: pytest.LogCaptureFixture
) -> None:
    coordinator, clock, engine = cluster
    caplog.set_level(logging.WARNING, logger="dualpath.cluster.membership")
    membership = coordinator.membership
    # Its loop sends nothing while the step runs: only its heartbeat thread speaks.
    while clock.now_s < 3 * HEARTBEAT_TIMEOUT_S:
        clock.now_s += HEARTBEAT_TIMEOUT_S / 2
        turn_until(coordinator, lambda: heard_now(coordinator, clock))
        assert membership.is_alive(ENGINE_ID)
    turn_until(coordinator, lambda: membership.engines[ENGINE_ID].step_s == clock.now_s)
    assert coordinator.snapshot(clock.now_s).busy_engines == {ENGINE_ID: 3 * HEARTBEAT_TIMEOUT_S}
    assert membership.engine_deaths == {} and membership.dead_engines() == {}
    busy_lines = [r.getMessage() for r in caplog.records if "is busy in a step" in r.getMessage()]
    assert len(busy_lines) == 1, busy_lines  # once per step, however many heartbeats say so
    assert "engine 0 is busy in a step of 3.0 s" in busy_lines[0]  # the first past 2.0 s

    engine.process.blocking_role.released.set()  # the step ends: busy no more
    turn_until(coordinator, lambda: coordinator.snapshot(clock.now_s).busy_engines == {})
    assert membership.is_alive(ENGINE_ID) and engine.is_running
    heartbeat = engine.process.heartbeat
    coordinator.shutdown()
    turn_until(coordinator, lambda: not engine.is_running)
    assert engine.exit_code == 0
    assert heartbeat is not None and not heartbeat.is_alive  # stopped with the loop


def test_an_engine_whose_heartbeat_thread_is_gone_is_still_declared_dead(
    cluster: tuple[Coordinator, FakeClock, Engine],
) -> None:
    coordinator, clock, engine = cluster
    heartbeat = engine.process.heartbeat
    assert heartbeat is not None and heartbeat.is_alive
    heartbeat.stop()  # the loop is in its step: nothing speaks for the engine now
    # Heartbeats already on the way may still arrive; the clock moves on past each of them.
    while ENGINE_ID not in coordinator.membership.dead_engines():
        clock.now_s += HEARTBEAT_TIMEOUT_S
        for _ in range(5):
            coordinator.run_once(0.05)
        assert clock.now_s < 1000 * HEARTBEAT_TIMEOUT_S, "heartbeats kept coming"
    assert "silent for" in coordinator.membership.dead_engines()[ENGINE_ID]
    assert coordinator.membership.engine_deaths == {ENGINE_ID: 1}
    # Its step over, the engine finds the scheduler no longer knows it, and leaves.
    engine.process.blocking_role.released.set()
    turn_until(coordinator, lambda: not engine.is_running)
    assert engine.exit_code == EXIT_SCHEDULER_LOST

"""Helpers for driving a Coordinator by hand from scripted engines on real sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from dualpath.cluster.coordinator import Coordinator
from dualpath.config import ClusterConfig, SchedulerConfig
from dualpath.control.channel import ControlClient, Hello, Welcome
from dualpath.kv.hashing import block_keys
from dualpath.kv.layout import KVLayout
from dualpath.kv.store import MemoryKVStore
from dualpath.model.identity import KVIdentity
from dualpath.protocol import DECODE, PREFILL, EngineInfo, EngineReport
from dualpath.types import SamplingParams

# A small store layout and the cluster token the scripted clusters share.
LAYOUT = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=8)
IDENTITY = KVIdentity("0" * 32, LAYOUT, "float32")
TOKEN = "secret"
# For what must come over loopback (a handshake, a round trip): waits end as soon as it has,
# so this only bounds a real hang, however loaded the machine.
SETTLE_BUDGET_S = 30.0


class FakeClock:
    """The coordinator's clock, moved by hand."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def pump(coordinator: Coordinator, action: Callable[[], object]) -> None:
    """Run ``action`` (e.g. a blocking handshake) while the coordinator loop turns."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            coordinator.run_once(0.01)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        action()
    finally:
        stop.set()
        thread.join()


class Inbox:
    """A real control client, welcomed by the coordinator, and what it received, taken out
    by message type."""

    def __init__(self, coordinator: Coordinator, client_id: str) -> None:
        self.client = ControlClient(coordinator.endpoint, client_id, TOKEN)
        pump(coordinator, lambda: self.client.connect(timeout_s=SETTLE_BUDGET_S))
        self.inbox: list[object] = []

    def receive(self, kind: type) -> list:
        """The messages of ``kind`` received so far (all of them, after ``settle``)."""
        self.inbox += self.client.poll(0)
        found = [m for m in self.inbox if isinstance(m, kind)]
        self.inbox = [m for m in self.inbox if not isinstance(m, kind)]
        return found

    def take_until_welcome(self) -> bool:
        """Move what arrived into the inbox; whether the answer to a hello was among it."""
        received = self.client.poll(0)
        self.inbox += [m for m in received if not isinstance(m, Welcome)]
        return any(isinstance(m, Welcome) for m in received)


def settle(coordinator: Coordinator, clients: Iterable[Inbox]) -> None:
    """Turn the coordinator's loop until it has handled every message ``clients`` sent before
    this call, and each client's inbox holds every message the coordinator sent it by then.

    Loopback takes its time (more on a loaded machine), but ZeroMQ keeps each connection's
    order, so a round trip on it marks a point in both directions: each client says hello
    again, and the channel answers ``Welcome`` (the coordinator never sees a hello, and a
    welcomed client stays welcomed). Two rounds: what the loop sends after handling the first
    hellos (its fetches, announcements) arrives before the second answers. One loop turn
    first, so that deaths the clock or an exit brought are declared before: a client they made
    the channel forget is left out, since a hello would welcome it back.
    """
    clients = list(clients)
    coordinator.run_once(0)
    for _ in range(2):
        known = coordinator.server.client_ids
        pending = [c for c in clients if c.client.client_id in known]
        for inbox in pending:
            inbox.client.send(Hello(inbox.client.client_id, TOKEN))
        deadline_s = time.monotonic() + SETTLE_BUDGET_S
        while pending:
            assert time.monotonic() < deadline_s, "the coordinator did not answer a hello"
            coordinator.run_once(0.01)
            pending = [c for c in pending if not c.take_until_welcome()]


class ScriptedEngine(Inbox):
    """An engine that introduced itself (``info``: EngineInfo's optional fields) and reports
    an empty queue when told."""

    def __init__(self, coordinator: Coordinator, engine_id: int, role: str, **info: Any):
        super().__init__(coordinator, f"engine-{engine_id}")
        self.engine_id = engine_id
        blocks = 64 if role == DECODE else 0
        self.client.send(
            EngineInfo(engine_id, role, engine_id, "fake", b"", b"", 16, blocks, **info)
        )

    def report(self) -> None:
        self.client.send(EngineReport(self.engine_id, 0, 0, 64, 0, {}, 0))


@contextmanager
def one_request_on_1p1d(
    prompt: Sequence[int],
    num_hit_blocks: int,
    *,
    read_path: str,
    pe_info: dict[str, Any] | None = None,
    de_info: dict[str, Any] | None = None,
    **cluster: Any,
) -> Iterator[tuple[Coordinator, ScriptedEngine, ScriptedEngine]]:
    """A 1P1D cluster (``cluster``: ClusterConfig's optional fields) whose store holds the
    prompt's first ``num_hit_blocks`` blocks, after one request for ``prompt`` was submitted
    and placed: the coordinator, its PE and its DE, closed on exit."""
    store = MemoryKVStore(LAYOUT, IDENTITY.fingerprint)
    for key in block_keys(list(prompt[: 4 * num_hit_blocks]), 4, IDENTITY.fingerprint):
        store.write(key, bytes(LAYOUT.full_block_bytes))
    coordinator = Coordinator(
        ClusterConfig(num_prefill_nodes=1, num_decode_nodes=1, heartbeat_timeout_s=5.0, **cluster),
        SchedulerConfig(block_size_tokens=4, beta_tokens=10_000, read_path=read_path),
        IDENTITY,
        store,
        TOKEN,
        storage_read_tokens_per_s=1000.0,
        clock=FakeClock(),
    )
    engines: list[ScriptedEngine] = []
    try:
        engines.append(ScriptedEngine(coordinator, 0, PREFILL, **(pe_info or {})))
        engines.append(ScriptedEngine(coordinator, 1, DECODE, **(de_info or {})))
        settle(coordinator, engines)
        coordinator.submit(list(prompt), SamplingParams(max_tokens=2))
        for engine in engines:
            engine.report()
        settle(coordinator, engines)
        yield coordinator, engines[0], engines[1]
    finally:
        coordinator.close()
        for engine in engines:
            engine.client.close()

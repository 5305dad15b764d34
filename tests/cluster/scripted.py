"""Helpers for driving a Coordinator by hand from scripted engines on real sockets."""

from __future__ import annotations

import threading
from collections.abc import Callable

from dualpath.cluster.coordinator import Coordinator
from dualpath.control.channel import ControlClient
from dualpath.kv.layout import KVLayout
from dualpath.model.identity import KVIdentity

# A small store layout and the cluster token the scripted clusters share.
LAYOUT = KVLayout(num_layers=2, block_size_tokens=4, bytes_per_token_per_layer=8)
IDENTITY = KVIdentity("0" * 32, LAYOUT, "float32")
TOKEN = "secret"


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


def spin(coordinator: Coordinator, n: int = 20) -> None:
    for _ in range(n):
        coordinator.run_once(0.01)


class Inbox:
    """What a scripted client received, taken out by message type."""

    client: ControlClient

    def __init__(self) -> None:
        self.inbox: list[object] = []

    def receive(self, kind: type) -> list:
        self.inbox += self.client.poll(0.2)
        found = [m for m in self.inbox if isinstance(m, kind)]
        self.inbox = [m for m in self.inbox if not isinstance(m, kind)]
        return found

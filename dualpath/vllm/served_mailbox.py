"""The two local ZeroMQ sockets between the halves of our connector in a vLLM server: the
engine beside vLLM's worker (``served.ServedEngine``) and the scheduler side in vLLM's engine
core (``served_scheduler.ServedScheduler``), named after vLLM's engine id."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import msgpack
import zmq


class Mailbox:
    """One side's end of the two sockets between the engine and the scheduler side: it
    receives on its own socket and sends to the other's (msgpack lists ``[kind, ...]``)."""

    def __init__(self, vllm_engine_id: str, *, own: str, other: str) -> None:
        self._context = zmq.Context.instance()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.bind(_endpoint(vllm_engine_id, own))
        self._outbox = self._context.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.connect(_endpoint(vllm_engine_id, other))
        self._send_lock = threading.Lock()

    def send(self, *message: Any) -> None:
        with self._send_lock:
            self._outbox.send(msgpack.packb(message))

    def receive(self, timeout_s: float) -> list[list[Any]]:
        """What arrived, waiting at most ``timeout_s`` for the first (None: for ever)."""
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if not self._inbox.poll(timeout_ms):
            return []
        messages = []
        while True:
            try:
                messages.append(msgpack.unpackb(self._inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return messages


def _endpoint(vllm_engine_id: str, side: str) -> str:
    return f"ipc://{Path(tempfile.gettempdir()) / f'dualpath-{vllm_engine_id[:18]}-{side}'}"

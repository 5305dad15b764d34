"""An engine's heartbeat: a thread of its own that tells the scheduler the engine is alive,
whatever the engine's loop is doing.

The loop's messages (reports, tokens) stop while it runs one unit of work, and one unit can
outlast the heartbeat timeout: a 4,000-token vLLM prefill on a loaded 2-core CPU took 11 s
against the 10 s default, and the engine was declared dead while alive. This thread sends an
``EngineHeartbeat`` every heartbeat period (the timeout / ``HEARTBEATS_PER_TIMEOUT``) whatever
the loop does, with how long the unit of work in progress has run (``step_s``): the scheduler
keeps a busy engine alive and says it is busy. Only a silent engine (its process stopped or
gone, this thread gone) is declared dead.

    heartbeat = HeartbeatThread(endpoint, "engine-3", token, 3, period_s=2.5, step_s=...)
    heartbeat.start()   # after the loop's hello: the scheduler knows the client id
    ...
    heartbeat.stop()    # before the loop's client closes; a new one for a new hello

The thread speaks over a ZeroMQ socket of its own, which it creates, uses and closes: a
send-only ``ControlClient`` of the engine's client id (``Hello.is_send_only``), whose messages
the scheduler counts as the engine's while it goes on sending to the loop's socket.
NOTE(liveness): not the loop's socket behind a lock. ZeroMQ sockets are not thread-safe, so a
lock would have to cover every send, receive and poll on it, and the loop's poll waits up to a
fetch interval: it would wait outside the lock on the socket's ``ZMQ_FD``, which is
edge-triggered and drained by a send from the other thread (a lost wake-up, a message seen
one poll late). One socket per thread is ZeroMQ's own rule, and vLLM's (its engine core hands
each socket to one thread and passes messages over queues). The cost is one more connection
per engine at the scheduler, and a heartbeat every period from each engine (at 48P96D,
1,152 engines at the default 10 s timeout: 461 a second, beside 14,400 reports).

Heartbeats skip the engine's CNIC arbiter (``TrafficManager``): tens of bytes a period, and
they must not wait behind KV traffic. A stuck GIL-holding call would silence this thread too;
torch and ZeroMQ release the GIL while they work.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dualpath.control.channel import ControlClient
from dualpath.protocol import EngineHeartbeat

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0  # the thread wakes from its wait at once; this only bounds a hang


class HeartbeatThread:
    """Sends ``EngineHeartbeat(engine_id, step_s())`` every ``period_s`` until ``stop``.

    ``step_s`` is called on this thread: it must only read (the loop's step start, a float).
    One start, one stop: a client that says hello again (a served engine rejoining a
    restarted scheduler) gets a new ``HeartbeatThread``.
    """

    def __init__(
        self,
        endpoint: str,
        client_id: str,
        token: str,
        engine_id: int,
        *,
        period_s: float,
        step_s: Callable[[], float],
    ) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self._endpoint, self._client_id, self._token = endpoint, client_id, token
        self.engine_id = engine_id
        self.period_s = period_s
        self._step_s = step_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"dualpath-heartbeat-{engine_id}", daemon=True
        )

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop sending and close the socket; returns once the thread has ended. Idempotent."""
        self._stopping.set()
        if not self._thread.is_alive():
            return
        self._thread.join(_STOP_TIMEOUT_S)
        if self._thread.is_alive():  # a socket call that hangs: it dies with the process
            logger.error("engine %d's heartbeat thread did not stop", self.engine_id)

    def _run(self) -> None:
        client = ControlClient(self._endpoint, self._client_id, self._token, is_send_only=True)
        try:
            client.say_hello()
            while not self._stopping.wait(self.period_s):
                # Drop the answers (its Welcome; a Rejected): the loop's socket hears the
                # same, and its loop acts on them.
                client.poll(0)
                client.send(EngineHeartbeat(self.engine_id, self._step_s()))
        except Exception:  # a bug: the engine goes silent and is declared dead, visibly
            logger.exception("engine %d's heartbeat thread failed", self.engine_id)
        finally:
            client.close()

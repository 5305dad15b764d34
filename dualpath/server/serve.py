"""Run the API on uvicorn until SIGINT/SIGTERM, then stop everything cleanly.

    exit_code = run_server(context)     # blocks; ``dualpath serve`` calls it

On the first SIGINT or SIGTERM: refuse new requests (503), end every request in flight (its
engines free its buffers and KV), let uvicorn close the connections, then close the cluster
(engines flush their pending store writes and exit) and return 0. A second SIGINT makes
uvicorn stop without waiting for connections. Returns 1 if the cluster could not start.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from dualpath.server.app import build_app
from dualpath.server.context import ServingContext

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, which also ends in-flight requests as soon as a signal arrives
    (uvicorn alone would wait for them to finish, streams included)."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        super().handle_exit(sig, frame)


def run_server(context: ServingContext, on_ready: Callable[[], None] | None = None) -> int:
    config = context.config
    has_failed = False

    def on_fatal() -> None:
        nonlocal has_failed
        has_failed = True
        server.should_exit = True

    def on_signal() -> None:
        # Runs in a signal handler (main thread, between bytecodes): only schedule work.
        if context.loop is not None and not context.loop.is_closed():
            context.loop.call_soon_threadsafe(context.stop_serving, "the server is shutting down")

    app = build_app(context, on_fatal=on_fatal, on_ready=on_ready)
    server = _GracefulServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            lifespan="on",
            log_config=None,  # the process's logging config (cli.py) applies
            access_log=False,  # RequestContextMiddleware logs each request with its id
            timeout_graceful_shutdown=config.shutdown_timeout_s,
        ),
        on_signal,
    )
    # uvicorn re-raises the signal it caught once it has stopped, to run the previous
    # handler: make that handler a no-op, so a clean stop exits 0 (not killed by SIGTERM).
    previous = {sig: signal.signal(sig, _ignore) for sig in _SIGNALS}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        context.cluster.close()  # idempotent; the lifespan has closed it unless start failed
    return 1 if has_failed else 0


def _ignore(sig: int, frame: FrameType | None) -> None:
    logger.debug("signal %d after shutdown ignored", sig)

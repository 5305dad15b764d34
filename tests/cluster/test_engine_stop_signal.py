"""SIGTERM's handler in an engine process (``engine_process.stop_handler``): the handler is
called directly, as Python calls it on the main thread; no signal is sent."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from dualpath.cluster.engine_process import _Stop, stop_handler


@pytest.fixture
def handlers() -> Iterator[None]:
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.usefixtures("handlers")
def test_the_first_stop_signal_stops_the_loop_and_later_ones_are_ignored() -> None:
    engine = SimpleNamespace(is_leaving=False)
    stop = stop_handler(lambda: engine)
    with pytest.raises(_Stop, match="signal 15"):
        stop(signal.SIGTERM, None)
    # The supervisor's SIGTERM is often followed by the parent-death one: the kernel ignores it.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.mark.usefixtures("handlers")
def test_a_stop_signal_while_the_engine_leaves_raises_nothing() -> None:
    """Raised inside the way out, a ``_Stop`` could land between a lock's acquire and its
    ``with`` (the heartbeat thread's stop event) and leave the engine's close hanging."""
    engine = SimpleNamespace(is_leaving=True)
    stop_handler(lambda: engine)(signal.SIGTERM, None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


@pytest.mark.usefixtures("handlers")
def test_a_stop_signal_before_the_engine_is_built_stops_it() -> None:
    with pytest.raises(_Stop):
        stop_handler(lambda: None)(signal.SIGTERM, None)

"""Faults that strike an engine while it holds requests: observed, never timed.

    struck = strike_while_holding(url, 2, Kill(lambda: pid_of_engine_2), is_ready=...)

A fault test must hit requests, but a fault fired from a timer can land before the engine
has any or after it has finished them all. The server's /metrics says how many requests in
flight each engine's loss would place again (``dualpath_engine_requests``, from the
scheduler's snapshot, republished every 0.1 s). What it shows may be gone a moment later, so
the fault first *freezes* the engine (SIGSTOP, or its link cut: nothing it does from then on
reaches the scheduler), then reads a snapshot taken after the freeze, and strikes only if
that one still shows the engine holding requests; otherwise it thaws the engine and watches
again. A frozen engine keeps what it holds until it is killed or declared dead, so the fault
hits at least one request on any machine, however slow.

A snapshot is known to be taken after the freeze when ``dualpath_scheduler_reports_total``
differs from a scrape begun after it: that scrape returned the latest snapshot published
then, so a snapshot with another count was published (and taken) later. That is not enough:
the scheduler loop takes a snapshot at the end of an iteration whose receive may have run
before the freeze, so what the engine sent just before it (its requests' last tokens) may
still be unread. The check waits for the count to change twice: the later snapshot ends an
iteration that began after the earlier one, and so received after the freeze.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dualpath.testbed.hosts import Host, TestHosts

# Hang guards only: every wait here ends on what it waits for.
WATCH_TIMEOUT_S = 600.0
WAIT_TIMEOUT_S = 120.0
POLL_S = 0.05
HTTP_TIMEOUT_S = 60.0

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def read_metrics(url: str) -> Samples:
    """Every sample of the server's /metrics (no API key needed): (name, labels) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def engine_sample(samples: Samples, name: str, engine_id: int) -> float:
    """An engine's sample of a per-engine metric (labelled ``engine`` and ``role``), or 0."""
    for (sample_name, labels), value in samples.items():
        if sample_name == name and ("engine", str(engine_id)) in labels:
            return value
    return 0.0


def num_held(samples: Samples, engine_id: int) -> int:
    """Requests in flight that the engine's loss would place again, per this scrape."""
    return int(engine_sample(samples, "dualpath_engine_requests", engine_id))


def _num_reports(samples: Samples) -> float:
    return samples[("dualpath_scheduler_reports_total", ())]


class Fault(Protocol):
    def freeze(self) -> None:
        """Stop everything the engine does from reaching the scheduler."""

    def thaw(self) -> None:
        """Undo ``freeze``: the engine goes on as if nothing happened."""

    def strike(self) -> None:
        """The fault itself, on the frozen engine (nothing more when freezing is the fault)."""


class Kill:
    """SIGKILL, preceded by SIGSTOP (every thread stopped: the engine does nothing more)."""

    def __init__(self, pid_of: Callable[[], int]) -> None:
        self._pid_of = pid_of  # asked at each freeze: a restarted engine has a new pid
        self._pid: int | None = None

    def freeze(self) -> None:
        self._pid = self._pid_of()
        os.kill(self._pid, signal.SIGSTOP)
        _wait_until_stopped(self._pid)

    def thaw(self) -> None:
        os.kill(self._frozen_pid(), signal.SIGCONT)

    def strike(self) -> None:
        os.kill(self._frozen_pid(), signal.SIGKILL)

    def _frozen_pid(self) -> int:
        if self._pid is None:
            raise RuntimeError("Kill.thaw or Kill.strike before Kill.freeze: a test bug")
        return self._pid


class Cut:
    """A host's link cut: what its engine sends no longer reaches the scheduler. The cut is
    the fault; the test restores the link when it is done."""

    def __init__(self, test_hosts: TestHosts, host: Host) -> None:
        self._test_hosts = test_hosts
        self._host = host

    def freeze(self) -> None:
        self._test_hosts.set_link_up(self._host, False)

    def thaw(self) -> None:
        self._test_hosts.set_link_up(self._host, True)

    def strike(self) -> None:
        pass


def strike_while_holding(
    url: str,
    engine_id: int,
    fault: Fault,
    *,
    is_ready: Callable[[Samples], bool] = lambda _: True,
    should_stop: Callable[[], bool] = lambda: False,
    timeout_s: float = WATCH_TIMEOUT_S,
) -> bool:
    """Once ``is_ready`` (given each scrape) and the engine holds requests, freeze it; strike
    if a snapshot of what the scheduler received after the freeze shows it still holding some
    (True), else thaw it and watch again. False if ``should_stop`` (the load ended) comes first."""
    deadline_s = time.monotonic() + timeout_s
    while not should_stop():
        assert time.monotonic() < deadline_s, f"engine {engine_id} held no request in {timeout_s} s"
        samples = read_metrics(url)
        if not (is_ready(samples) and num_held(samples, engine_id) > 0):
            time.sleep(POLL_S)
            continue
        fault.freeze()
        snapshot_after_now(url)
        if num_held(snapshot_after_now(url), engine_id) > 0:
            fault.strike()
            return True
        fault.thaw()
    return False


def snapshot_after_now(url: str) -> Samples:
    """A scrape whose snapshot was taken after this call began (see the module docstring)."""
    num_reports_before = _num_reports(read_metrics(url))
    deadline_s = time.monotonic() + WAIT_TIMEOUT_S
    while True:
        samples = read_metrics(url)
        if _num_reports(samples) != num_reports_before:
            return samples
        assert time.monotonic() < deadline_s, f"no new scheduler snapshot in {WAIT_TIMEOUT_S} s"
        time.sleep(POLL_S / 5)


def _wait_until_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped (a thread in a system call stops when it
    returns from it)."""
    deadline_s = time.monotonic() + WAIT_TIMEOUT_S
    while not all(_thread_state(task) in "TtZX" for task in Path(f"/proc/{pid}/task").iterdir()):
        assert time.monotonic() < deadline_s, f"process {pid} not stopped in {WAIT_TIMEOUT_S} s"
        time.sleep(0.01)


def _thread_state(task: Path) -> str:
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:  # the thread is gone
        return "X"

"""Scheduler over the wire: the real scheduler process against simulated group leaders (issue #4).

Run: ``dualpath bench scheduler --wire [--duration-s 10] [--requests-per-s 2350] [--json OUT]``
(or ``python -m dualpath.bench.scheduler_bench --wire`` with the same flags).

What runs where::

    this process                               driver process (spawned, bench.wire_leaders)
    main thread: Poisson arrivals into         144 simulated group leaders (48P96D, one node
      Coordinator.submit            <--ZMQ-->    per group), one ControlClient each: hello with
    loop thread: Coordinator.run_once  TCP       the cluster token, GroupInfo, then every fetch
      (the scheduler process's code):  loopback  interval a GroupReport of all 8 engines, after
      policy, reports, Assignments               taking in what arrived; Assignments change the
      to the PE's and the DE's leader            engines' seq_e, tok_e, free KV blocks and
                                                 read_q until the request "finishes"

A *placement* is one request assigned to a (PE, DE) pair: ``submit``, a PE group's fetch
(Algorithm 1), a DE group's fetch (phase 1 and 2, read plan) and the ``Assignment`` sent to both
leaders. Over ``duration_s`` after a warm-up the bench takes ``placements_per_s`` (wall clock)
and ``cpu_s_per_placement``: the CPU time of the loop thread alone (``pthread_getcpuclockid``)
over the placements. That CPU time covers everything the loop does, reports included, so
``cores_at_2350_rps`` = 2,350 x ``cpu_s_per_placement`` is the scheduler's load only when the run
placed about 2,350 requests/s (compare ``placements_per_s``); ``loop_cores`` is the load it had.
It is also the load at the report rate the driver managed, which on a small machine falls short
of the target (``group_reports_per_s``). So before the window the loop runs
``REPORTS_ONLY_S`` with nothing submitted: its CPU over the reports it took in is
``cpu_s_per_report``; the window's CPU beyond its reports at that price, over its placements,
is ``cpu_s_per_placement_beyond_reports``; and ``projected_cores_at_2350_rps`` prices every
leader on schedule (``group_reports_per_s_target``) plus 2,350 placements/s with the two. An
estimate, and a rough one: a report's price depends on how many a turn takes in. It carries
its share of the turn (one poll each ``loop_turn_s``: dear in a small cluster), and ZeroMQ
hands over a backlog much more cheaply a message than a trickle, so a window in which the
loop fell behind (``loop_turns_per_s`` far below 1 / ``loop_turn_s``) spends less a report
than the reports-only stretch, where it kept up (the figure beyond reports is then 0).

The driver's CPU is another process's and never counted; the submitting thread's (copying the
token ids and hashing the prompt's blocks in ``submit``) is ``submit_cpu_s_per_request``.

Every leader reports every ``fetch_interval_s`` (SPEC §6: 10 ms), staggered evenly over the
interval, whether or not anything changed: 14,400 GroupReports/s at 48P96D. Its engines' link
counters ride along once per ``link_bytes_interval_s``. Requests follow SPEC §7's 64K workload
(context ~32.7K tokens, ~429 new, ~176 generated, ~98.7% of the prompt a store hit);
``mean_context_tokens`` scales the context, and with it the token ids every Assignment carries.
Arrivals, lengths and token ids come from one seed. Not simulated: the per-request relays
(DecodeReady, PrefillDone, streamed TokenUpdates) that real engines send through the scheduler.

The loop takes in its messages once per ``loop_turn_s`` (0: it wakes for every message, as a
plain ``run_once`` loop does). Submissions pause while ``MAX_REQUESTS_IN_FLIGHT`` requests have
not reached both leaders, so a side that falls behind slows the run (``requests_per_s_submitted``
then falls short of the target) rather than piling up messages.

Read the figures with the machine: the driver needs about a core of its own to send 14,400
reports/s (``group_reports_per_s`` says what it managed), and on a 2-CPU machine it competes
with the loop. The loop's CPU covers the reports it was sent, so a run whose driver fell short
of the target rate understates the scheduler's load at it. ``--profile`` profiles the loop
thread over the timed window only (not the join).
"""

from __future__ import annotations

import cProfile
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dualpath.bench.hardware import hardware_info
from dualpath.bench.paper_cluster import (
    PAPER_REQUESTS_PER_S,
)
from dualpath.bench.wire_leaders import (
    BLOCK_SIZE_TOKENS,
    PREFILL_TOKENS_PER_S,
    DriverConfig,
    run_driver,
)
from dualpath.bench.wire_workload import (
    MEAN_APPEND_TOKENS,
    MEAN_CONTEXT_TOKENS,
    DrawnHitStore,
    Workload,
    make_cluster,
)
from dualpath.cluster.coordinator import Coordinator
from dualpath.config import ClusterConfig, SchedulerConfig

logger = logging.getLogger(__name__)

WARMUP_S = 1.0  # after the driver settled: timing starts with every leader on its schedule
REPORTS_ONLY_S = 2.0  # then the loop with reports alone, to price a report (see above)
# Requests submitted whose Assignment has not reached both leaders yet. Submissions pause at this
# many, so a scheduler or driver that falls behind slows the run down instead of queueing
# without bound (ZeroMQ drops what is over its queues' limits); --requests-per-s 0 keeps it full.
MAX_REQUESTS_IN_FLIGHT = 2_000


class _CoordinatorLoop:
    """``Coordinator.run_once`` in a thread of its own, whose CPU time is read from outside.

    With ``turn_s`` > 0 the loop runs in turns: take in everything queued, then sleep out the
    rest of the turn, so one wake-up serves many reports (a report waits at most ``turn_s``).
    With 0 it polls with a 1 ms timeout and wakes for every message, as a plain serving loop
    does; on the VM we measured on, each wake-up cost more CPU than handling a report.
    """

    def __init__(self, coordinator: Coordinator, turn_s: float, profile_path: Path | None) -> None:
        self._coordinator = coordinator
        self._turn_s = turn_s
        self._profile_path = profile_path
        self._stop = threading.Event()
        self._started = threading.Event()
        self._is_profiling = threading.Event()
        self._clock_id = 0
        self.num_turns = 0
        self._thread = threading.Thread(target=self._run, name="coordinator-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        self._clock_id = time.pthread_getcpuclockid(threading.get_ident())
        self._started.set()
        # This thread's CPU time, not wall time: waiting in poll costs nothing.
        profiler = None if self._profile_path is None else cProfile.Profile(time.thread_time)
        is_profiling = False
        while not self._stop.is_set():
            if profiler is not None and self._is_profiling.is_set() != is_profiling:
                is_profiling = not is_profiling  # a profiler covers the thread that enables it
                if is_profiling:
                    profiler.enable()
                else:
                    profiler.disable()
            turn_start_s = time.monotonic()
            self._coordinator.run_once(0.0 if self._turn_s else 0.001)
            self.num_turns += 1
            if self._turn_s:
                time.sleep(max(0.0, turn_start_s + self._turn_s - time.monotonic()))
        if profiler is not None:
            if is_profiling:
                profiler.disable()
            profiler.dump_stats(self._profile_path)

    def set_profiling(self, is_on: bool) -> None:
        """Profile the loop from its next turn on (``is_on``) or stop (with ``profile_path``)."""
        if is_on:
            self._is_profiling.set()
        else:
            self._is_profiling.clear()

    def cpu_s(self) -> float:
        return time.clock_gettime(self._clock_id)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True, slots=True)
class _ReportsOnly:
    """A stretch before the window with nothing submitted: the loop's CPU goes to reports."""

    start_s: float  # time.monotonic(), like the driver's report times
    end_s: float
    loop_cpu_s: float

    @classmethod
    def measure(cls, loop: _CoordinatorLoop, duration_s: float) -> _ReportsOnly:
        start_s, start_cpu_s = time.monotonic(), loop.cpu_s()
        time.sleep(duration_s)
        return cls(start_s, time.monotonic(), loop.cpu_s() - start_cpu_s)


@dataclass(frozen=True, slots=True)
class _Window:
    """The timed part of a run."""

    start_s: float  # time.monotonic(), the same clock in the driver process (Linux)
    end_s: float
    loop_cpu_s: float
    num_loop_turns: int
    num_placed: int
    num_submitted: int
    submit_cpu_s: float


def run_wire_bench(
    *,
    num_prefill_nodes: int = 48,
    num_decode_nodes: int = 96,
    engines_per_node: int = 8,
    nodes_per_group: int = 1,
    requests_per_s: float = PAPER_REQUESTS_PER_S,
    duration_s: float = 10.0,
    fetch_interval_s: float = 0.010,
    link_bytes_interval_s: float = 1.0,
    loop_turn_s: float = 0.002,
    mean_context_tokens: int = MEAN_CONTEXT_TOKENS,
    scheduler: str = "dualpath",
    read_path: str = "dual",
    seed: int = 0,
    profile_path: Path | None = None,
) -> dict:
    """Drive a Coordinator from simulated leaders in a spawned process; a JSON-able dict.

    ``requests_per_s`` 0 saturates (keeps ``MAX_REQUESTS_IN_FLIGHT``). The keys are
    the module docstring's figures, the message counts and sizes, the workload as drawn, the
    cluster, the seed and the hardware. ``is_consistent``: every submitted request reached
    exactly one PE leader and one DE leader, once each, with the same pair, and every engine
    was alive at the end.
    """
    _check_rates(duration_s, fetch_interval_s, requests_per_s, loop_turn_s, mean_context_tokens)
    cluster = ClusterConfig(
        num_prefill_nodes=num_prefill_nodes,
        num_decode_nodes=num_decode_nodes,
        engines_per_node=engines_per_node,
        nodes_per_group=nodes_per_group,
        # Joining 144 leaders takes seconds here (every PeerTable lists 1,152 engines); the
        # liveness check must not fire before their first reports.
        heartbeat_timeout_s=30.0,
    )
    scheduler_config = SchedulerConfig(
        scheduler=scheduler,
        read_path=read_path,
        block_size_tokens=BLOCK_SIZE_TOKENS,
        prefill_tokens_per_s=PREFILL_TOKENS_PER_S,
        fetch_interval_s=fetch_interval_s,
    )
    coordinator, store, driver_config = make_cluster(
        cluster, scheduler_config, link_bytes_interval_s
    )
    workload = Workload(np.random.default_rng(seed), mean_context_tokens)
    loop = _CoordinatorLoop(coordinator, loop_turn_s, profile_path)
    window, reports_only, driver_stats = _drive(
        coordinator, store, driver_config, workload, loop, requests_per_s, duration_s
    )
    result = _result(window, reports_only, workload, driver_stats, coordinator, cluster)
    result.update(
        requests_per_s_target=requests_per_s,
        fetch_interval_s=fetch_interval_s,
        link_bytes_interval_s=link_bytes_interval_s,
        loop_turn_s=loop_turn_s,
        seed=seed,
        profile=None if profile_path is None else str(profile_path),
        hardware=hardware_info(),
    )
    logger.info("wire bench: %.0f placements per CPU-second", result["placements_per_cpu_s"])
    return result


def _check_rates(
    duration_s: float,
    fetch_interval_s: float,
    requests_per_s: float,
    loop_turn_s: float,
    mean_context_tokens: int,
) -> None:
    """``ValueError`` for times and rates ``run_wire_bench`` cannot run with."""
    if duration_s <= 0 or fetch_interval_s <= 0 or requests_per_s < 0 or loop_turn_s < 0:
        raise ValueError(
            f"duration_s and fetch_interval_s must be > 0, requests_per_s and loop_turn_s >= 0, "
            f"got {duration_s}, {fetch_interval_s}, {requests_per_s}, {loop_turn_s}"
        )
    if mean_context_tokens <= MEAN_APPEND_TOKENS:
        raise ValueError(
            f"mean_context_tokens must exceed the {MEAN_APPEND_TOKENS} appended tokens, got "
            f"{mean_context_tokens}"
        )


def _drive(
    coordinator: Coordinator,
    store: DrawnHitStore,
    driver_config: DriverConfig,
    workload: Workload,
    loop: _CoordinatorLoop,
    requests_per_s: float,
    duration_s: float,
) -> tuple[_Window, _ReportsOnly, dict[str, Any]]:
    """Start ``loop`` and the leaders' process, wait for every engine to join, measure the
    loop on reports alone, submit ``workload`` for ``duration_s`` and wait for every request
    to be placed and taken in; stop both. The submission window, the reports-only figures and
    the driver's statistics."""
    context = mp.get_context("spawn")
    stop, is_settled, results = context.Event(), context.Event(), context.Queue()
    num_taken_in = context.Value("q", 0, lock=False)  # Assignments the leaders took in
    loop.start()
    driver = context.Process(
        target=run_driver,
        args=(driver_config, stop, is_settled, num_taken_in, results),
        name="leaders",
    )
    driver.start()
    try:
        _wait_until(coordinator.is_ready, timeout_s=120.0, what="every engine to join")
        _wait_until(is_settled.is_set, timeout_s=120.0, what="the leaders to settle")
        time.sleep(WARMUP_S)
        reports_only = _ReportsOnly.measure(loop, REPORTS_ONLY_S)

        def num_in_flight() -> int:
            return workload.num_submitted - num_taken_in.value // 2

        window = _submit_for(
            coordinator, store, workload, loop, requests_per_s, duration_s, num_in_flight
        )
        _wait_until(
            lambda: coordinator.num_assigned >= workload.num_submitted,
            timeout_s=60.0,
            what="every submitted request to be placed",
        )
        # Then for the leaders to take every Assignment in (both sides), so that a driver
        # slowed down by a busy machine is not stopped with some still on the way. One that
        # never arrives shows as is_consistent False after the timeout.
        _wait_until(
            lambda: num_taken_in.value >= 2 * workload.num_submitted,
            timeout_s=30.0,
            what="the leaders to take in every Assignment",
            is_required=False,
        )
        stop.set()
        driver_stats = results.get(timeout=120.0)
        driver.join(timeout=30.0)
    finally:
        stop.set()
        if driver.is_alive():
            driver.kill()
        loop.stop()
        coordinator.close()
    return window, reports_only, driver_stats


def _submit_for(
    coordinator: Coordinator,
    store: DrawnHitStore,
    workload: Workload,
    loop: _CoordinatorLoop,
    requests_per_s: float,
    duration_s: float,
    num_in_flight: Callable[[], int],
) -> _Window:
    """Submit at ``requests_per_s`` (Poisson; 0 = keep a backlog) for ``duration_s``, timed."""
    submit_cpu_s = 0.0
    start_s, start_cpu_s, start_turns = time.monotonic(), loop.cpu_s(), loop.num_turns
    start_placed = coordinator.num_assigned
    next_arrival_s = start_s
    loop.set_profiling(True)
    while (now_s := time.monotonic()) < start_s + duration_s:
        if requests_per_s > 0:
            num_due = 0
            while next_arrival_s <= now_s and num_in_flight() + num_due < MAX_REQUESTS_IN_FLIGHT:
                num_due += 1
                next_arrival_s += workload.next_gap_s(requests_per_s)
        else:
            num_due = max(0, MAX_REQUESTS_IN_FLIGHT - num_in_flight())
        cpu_s = time.thread_time()
        for _ in range(num_due):
            workload.submit(coordinator, store)
        submit_cpu_s += time.thread_time() - cpu_s
        # Wake for the next arrival, not more often: every wake-up takes the GIL from the loop.
        wake_s = min(next_arrival_s, start_s + duration_s) if requests_per_s > 0 else 0.0
        time.sleep(max(0.001, wake_s - time.monotonic()))
    end_s = time.monotonic()
    loop.set_profiling(False)
    return _Window(
        start_s,
        end_s,
        loop.cpu_s() - start_cpu_s,
        loop.num_turns - start_turns,
        coordinator.num_assigned - start_placed,
        workload.num_submitted,
        submit_cpu_s,
    )


def _wait_until(
    condition: Callable[[], bool], *, timeout_s: float, what: str, is_required: bool = True
) -> None:
    """Wait for ``condition``; after ``timeout_s``, ``RuntimeError`` (or a warning when the
    run can go on without it)."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            if not is_required:
                logger.warning("wire bench: gave up waiting %s s for %s", timeout_s, what)
                return
            raise RuntimeError(f"wire bench: gave up waiting {timeout_s} s for {what}")
        time.sleep(0.01)


def _result(
    window: _Window,
    reports_only: _ReportsOnly,
    workload: Workload,
    driver: dict[str, Any],
    coordinator: Coordinator,
    cluster: ClusterConfig,
) -> dict:
    wall_s = window.end_s - window.start_s
    num_submitted = workload.num_submitted
    cpu_s_per_placement = window.loop_cpu_s / max(1, window.num_placed)
    prefill_views, decode_views = driver["prefill_assignments"], driver["decode_assignments"]
    report_times_s = np.frombuffer(driver["report_times_s"], dtype=np.float64)

    def num_reports_between(start_s: float, end_s: float) -> int:
        return int(((report_times_s >= start_s) & (report_times_s < end_s)).sum())

    num_reports = num_reports_between(window.start_s, window.end_s)
    num_groups = len(coordinator.topology.groups)
    cpu_s_per_report = reports_only.loop_cpu_s / max(
        1, num_reports_between(reports_only.start_s, reports_only.end_s)
    )
    cpu_s_per_placement_beyond_reports = max(
        0.0, window.loop_cpu_s - num_reports * cpu_s_per_report
    ) / max(1, window.num_placed)
    projected_cores = (
        num_groups / driver["fetch_interval_s"] * cpu_s_per_report
        + PAPER_REQUESTS_PER_S * cpu_s_per_placement_beyond_reports
    )
    return {
        "placement": (
            "one request through submit, a PE and a DE group fetch (each one a leader's "
            "GroupReport over ZeroMQ) and its Assignment sent to both leaders"
        ),
        "placements_per_s": window.num_placed / wall_s,
        "cpu_s_per_placement": cpu_s_per_placement,
        "placements_per_cpu_s": window.num_placed / window.loop_cpu_s,
        "cores_at_2350_rps": PAPER_REQUESTS_PER_S * cpu_s_per_placement,
        # Every leader on schedule and 2,350 placements/s, priced from the two figures below.
        "projected_cores_at_2350_rps": projected_cores,
        "cpu_s_per_report": cpu_s_per_report,  # with nothing submitted (REPORTS_ONLY_S)
        "cpu_s_per_placement_beyond_reports": cpu_s_per_placement_beyond_reports,
        "loop_cores": window.loop_cpu_s / wall_s,
        # run_once calls: each polls once and takes in every message queued by then.
        "loop_turns_per_s": window.num_loop_turns / wall_s,
        "submit_cpu_s_per_request": window.submit_cpu_s / max(1, window.num_submitted),
        "requests_per_s_submitted": window.num_submitted / wall_s,
        "duration_s": wall_s,
        "num_placed_in_window": window.num_placed,
        "num_submitted": num_submitted,
        "num_assigned": coordinator.num_assigned,
        "is_consistent": (
            coordinator.num_assigned == num_submitted
            and sorted(prefill_views) == sorted(decode_views)
            and sorted(r for r, _, _ in prefill_views) == list(range(num_submitted))
            and driver["num_misrouted"] == 0
            and coordinator.num_live_engines == coordinator.num_expected_engines
        ),
        "num_prefill_assignments_received": len(prefill_views),
        "num_decode_assignments_received": len(decode_views),
        "num_misrouted_assignments": driver["num_misrouted"],
        "group_reports_per_s": num_reports / wall_s,
        "group_reports_per_s_target": num_groups / driver["fetch_interval_s"],
        "num_late_reports": driver["num_late_reports"],  # sent over one fetch interval late
        "messages": driver["messages"],  # per kind: count, and mean encoded bytes (sampled)
        "mean_prompt_tokens": workload.num_prompt_tokens / max(1, num_submitted),
        "hit_fraction": workload.num_hit_tokens / max(1, workload.num_prompt_tokens),
        "mean_output_tokens": workload.num_output_tokens / max(1, num_submitted),
        "cluster": cluster.node_shape,
        "num_engines": coordinator.num_expected_engines,
        "num_leaders": num_groups,
        "engines_per_node": cluster.engines_per_node,
        "nodes_per_group": cluster.nodes_per_group,
    }

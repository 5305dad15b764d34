"""The ``Scheduler`` interface both placement policies implement, and the factory by name."""

from __future__ import annotations

from typing import Protocol

from dualpath.config import SCHEDULER_NAMES, SchedulerConfig
from dualpath.scheduler.dualpath_policy import DualPathScheduler
from dualpath.scheduler.load_planner import LoadPlanner
from dualpath.scheduler.message import (
    DecodeFetchResult,
    GroupSnapshot,
    PrefillFetchResult,
    SchedulerRequest,
)
from dualpath.scheduler.round_robin import RoundRobinScheduler
from dualpath.scheduler.topology import ClusterTopology


class Scheduler(Protocol):
    """Pull-model placement (SPEC §6): requests in, group fetches answered with assignments.

    Contracts shared by every implementation:

    * pure policy: no I/O, no clock, no threads; calls on one instance must not interleave;
    * ``submit`` appends to the FIFO; ``ValueError`` for a request id already waiting or a hit
      that is not whole Full Blocks;
    * ``fetch_prefill`` / ``fetch_decode`` take the group leader's snapshot (``ValueError`` if
      it does not match the topology or the role) and return the requests placed now, in
      queue order. Every request is placed on a PE exactly once, later on a DE exactly once
      (when its read plan is fixed); one that cannot be placed stays queued, in order. Once
      DE-placed, its id may be submitted again (e.g. to re-place a lost engine's request).
    """

    @property
    def num_waiting_prefill(self) -> int: ...

    @property
    def num_waiting_decode(self) -> int: ...

    def submit(self, request: SchedulerRequest) -> None: ...

    def fetch_prefill(self, snapshot: GroupSnapshot) -> PrefillFetchResult: ...

    def fetch_decode(self, snapshot: GroupSnapshot) -> DecodeFetchResult: ...

    def decode_fetch_may_place(self, group_id: int) -> bool:
        """Whether ``fetch_decode`` by DE group ``group_id`` could place anything now
        (``ValueError`` for an unknown or prefill group). True is always a safe answer."""
        ...

    def report_decode_load(self, group_id: int, num_tokens: int) -> None:
        """What a ``fetch_decode`` that places nothing records: the group's load (Σ ``tok_e``
        = ``num_tokens``) as far as any later decision reads it. A leader whose fetch could
        place nothing (``decode_fetch_may_place`` False) may call this instead: every later
        answer is the same."""
        ...

    def withdraw_engine(self, engine_id: int) -> list[SchedulerRequest]:
        """Take a lost engine out of service: nothing is placed on it again, and every waiting
        request already tied to it is removed and returned, in queue order, for the caller
        to submit again. Requests placed on it earlier are the caller's to fail or retry."""
        ...

    def restore_engine(self, engine_id: int) -> None:
        """Put a withdrawn engine back in service (it joined again, e.g. restarted under its
        id); a no-op for one never withdrawn. Its load is what its group reports next."""
        ...


def make_scheduler(
    config: SchedulerConfig,
    topology: ClusterTopology,
    load_planner: LoadPlanner | None = None,
) -> Scheduler:
    """The scheduler ``config.scheduler`` names, reading as ``config.read_path`` says unless
    a ``load_planner`` is given."""
    if config.scheduler == "dualpath":
        return DualPathScheduler(config, topology, load_planner)
    if config.scheduler == "round_robin":
        return RoundRobinScheduler(config, topology, load_planner)
    raise ValueError(f"scheduler must be one of {SCHEDULER_NAMES}, got {config.scheduler!r}")

"""The scheduler's fetches (SPEC §6) on the runtime: group loads from the engines' reports, and
the fetch driver the simulator runs too (``dualpath.scheduler.fetching``, its idle rule).

A group's ticks are its leading engine's reports (every ``fetch_interval_s``; an idle one's
every ``report_keepalive_s``): each is the group's fetch. The leading engine is the group's
first usable one (alive, reported since it joined, not suspected after a failed transfer). A
submit wakes every PE group, a PE placement every DE group; a woken group that is idle
fetches in this loop turn, PE groups first, so that a request on an idle cluster is placed on
both sides at once.

    fetches = GroupFetches(policy, topology, engine_id_to_node)
    fetches.assign = lifecycle.assign       # each final placement
    fetches.submit(scheduler_request)       # to the policy's FIFO; wakes the PE groups
    fetches.on_report(engine_id, report)    # the group's fetch if from its leading engine
    fetches.fetch_due()                     # idle groups' fetches, once per loop turn
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from dualpath.cluster.group_load import GroupLoad
from dualpath.protocol import EngineReport
from dualpath.scheduler import (
    ClusterTopology,
    FetchDriver,
    LoadPlan,
    Scheduler,
    SchedulerRequest,
)

# assign(request_id, prefill_engine_id, decode_engine_id, load_plan): a placement is final.
Assign = Callable[[int, int, int, LoadPlan], None]


class GroupFetches:
    def __init__(
        self,
        policy: Scheduler,
        topology: ClusterTopology,
        engine_id_to_node: Mapping[int, int],
    ) -> None:
        self.policy = policy
        # Set by the owner (the request lifecycle's): called for every final placement.
        self.assign: Assign = _unset_assign
        self.groups = {g.group_id: GroupLoad.of(g, engine_id_to_node) for g in topology.groups}
        self.engine_id_to_group = {
            e: self.groups[g.group_id] for g in topology.groups for e in g.engine_ids
        }
        # Each engine's place in its group's columns.
        self._position = {e: i for g in topology.groups for i, e in enumerate(g.engine_ids)}
        # Groups the idle rule made due to fetch in this loop turn (``fetch_due``).
        self._due: deque[GroupLoad] = deque()
        loads = list(self.groups.values())
        self.driver: FetchDriver[GroupLoad] = FetchDriver(
            [g for g in loads if g.is_prefill],
            [g for g in loads if not g.is_prefill],
            fetch_when_idle=True,
            fetch_now=self._due.append,
            fetch_at_tick=_at_next_report,
        )
        self.num_reports = 0  # engine reports received (idle engines send few)
        # Engines a transfer failed with, out of service until they report (``suspect``).
        self._suspects: set[int] = set()

    def submit(self, request: SchedulerRequest) -> None:
        """Into the policy's FIFO; every PE group fetches (an idle one in this loop turn)."""
        self.policy.submit(request)
        self.driver.wake_prefill()

    def on_report(self, engine_id: int, report: EngineReport) -> None:
        """An engine's load; from a group's leading engine, the group's fetch (its tick). The
        leading engine is the first usable one: a group whose first engine died or is
        suspected goes on fetching on the next one's reports."""
        self.num_reports += 1
        if engine_id in self._suspects:  # it answers: back in service
            self._suspects.discard(engine_id)
            self.policy.restore_engine(engine_id)
        group = self.engine_id_to_group[engine_id]
        position = self._position[engine_id]
        group.record_engine(position, report)
        if position == group.is_usable.index(True) or self.driver.fetches_at_once(group):
            self.fetch(group)

    def fetch_due(self) -> None:
        """The fetches the idle rule made due (in order: PE groups' first, then the DE groups'
        they woke), unless the group fetched since."""
        due = self._due
        while due:
            group = due.popleft()
            if group.is_fetch_pending:
                self.fetch(group)

    def fetch(self, group: GroupLoad) -> None:
        self.driver.start_fetch(group, group.is_prefill)
        snapshot = group.snapshot()
        if group.is_prefill:
            # Placed requests wait for their DE placement; until the PEs report again their
            # entries leave those requests out.
            if self.policy.fetch_prefill(snapshot).request_ids:
                group.mark_stale()
                self.driver.wake_decode()
            return
        result = self.policy.fetch_decode(snapshot)
        if not result.request_ids:  # most fetches place nothing
            return
        group.mark_stale()
        for request_id, pe, de, plan in zip(
            result.request_ids,
            result.prefill_engine_ids,
            result.decode_engine_ids,
            result.load_plans,
            strict=True,
        ):
            self.assign(request_id, pe, de, plan)
            # The PE was given work: its entry is out of date until it reports.
            self.engine_id_to_group[pe].mark_stale(self._position[pe])

    def engine_joined(self, engine_id: int) -> None:
        """Not chosen until it reports; one that joins again after its loss is back in the
        policy's service."""
        self._set_usable(engine_id, False)
        self._suspects.discard(engine_id)
        self.policy.restore_engine(engine_id)

    def suspect(self, engine_id: int) -> None:
        """A transfer with the engine failed: it is out of the policy's service, and its
        queued requests placed anew, until it reports again (one that is alive does within a
        fetch interval; one cut off does not, until it is declared dead)."""
        if engine_id not in self.engine_id_to_group or engine_id in self._suspects:
            return
        self._suspects.add(engine_id)
        self._withdraw(engine_id)

    def engine_lost(self, engine_id: int) -> None:
        """Never chosen again; requests only queued for it are placed anew."""
        self._suspects.discard(engine_id)
        self._withdraw(engine_id)

    def _withdraw(self, engine_id: int) -> None:
        """Out of the policy's service: unusable, its queued requests placed anew."""
        self._set_usable(engine_id, False)
        for request in self.policy.withdraw_engine(engine_id):
            self.submit(request)

    def _set_usable(self, engine_id: int, is_usable: bool) -> None:
        self.engine_id_to_group[engine_id].is_usable[self._position[engine_id]] = is_usable

    def link_bytes(self, engine_ids: list[int]) -> dict[int, dict[str, int]]:
        """Latest cumulative link byte counters reported by each of ``engine_ids``."""
        return {
            e: dict(self.engine_id_to_group[e].link_bytes[self._position[e]]) for e in engine_ids
        }


def _unset_assign(request_id: int, pe: int, de: int, plan: LoadPlan) -> None:
    raise RuntimeError("caller bug: GroupFetches.assign was not set")


def _at_next_report(group: GroupLoad) -> None:
    """A busy group's next tick is its leading engine's next report: nothing to arrange."""

"""Fetches of the simulator: when each group's leader fetches, and what a fetch places.

``SimFetches`` holds ``Simulator``'s fetch methods (a base class of ``Simulator``, on top of
``PrefillSteps``, using its state). When a group fetches is the fetch driver's
(``dualpath.scheduler.fetching``, the runtime's too): it calls ``_fetch_now`` (an event now)
or ``_fetch_at_tick`` (an event at the group's next grid tick). A PE fetch places requests on
PEs and wakes the DE groups; a DE fetch fixes each request's DE and read plan and starts its
reads.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final, cast

from dualpath.scheduler import GroupSnapshot, Scheduler
from dualpath.sim.engines import (
    DecodeGroup,
    EngineGroup,
    PrefillGroup,
    SimDecodeEngine,
    SimEngine,
    SimPrefillEngine,
    SimRequest,
)
from dualpath.sim.events import EventPriority
from dualpath.sim.prefill_step import PrefillSteps

_FETCH: Final = EventPriority.FETCH


class SimFetches(PrefillSteps):
    """``Simulator``'s fetch methods (see the module docstring)."""

    # What the fetches use of ``Simulator`` beyond ``PrefillSteps``' (which sets them).
    scheduler: Scheduler
    _fetch_interval_s: float
    _num_waiting_decode: int
    _prefill_engines: dict[int, SimPrefillEngine]
    _decode_engines: dict[int, SimDecodeEngine]
    _skips_full_prefill_groups: bool
    _skips_idle_decode_fetches: bool
    _batches_decode_ticks: bool
    _decode_ticks: dict[float, deque[tuple[int, DecodeGroup]]]

    def _start_reads(self, request: SimRequest) -> None:
        raise NotImplementedError

    def _fetch_now(self, group: EngineGroup) -> None:
        """The driver's fetch at once (an idle group): an event now."""
        handler = self._fetch_prefill if isinstance(group, PrefillGroup) else self._fetch_decode
        self.queue.push(self.queue.now_s, _FETCH, handler, group)

    def _fetch_at_tick(self, group: EngineGroup) -> None:
        """The driver's fetch at the group's next tick (``fetch_phase_s`` + k x
        ``fetch_interval_s``, after now).

        NOTE(sim): the DE groups share one grid, so a tick holds a run of DE fetches (48 at
        48P96D) that nothing else comes between most of the time. They wait in
        ``_decode_ticks[due_s]`` (seq_no, group), FIFO, and only the first is in the event
        heap, with the seq_no it would have had as its own event: ``_run_decode_tick`` runs
        each next one at once while it is the queue's next event, so the order of events (and
        their count), and the results, are the same bit for bit, with a heap push and pop less
        for most DE fetches (a third of 48P96D's events)."""
        queue = self.queue
        due_s = self._next_tick_s(group)
        if isinstance(group, PrefillGroup):
            queue.push(due_s, _FETCH, self._fetch_prefill, group)
            return
        if not self._batches_decode_ticks:
            queue.push(due_s, _FETCH, self._fetch_decode, group)
            return
        seq_no = queue.reserve_seq_no()
        tick = self._decode_ticks.get(due_s)
        if tick is None:
            self._decode_ticks[due_s] = deque(((seq_no, cast("DecodeGroup", group)),))
            queue.push_reserved(due_s, _FETCH, seq_no, self._run_decode_tick, due_s)
        else:
            tick.append((seq_no, cast("DecodeGroup", group)))  # (a later seq_no: in order)

    def _next_tick_s(self, group: EngineGroup) -> float:
        """The group's first grid tick after now."""
        interval_s = self._fetch_interval_s
        phase_s = group.fetch_phase_s
        # (math.floor itself, not an alias: the compiled build calls C's floor for it.)
        return phase_s + (math.floor((self.queue.now_s - phase_s) / interval_s) + 1) * interval_s

    def _fetch_prefill(self, group: PrefillGroup) -> None:
        self._fetch_driver.start_fetch(group, True)
        if not self._num_waiting_prefill:
            return  # nothing to place: the leader's fetch would return empty
        if group.is_full and not group.changed_engines and not group.num_awaiting_decode:
            # NOTE(sim): a fetch that cannot change anything is not made (the results are the
            # same bit for bit; it saves most PE fetches of a loaded cluster). The last fetch
            # placed nothing from a non-empty FIFO, so under Algorithm 1 every PE of the group
            # was over β, and no PE's load has changed since: this one would place nothing
            # either. Its report's only other effect, its nodes' read_q, is read by no one
            # before the group's next real fetch reports them again: plan_load reads a PE
            # node's read_q only for requests on that node waiting for a DE, and there are none.
            return
        placed = self.scheduler.fetch_prefill(_group_snapshot(group))
        num_placed = len(placed.request_ids)
        group.is_full = not num_placed and self._skips_full_prefill_groups
        if not num_placed:
            return
        group.num_awaiting_decode += num_placed
        self._num_waiting_prefill -= num_placed
        self._num_waiting_decode += num_placed
        requests = self._requests_in_flight
        engines = self._prefill_engines
        request_ids = placed.request_ids
        prefill_engine_ids = placed.prefill_engine_ids
        # (Indexing rather than zip(): compiled, zip iterates through the generic protocol.
        # The result's tuples have equal lengths: PrefillFetchResult checks.)
        for index in range(num_placed):
            request = requests[request_ids[index]]
            engine = engines[prefill_engine_ids[index]]
            request.prefill_engine = engine
            engine.change_load(1, request.num_prompt_tokens)
        self._fetch_driver.wake_decode()

    def _run_decode_tick(self, due_s: float) -> None:
        """The DE fetches of one tick, in order, as long as each is the queue's next event;
        otherwise the next one goes back to the heap under its own seq_no."""
        tick = self._decode_ticks[due_s]
        queue = self.queue
        while True:
            self._fetch_decode(tick.popleft()[1])
            if not tick:
                del self._decode_ticks[due_s]
                return
            seq_no = tick[0][0]
            if not queue.is_next(due_s, _FETCH, seq_no):
                queue.push_reserved(due_s, _FETCH, seq_no, self._run_decode_tick, due_s)
                return
            queue.num_events += 1  # counted as the event it would have been

    def _fetch_decode(self, group: DecodeGroup) -> None:
        self._fetch_driver.start_fetch(group, False)
        if not self._num_waiting_decode:
            return
        scheduler = self.scheduler
        if self._skips_idle_decode_fetches and not scheduler.decode_fetch_may_place(group.group_id):
            # NOTE(sim): nothing waits for this group nor for phase 1: the fetch would place
            # nothing and only record the report, so only the part a later decision reads is
            # sent (the same results bit for bit, scheduler.report_decode_load). Most DE
            # fetches of a large cluster are these: a PE placement wakes every DE group, and
            # phase 1 sends the new requests to a few.
            scheduler.report_decode_load(group.group_id, group.num_tokens)
            return
        final = scheduler.fetch_decode(_group_snapshot(group))
        request_ids = final.request_ids
        prefill_engine_ids = final.prefill_engine_ids
        decode_engine_ids = final.decode_engine_ids
        load_plans = final.load_plans
        num_placed = len(request_ids)
        self._num_waiting_decode -= num_placed
        requests = self._requests_in_flight
        for index in range(num_placed):  # (see _fetch_prefill; DecodeFetchResult checks lengths)
            request = requests[request_ids[index]]
            decode_id = decode_engine_ids[index]
            plan = load_plans[index]
            assert request.prefill_engine.engine_id == prefill_engine_ids[index], (
                "the PE changed after placement"
            )
            prefill_group = request.prefill_engine.group
            assert isinstance(prefill_group, PrefillGroup)  # (for the type checker)
            prefill_group.num_awaiting_decode -= 1
            engine = self._decode_engines[decode_id]
            request.decode_engine = engine
            request.load_plan = plan
            num_decode_tokens = request.num_prompt_tokens + request.num_output_tokens
            request.num_decode_blocks = -(-num_decode_tokens // self._block_size)
            engine.change_load(1, num_decode_tokens, request.num_decode_blocks)
            self._start_reads(request)


def _group_snapshot(group: EngineGroup) -> GroupSnapshot:
    """The leader's report: every engine's and node's snapshot, in topology order. Only the
    engines whose load changed since the last report get a new snapshot
    (``EngineGroup.changed_engines``); an unchanged group sends its last report again."""
    # (Typed as the base class: compiled, each call below is then a direct native call.)
    changed = cast("list[SimEngine]", group.changed_engines)
    snapshot = group.snapshot
    if snapshot is not None and not changed:
        return snapshot  # nothing changed since the last report
    snapshots = group.engine_snapshots
    for engine in changed:
        snapshots[engine.position] = engine.snapshot()
    changed.clear()
    snapshot = group.snapshot = GroupSnapshot(
        group.group_id, tuple(snapshots), tuple([node.snapshot() for node in group.nodes])
    )
    return snapshot

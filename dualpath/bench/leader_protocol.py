"""Group leaders that speak for their whole group (SPEC §6), as the scheduler benchmark runs them.

SPEC §6 has only a group's leader talk to the scheduler. dualpath's engines each speak for
themselves (``dualpath.protocol``: the report of a group's first engine is the group's fetch),
which costs a client per engine; ``dualpath bench scheduler --wire`` measures the scheduler
process at 48P96D with simulated leaders instead, which keeps 1,152 engines at 144 clients.
Their protocol is here, with the scheduler's side of it (``LeaderCoordinator``)::

    leader  --GroupInfo-->   scheduler  (once: every engine of the group, in topology order)
    leader  --GroupReport--> scheduler  (every fetch interval: the whole group's state; a fetch)
    scheduler --Assignment, DecodeReady, PrefillDone, CancelRequest--> leader
                                        (the leader hands each to the engine it names)

The leader's client is ``engine-<leader id>``. Everything the scheduler sends to one of the
group's engines goes to the leader's client, and ``PeerTable``, ``Heartbeat`` and
``Shutdown`` reach each client once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dualpath.cluster.coordinator import Coordinator
from dualpath.cluster.group_load import GroupLoad
from dualpath.cluster.membership import Client, EngineState
from dualpath.control.codec import message
from dualpath.protocol import EngineInfo, EngineReport, Shutdown, client_id_of

logger = logging.getLogger(__name__)


@message("group-info")
@dataclass(frozen=True, slots=True)
class GroupInfo:
    """Sent once by a group's leader after the hello: every engine of its group, in the
    topology's order (the leader first). Joins them all, as one ``EngineInfo`` each would."""

    engines: tuple[EngineInfo, ...]


@message("group-report")
@dataclass(frozen=True, slots=True)
class GroupReport:
    """A group leader's report at a fetch: every engine's ``EngineReport``, as columns.

    Entry i of each tuple belongs to engine ``engine_ids[i]``; the engines are the group's, in
    the topology's order. ``engines`` gives the per-engine view. Columns, not a tuple of
    nested ``EngineReport``s, because the codec decodes each nested message as a msgpack
    object and a constructor call of its own: 3-4x the cost, and at 144 leaders x 100
    reports/s that alone is most of a core (``dualpath bench scheduler --wire``).

    ``link_bytes`` may be empty: the counters are cumulative metrics, not scheduling state,
    so a leader may send them at its own, slower pace (decoding 8 dicts of 7 named counters
    is about half the cost of a report).
    """

    group_id: int
    engine_ids: tuple[int, ...]
    num_seqs: tuple[int, ...]
    num_tokens: tuple[int, ...]
    num_free_kv_blocks: tuple[int, ...]
    read_queue_tokens: tuple[int, ...]
    link_bytes: tuple[dict[str, int], ...]  # per engine, or () when left out
    num_buffer_slots_used: tuple[int, ...]
    write_queue_tokens: tuple[int, ...] = ()  # per engine, or () when none has writes queued

    def __post_init__(self) -> None:
        # One chained comparison, not a loop: this runs for every report the scheduler decodes.
        num_engines = len(self.engine_ids)
        if not (
            num_engines
            == len(self.num_seqs)
            == len(self.num_tokens)
            == len(self.num_free_kv_blocks)
            == len(self.read_queue_tokens)
            == len(self.num_buffer_slots_used)
        ) or not (
            len(self.link_bytes) in (0, num_engines)
            and len(self.write_queue_tokens) in (0, num_engines)
        ):
            raise ValueError(
                f"group {self.group_id}: every column needs {num_engines} entries (link_bytes "
                f"and write_queue_tokens may be empty), got {self.num_seqs}, "
                f"{self.num_tokens}, {self.num_free_kv_blocks}, {self.read_queue_tokens}, "
                f"{self.num_buffer_slots_used}, {self.write_queue_tokens} and "
                f"{len(self.link_bytes)} link counter sets"
            )

    @classmethod
    def of(cls, group_id: int, reports: Sequence[EngineReport]) -> GroupReport:
        """The group report made of its engines' reports (in the group's order)."""
        return cls(
            group_id,
            tuple(r.engine_id for r in reports),
            tuple(r.num_seqs for r in reports),
            tuple(r.num_tokens for r in reports),
            tuple(r.num_free_kv_blocks for r in reports),
            tuple(r.read_queue_tokens for r in reports),
            tuple(r.link_bytes for r in reports),
            tuple(r.num_buffer_slots_used for r in reports),
            tuple(r.write_queue_tokens for r in reports),
        )

    @property
    def engines(self) -> tuple[EngineReport, ...]:
        """One ``EngineReport`` per engine (with empty ``link_bytes`` if they were left out, and
        no queued writes if ``write_queue_tokens`` was)."""
        link_bytes = self.link_bytes or tuple({} for _ in self.engine_ids)
        write_queue_tokens = self.write_queue_tokens or (0,) * len(self.engine_ids)
        return tuple(
            EngineReport(*entry)
            for entry in zip(
                self.engine_ids,
                self.num_seqs,
                self.num_tokens,
                self.num_free_kv_blocks,
                self.read_queue_tokens,
                link_bytes,
                self.num_buffer_slots_used,
                write_queue_tokens,
                strict=True,
            )
        )


def record_group(group: GroupLoad, report: GroupReport) -> None:
    """A leader's report for every engine of the group (usability is the caller's)."""
    group.num_seqs[:] = report.num_seqs
    group.num_tokens[:] = report.num_tokens
    group.num_free_kv_blocks[:] = report.num_free_kv_blocks
    group.read_queue_tokens[:] = report.read_queue_tokens
    group.write_queue_tokens[:] = report.write_queue_tokens or [0] * len(group.is_stale)
    if report.link_bytes:  # the leader may send its counters less often
        group.link_bytes[:] = report.link_bytes
    group.is_stale[:] = [False] * len(group.is_stale)


class LeaderCoordinator(Coordinator):
    """The scheduler process's coordinator, also taking groups that join through a leader."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Per group that joined through a leader: the leader's client (only it may report).
        self._group_id_to_leader: dict[int, str] = {}
        self._join_handlers[GroupInfo] = self._on_group_info
        self._engine_handlers[GroupReport] = self._on_group_report

    def _on_engine_info(self, client_id: str, info: EngineInfo, now_s: float) -> None:
        group = self.fetches.engine_id_to_group.get(info.engine_id)
        if group is not None:  # the engine reports on its own from now on
            self._group_id_to_leader.pop(group.spec.group_id, None)
        super()._on_engine_info(client_id, info, now_s)

    def _on_group_info(self, client_id: str, group_info: GroupInfo, now_s: float) -> None:
        """A leader joins its whole group: the group's engines, in order, from its own client."""
        engine_ids = tuple(info.engine_id for info in group_info.engines)
        group = self.fetches.engine_id_to_group.get(engine_ids[0]) if engine_ids else None
        membership = self.membership
        if group is None or engine_ids != group.spec.engine_ids:
            problem = f"engines {engine_ids} are not one group of the topology"
        elif client_id != client_id_of(engine_ids[0]):
            problem = f"group {group.spec.group_id} joins through its leader {client_id_of(engine_ids[0])}"
        else:
            problem = next(filter(None, map(membership.topology_problem, group_info.engines)), None)
        if problem is not None:
            logger.error("group from %s does not fit the topology: %s", client_id, problem)
            self.server.send(client_id, Shutdown(problem))
            return
        self._group_id_to_leader[group.spec.group_id] = client_id
        client = Client(client_id, now_s)
        for info in group_info.engines:
            membership.join(info, client)
            self.fetches.engine_joined(info.engine_id)
        logger.info(
            "group %d (%s, %d engines) joined through %s",
            group.spec.group_id,
            group_info.engines[0].role,
            len(engine_ids),
            client_id,
        )

    def _on_group_report(self, engine: EngineState, report: GroupReport, now_s: float) -> None:
        """Every engine's load at once, then the group's fetch (SPEC §6). The sender's client
        speaks for the whole group, so hearing from it kept every engine alive already."""
        fetches = self.fetches
        fetches.num_reports += 1
        group = fetches.groups.get(report.group_id)
        client_id = engine.client.client_id
        if (
            group is None
            or self._group_id_to_leader.get(report.group_id) != client_id
            or report.engine_ids != group.spec.engine_ids
        ):
            logger.warning("ignoring a report of group %d from %s", report.group_id, client_id)
            return
        record_group(group, report)
        if not all(group.is_usable):  # the first report since joining, or an engine is dead
            group.is_usable[:] = [self.membership.is_alive(e) for e in group.spec.engine_ids]
        fetches.fetch(group)

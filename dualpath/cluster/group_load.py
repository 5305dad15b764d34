"""The scheduler's view of one engine group's load (SPEC §6): what its engines last reported,
and the ``GroupSnapshot`` the policy sees at the group's fetch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from dualpath.protocol import EngineReport
from dualpath.scheduler import (
    EngineGroupSpec,
    EngineRole,
    EngineSnapshot,
    GroupSnapshot,
    NodeSnapshot,
)

# tok_e reported for a dead PE: above any beta, so Algorithm 1 skips it.
DEAD_ENGINE_TOKENS = 1 << 62


@dataclass
class GroupLoad:
    """A group's latest reported load (SPEC §6), one entry per engine in topology order.

    Each ``EngineReport`` writes its engine's entry (a group leader's report, all of them:
    ``dualpath.bench.leader_protocol``). An engine that has not reported since it joined, or
    is dead, is not usable. The fetch driver (``dualpath.scheduler.fetching``) reads
    ``is_idle`` and keeps ``is_fetch_pending``.
    """

    spec: EngineGroupSpec
    is_prefill: bool
    # Per node of the group: its id and its engines' positions; a group's engines are listed
    # node by node.
    node_ids: tuple[int, ...]
    node_slices: tuple[slice, ...]
    num_seqs: list[int]
    num_tokens: list[int]
    num_free_kv_blocks: list[int]
    read_queue_tokens: list[int]
    write_queue_tokens: list[int]
    is_usable: list[bool]
    link_bytes: list[dict[str, int]]  # cumulative counters, for metrics and benchmarks
    # Per engine: its entry may be out of date because it was given work, or a fetch it did
    # not send used it, since it last reported (``is_idle``).
    is_stale: list[bool]
    # The last snapshot's engines and the (seq_e, tok_e, free blocks) columns they were made
    # of: an engine whose load did not change since is not built again (``_engine_snapshots``).
    engine_snapshots: tuple[EngineSnapshot, ...]
    snapshot_columns: tuple[list[int], list[int], list[int]] | None = None
    is_fetch_pending: bool = False  # woken, not fetched since (the fetch driver's)

    @classmethod
    def of(cls, spec: EngineGroupSpec, engine_id_to_node: Mapping[int, int]) -> GroupLoad:
        """A group nobody has reported for yet (every engine unusable)."""
        num_engines_of_node = Counter(engine_id_to_node[e] for e in spec.engine_ids)
        node_slices, first = [], 0
        for node_id in spec.node_ids:  # a group lists its engines node by node
            end = first + num_engines_of_node[node_id]
            node_slices.append(slice(first, end))
            first = end
        num_engines = len(spec.engine_ids)
        return cls(
            spec,
            spec.role == EngineRole.PREFILL,
            spec.node_ids,
            tuple(node_slices),
            num_seqs=[0] * num_engines,
            num_tokens=[0] * num_engines,
            num_free_kv_blocks=[0] * num_engines,
            read_queue_tokens=[0] * num_engines,
            write_queue_tokens=[0] * num_engines,
            is_usable=[False] * num_engines,
            link_bytes=[{} for _ in range(num_engines)],
            is_stale=[False] * num_engines,
            engine_snapshots=tuple(EngineSnapshot(e, 0, 0, 0) for e in spec.engine_ids),
        )

    def record_engine(self, position: int, report: EngineReport) -> None:
        """One engine's report (it speaks for itself): it is usable from now on."""
        self.link_bytes[position] = report.link_bytes
        self.num_seqs[position] = report.num_seqs
        self.num_tokens[position] = report.num_tokens
        self.num_free_kv_blocks[position] = report.num_free_kv_blocks
        self.read_queue_tokens[position] = report.read_queue_tokens
        self.write_queue_tokens[position] = report.write_queue_tokens
        self.is_usable[position] = True
        self.is_stale[position] = False

    def mark_stale(self, position: int | None = None) -> None:
        """The engine at ``position`` (every engine if None) may have changed since it last
        reported: it was given work, or its entry was used by a fetch it did not send."""
        if position is None:
            self.is_stale[:] = [True] * len(self.is_stale)
        else:
            self.is_stale[position] = True

    def is_idle(self) -> bool:
        """Every engine reported, has no work (no requests, tokens, queued reads or queued
        writes) and has been given none since. Such a group's entries are exact until it is
        given work, so the scheduler may fetch on its behalf (an idle engine reports only now
        and then: ``EngineProcessConfig.report_keepalive_s``)."""
        return (
            all(self.is_usable)
            and not any(self.is_stale)
            and not any(self.num_seqs)
            and not any(self.num_tokens)
            and not any(self.read_queue_tokens)
            and not any(self.write_queue_tokens)
        )

    def snapshot(self) -> GroupSnapshot:
        """What the policy sees of the group at a fetch."""
        num_seqs, num_tokens = self.num_seqs, self.num_tokens
        num_free_kv_blocks, read_queue_tokens = self.num_free_kv_blocks, self.read_queue_tokens
        write_queue_tokens = self.write_queue_tokens
        if not all(self.is_usable):
            # Not joined or not reported yet, or dead: never chosen (a PE above beta, a DE
            # without memory), and its read and write queues are not counted.
            usable = self.is_usable
            num_seqs = [n if ok else 0 for n, ok in zip(num_seqs, usable, strict=True)]
            num_tokens = [
                n if ok else DEAD_ENGINE_TOKENS for n, ok in zip(num_tokens, usable, strict=True)
            ]
            num_free_kv_blocks = [
                n if ok else 0 for n, ok in zip(num_free_kv_blocks, usable, strict=True)
            ]
            read_queue_tokens = [
                n if ok else 0 for n, ok in zip(read_queue_tokens, usable, strict=True)
            ]
            write_queue_tokens = [
                n if ok else 0 for n, ok in zip(write_queue_tokens, usable, strict=True)
            ]
        engines = self._engine_snapshots(num_seqs, num_tokens, num_free_kv_blocks)
        # Each node's read_q and write_q sum its engines'; maps, not a loop: this runs on
        # every fetch.
        node_read_queue_tokens = map(sum, map(read_queue_tokens.__getitem__, self.node_slices))
        node_write_queue_tokens = map(sum, map(write_queue_tokens.__getitem__, self.node_slices))
        nodes = tuple(
            map(NodeSnapshot, self.node_ids, node_read_queue_tokens, node_write_queue_tokens)
        )
        return GroupSnapshot(self.spec.group_id, engines, nodes)

    def _engine_snapshots(
        self, num_seqs: list[int], num_tokens: list[int], num_free_kv_blocks: list[int]
    ) -> tuple[EngineSnapshot, ...]:
        """``EngineSnapshot``s for these columns, reusing the last snapshot's where an
        engine's load is unchanged: between two reports 10 ms apart most engines' is, and
        building a snapshot costs about a microsecond (a frozen dataclass), eight per report."""
        columns = (num_seqs, num_tokens, num_free_kv_blocks)
        if columns == self.snapshot_columns:
            return self.engine_snapshots
        engines = tuple(
            map(
                _same_or_new_snapshot,
                self.engine_snapshots,
                num_seqs,
                num_tokens,
                num_free_kv_blocks,
            )
        )
        self.engine_snapshots = engines
        self.snapshot_columns = (list(num_seqs), list(num_tokens), list(num_free_kv_blocks))
        return engines


def _same_or_new_snapshot(
    last: EngineSnapshot, num_seqs: int, num_tokens: int, num_free_kv_blocks: int
) -> EngineSnapshot:
    if (
        last.num_seqs == num_seqs
        and last.num_tokens == num_tokens
        and last.num_free_kv_blocks == num_free_kv_blocks
    ):
        return last
    return EngineSnapshot(last.engine_id, num_seqs, num_tokens, num_free_kv_blocks)

"""What crosses the control channel between engine-group leaders and the scheduler.

A request is sent in full once (``SchedulerRequest``, at ``submit``). A leader's fetch carries
its group's state (``GroupSnapshot``); the answer is a tuple of assignments. All objects are
frozen plain data, so the runtime can serialise them and the simulator can pass them as is.
Token counts are the proxy for GPU, disk and network load alike (SPEC §6).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.scheduler.load_planner import LoadPlan


@dataclass(frozen=True, slots=True)
class SchedulerRequest:
    """One turn's request, as placement needs it; no token ids, no sampling parameters."""

    request_id: int
    num_prompt_tokens: int  # the whole context sent this turn
    # Leading prompt tokens whose KV the store holds: whole Full Blocks (SPEC §3).
    num_cached_tokens: int
    # Generation budget; with the prompt it sizes the request's DE memory (SPEC §6, len_r).
    max_num_output_tokens: int

    def __post_init__(self) -> None:
        if self.num_prompt_tokens <= 0:
            raise ValueError(
                f"request {self.request_id}: num_prompt_tokens must be > 0, "
                f"got {self.num_prompt_tokens}"
            )
        if not 0 <= self.num_cached_tokens <= self.num_prompt_tokens:
            raise ValueError(
                f"request {self.request_id}: num_cached_tokens must be in "
                f"[0, {self.num_prompt_tokens}], got {self.num_cached_tokens}"
            )
        if self.max_num_output_tokens < 0:
            raise ValueError(
                f"request {self.request_id}: max_num_output_tokens must be >= 0, "
                f"got {self.max_num_output_tokens}"
            )

    @property
    def num_new_tokens(self) -> int:
        """Prompt tokens the PE computes (the miss)."""
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def num_decode_tokens(self) -> int:
        """len_r of SPEC §6's DE placement: prompt + max output tokens."""
        return self.num_prompt_tokens + self.max_num_output_tokens


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One engine's load, as its group leader reports it at a fetch."""

    engine_id: int
    num_seqs: int  # seq_e: assigned, unfinished requests
    num_tokens: int  # tok_e: their total tokens (prompt tokens on a PE, len_r on a DE)
    # Free device KV memory in Full Blocks; decode engines only (layer-wise prefill keeps a
    # PE's KV footprint to one layer, SPEC §3).
    num_free_kv_blocks: int = 0


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One node's storage read queue, as its group leader reports it at a fetch."""

    node_id: int
    read_queue_tokens: int  # read_q: tokens queued for storage reads on this node's SNIC


@dataclass(frozen=True, slots=True)
class GroupSnapshot:
    """A group leader's report at a fetch.

    ``engines`` and ``nodes`` follow ``EngineGroupSpec.engine_ids`` / ``.node_ids`` order
    exactly; the scheduler rejects any other shape with ``ValueError``.
    """

    group_id: int
    engines: tuple[EngineSnapshot, ...]
    nodes: tuple[NodeSnapshot, ...]


@dataclass(frozen=True, slots=True)
class PrefillAssignment:
    """One request's PE: the per-request view of a ``PrefillFetchResult``."""

    request_id: int
    prefill_engine_id: int


@dataclass(frozen=True, slots=True)
class DecodeAssignment:
    """One request's final (PE, DE) pair and read plan: the per-request view of a
    ``DecodeFetchResult``."""

    request_id: int
    prefill_engine_id: int
    decode_engine_id: int
    load_plan: LoadPlan


@dataclass(frozen=True, slots=True)
class PrefillFetchResult:
    """A PE fetch's answer: the requests placed now on the group's PEs, FIFO order.

    Entry i of each tuple describes the i-th placed request. The read side is not fixed yet:
    it is decided when a DE fetch places the request (``DecodeFetchResult``), and the PE
    starts neither reads nor prefill before then. Columnar, like one step's scheduler output:
    cheap to build on the placement path and to serialise.
    """

    request_ids: tuple[int, ...]
    prefill_engine_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.request_ids)

    def assignments(self) -> tuple[PrefillAssignment, ...]:
        return tuple(
            PrefillAssignment(*entry)
            for entry in zip(self.request_ids, self.prefill_engine_ids, strict=True)
        )


@dataclass(frozen=True, slots=True)
class DecodeFetchResult:
    """A DE fetch's answer: requests whose (PE, DE) pair and read plan are now final.

    Entry i of each tuple describes the i-th placed request, in the group's queue order. The
    runtime delivers each entry to both engines: the reads in its ``LoadPlan`` start now
    (SPEC §6, order of decisions), and the PE prefills as its hit KV arrives layer by layer.
    """

    request_ids: tuple[int, ...]
    prefill_engine_ids: tuple[int, ...]
    decode_engine_ids: tuple[int, ...]
    load_plans: tuple[LoadPlan, ...]

    def __len__(self) -> int:
        return len(self.request_ids)

    def assignments(self) -> tuple[DecodeAssignment, ...]:
        return tuple(
            DecodeAssignment(*entry)
            for entry in zip(
                self.request_ids,
                self.prefill_engine_ids,
                self.decode_engine_ids,
                self.load_plans,
                strict=True,
            )
        )


EMPTY_PREFILL_FETCH_RESULT = PrefillFetchResult((), ())
EMPTY_DECODE_FETCH_RESULT = DecodeFetchResult((), (), (), ())

"""What crosses the control channel between engine-group leaders and the scheduler.

A request is sent in full once (``SchedulerRequest``, at ``submit``). A leader's fetch carries
its group's state (``GroupSnapshot``); the answer is a tuple of assignments. All objects are
frozen plain data, so the runtime can serialise them and the simulator can pass them as is.
Token counts are the proxy for GPU, disk and network load alike (SPEC §6).

Each is a frozen dataclass with a written-out ``__init__`` that stores its fields through
``object.__setattr__`` (``init=False``): the same stores as the generated one, and from the
sources the same cost. The compiled build (``dualpath/compiled.py``) turns those calls into
direct stores in C, where the generated ``__init__`` would stay interpreted Python: these
objects are built millions of times a simulated hour, and their constructors were a quarter of
a compiled 48P96D run. Keep a new field's store in ``__init__``, in field order
(``tests/scheduler/test_values.py`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.scheduler.load_planner import LoadPlan


@dataclass(frozen=True, slots=True, init=False)
class SchedulerRequest:
    """One turn's request, as placement needs it; no token ids, no sampling parameters."""

    request_id: int
    num_prompt_tokens: int  # the whole context sent this turn
    # Leading prompt tokens whose KV the store holds: whole Full Blocks (SPEC §3).
    num_cached_tokens: int
    # Generation budget; with the prompt it sizes the request's DE memory (SPEC §6, len_r).
    max_num_output_tokens: int
    # The DE to place it on if that DE is in service and its memory gate admits the request
    # (the DE of its agent session's last turn: ``dualpath.cluster.sessions``); else, and for
    # None, the policy's own choice.
    preferred_decode_engine_id: int | None

    def __init__(
        self,
        request_id: int,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        max_num_output_tokens: int,
        preferred_decode_engine_id: int | None = None,
    ) -> None:
        if num_prompt_tokens <= 0:
            raise ValueError(
                f"request {request_id}: num_prompt_tokens must be > 0, got {num_prompt_tokens}"
            )
        if not 0 <= num_cached_tokens <= num_prompt_tokens:
            raise ValueError(
                f"request {request_id}: num_cached_tokens must be in "
                f"[0, {num_prompt_tokens}], got {num_cached_tokens}"
            )
        if max_num_output_tokens < 0:
            raise ValueError(
                f"request {request_id}: max_num_output_tokens must be >= 0, "
                f"got {max_num_output_tokens}"
            )
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "num_prompt_tokens", num_prompt_tokens)
        object.__setattr__(self, "num_cached_tokens", num_cached_tokens)
        object.__setattr__(self, "max_num_output_tokens", max_num_output_tokens)
        object.__setattr__(self, "preferred_decode_engine_id", preferred_decode_engine_id)

    @property
    def num_new_tokens(self) -> int:
        """Prompt tokens the PE computes (the miss)."""
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def num_decode_tokens(self) -> int:
        """len_r of SPEC §6's DE placement: prompt + max output tokens."""
        return self.num_prompt_tokens + self.max_num_output_tokens


@dataclass(frozen=True, slots=True, init=False)
class EngineSnapshot:
    """One engine's load, as its group leader reports it at a fetch."""

    engine_id: int
    num_seqs: int  # seq_e: assigned, unfinished requests
    num_tokens: int  # tok_e: their total tokens (prompt tokens on a PE, len_r on a DE)
    # Free device KV memory in Full Blocks; decode engines only (layer-wise prefill keeps a
    # PE's KV footprint to one layer, SPEC §3).
    num_free_kv_blocks: int

    def __init__(
        self, engine_id: int, num_seqs: int, num_tokens: int, num_free_kv_blocks: int = 0
    ) -> None:
        object.__setattr__(self, "engine_id", engine_id)
        object.__setattr__(self, "num_seqs", num_seqs)
        object.__setattr__(self, "num_tokens", num_tokens)
        object.__setattr__(self, "num_free_kv_blocks", num_free_kv_blocks)


@dataclass(frozen=True, slots=True, init=False)
class NodeSnapshot:
    """One node's storage queues, as its group leader reports it at a fetch."""

    node_id: int
    read_queue_tokens: int  # read_q: tokens queued for storage reads on this node's SNIC
    # write_q (our extension of SPEC §6): tokens of Full Blocks queued for storage writes on
    # this node's SNIC (a DE persisting KV, SPEC §2), not yet written. The read-side choice
    # compares read_q + write_q: what the node's SNIC still has to move (``ClusterView``).
    write_queue_tokens: int

    def __init__(self, node_id: int, read_queue_tokens: int, write_queue_tokens: int = 0) -> None:
        object.__setattr__(self, "node_id", node_id)
        object.__setattr__(self, "read_queue_tokens", read_queue_tokens)
        object.__setattr__(self, "write_queue_tokens", write_queue_tokens)


@dataclass(frozen=True, slots=True, init=False)
class GroupSnapshot:
    """A group leader's report at a fetch.

    ``engines`` and ``nodes`` follow ``EngineGroupSpec.engine_ids`` / ``.node_ids`` order
    exactly; the scheduler rejects any other shape with ``ValueError``.
    """

    group_id: int
    engines: tuple[EngineSnapshot, ...]
    nodes: tuple[NodeSnapshot, ...]

    def __init__(
        self,
        group_id: int,
        engines: tuple[EngineSnapshot, ...],
        nodes: tuple[NodeSnapshot, ...],
    ) -> None:
        object.__setattr__(self, "group_id", group_id)
        object.__setattr__(self, "engines", engines)
        object.__setattr__(self, "nodes", nodes)


@dataclass(frozen=True, slots=True, init=False)
class PrefillAssignment:
    """One request's PE: the per-request view of a ``PrefillFetchResult``."""

    request_id: int
    prefill_engine_id: int

    def __init__(self, request_id: int, prefill_engine_id: int) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "prefill_engine_id", prefill_engine_id)


@dataclass(frozen=True, slots=True, init=False)
class DecodeAssignment:
    """One request's final (PE, DE) pair and read plan: the per-request view of a
    ``DecodeFetchResult``."""

    request_id: int
    prefill_engine_id: int
    decode_engine_id: int
    load_plan: LoadPlan

    def __init__(
        self, request_id: int, prefill_engine_id: int, decode_engine_id: int, load_plan: LoadPlan
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "prefill_engine_id", prefill_engine_id)
        object.__setattr__(self, "decode_engine_id", decode_engine_id)
        object.__setattr__(self, "load_plan", load_plan)


@dataclass(frozen=True, slots=True, init=False)
class PrefillFetchResult:
    """A PE fetch's answer: the requests placed now on the group's PEs, FIFO order.

    Entry i of each tuple describes the i-th placed request. The read side is not fixed yet:
    it is decided when a DE fetch places the request (``DecodeFetchResult``), and the PE
    starts neither reads nor prefill before then. Columnar, like one step's scheduler output:
    cheap to build on the placement path and to serialise.
    """

    request_ids: tuple[int, ...]
    prefill_engine_ids: tuple[int, ...]

    def __init__(self, request_ids: tuple[int, ...], prefill_engine_ids: tuple[int, ...]) -> None:
        if len(prefill_engine_ids) != len(request_ids):
            raise ValueError(
                f"{len(request_ids)} request ids, {len(prefill_engine_ids)} prefill engine ids"
            )
        object.__setattr__(self, "request_ids", request_ids)
        object.__setattr__(self, "prefill_engine_ids", prefill_engine_ids)

    def __len__(self) -> int:
        return len(self.request_ids)

    def assignments(self) -> tuple[PrefillAssignment, ...]:
        return tuple(
            PrefillAssignment(*entry)
            for entry in zip(self.request_ids, self.prefill_engine_ids, strict=True)
        )


@dataclass(frozen=True, slots=True, init=False)
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

    def __init__(
        self,
        request_ids: tuple[int, ...],
        prefill_engine_ids: tuple[int, ...],
        decode_engine_ids: tuple[int, ...],
        load_plans: tuple[LoadPlan, ...],
    ) -> None:
        num = len(request_ids)
        if not len(prefill_engine_ids) == len(decode_engine_ids) == len(load_plans) == num:
            raise ValueError(
                f"{num} request ids, {len(prefill_engine_ids)} prefill engine ids, "
                f"{len(decode_engine_ids)} decode engine ids, {len(load_plans)} load plans"
            )
        object.__setattr__(self, "request_ids", request_ids)
        object.__setattr__(self, "prefill_engine_ids", prefill_engine_ids)
        object.__setattr__(self, "decode_engine_ids", decode_engine_ids)
        object.__setattr__(self, "load_plans", load_plans)

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

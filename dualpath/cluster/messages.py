"""Messages between the scheduler process and the engines (SPEC §2, §6).

A request's life on the wire::

    engine  --EngineInfo-->  scheduler  --PeerTable-->  every engine       (membership)
    engine  --EngineReport--> scheduler  (every fetch interval: the pull, SPEC §6)
    scheduler --Assignment--> PE and DE  (pair and LoadPlan fixed; reads start)
    DE --DecodeReady--> scheduler --> PE (DE buffer slots known, DE-side hit KV in them)
    PE --PrefillDone--> scheduler --> DE (every layer's KV written into the DE buffer)
    DE --TokenUpdate--> scheduler        (streamed tokens; the last one carries finish_reason)

A request is sent in full once (``Assignment``); everything after carries only its id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dualpath.control.codec import message

PREFILL = "prefill"
DECODE = "decode"


@message("engine-info")
@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Sent once after the hello: what peers need to move KV to and from this engine."""

    engine_id: int
    role: str  # PREFILL or DECODE
    node_id: int
    transport_name: str
    transport_metadata: bytes
    # Serialised descriptor of the engine's registered KV buffer (PE or DE buffer).
    buffer_descriptor: bytes
    num_buffer_slots: int
    num_kv_blocks: int  # device KV blocks (the DE memory gate's unit)


@message("peers")
@dataclass(frozen=True, slots=True)
class PeerTable:
    engines: tuple[EngineInfo, ...]


@message("report")
@dataclass(frozen=True, slots=True)
class EngineReport:
    """An engine's load at a fetch (SPEC §6: seq_e, tok_e, read_q)."""

    engine_id: int
    num_seqs: int
    num_tokens: int
    num_free_kv_blocks: int
    # Tokens this engine has queued for storage reads; a node's read_q sums its engines'.
    read_queue_tokens: int
    # Cumulative bytes by "link.class.direction", for metrics and benchmarks.
    link_bytes: dict[str, int]
    num_buffer_slots_used: int


@message("assign")
@dataclass(frozen=True, slots=True)
class Assignment:
    """A request placed on a (PE, DE) pair with its read plan; sent to both, once."""

    request_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: dict[str, Any]  # dualpath.types.sampling_params_to_dict
    # The hit prefix's leading blocks are read on the PE side, the next ones on the DE side.
    num_prefill_side_blocks: int
    num_decode_side_blocks: int
    prefill_engine_id: int
    decode_engine_id: int

    @property
    def num_hit_blocks(self) -> int:
        return self.num_prefill_side_blocks + self.num_decode_side_blocks


@message("decode-ready")
@dataclass(frozen=True, slots=True)
class DecodeReady:
    """DE -> PE: the prompt's blocks have these DE buffer slots (block order) and the
    DE-side hit blocks are in them."""

    request_id: int
    slots: tuple[int, ...]
    # Leading DE-side hit blocks actually read; a block the DE could not read (and those
    # after it) must be recomputed by the PE.
    num_decode_side_blocks_read: int


@message("prefill-done")
@dataclass(frozen=True, slots=True)
class PrefillDone:
    """PE -> DE: every layer's prompt KV is in the DE buffer; the PE sampled the first token."""

    request_id: int
    first_token_id: int
    first_token_logprob: tuple[float, tuple[tuple[int, float], ...]] | None
    # Prompt tokens whose KV came from the store (PE and DE side), for usage reporting.
    num_cached_tokens: int


@message("tokens")
@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """New tokens of a request; ``finish_reason`` set on the last update."""

    request_id: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None


@message("request-failed")
@dataclass(frozen=True, slots=True)
class RequestFailed:
    request_id: int
    reason: str


@message("cancel")
@dataclass(frozen=True, slots=True)
class CancelRequest:
    request_id: int


@message("heartbeat")
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Scheduler -> engine, periodically: an engine that stops hearing these exits."""

    num_live_engines: int


@message("shutdown")
@dataclass(frozen=True, slots=True)
class Shutdown:
    reason: str

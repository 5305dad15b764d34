"""The cluster's protocol: messages between the scheduler and the engines (SPEC §2, §6), and
the ``RequestEvent``s the scheduler hands the serving side.

It sits below every part that speaks it: ``engine``, ``cluster`` and ``server`` import it, and
it imports only the codec (``tests/test_imports.py`` checks the direction).

A request's life on the wire::

    engine  --EngineInfo-->  scheduler  --PeerTable-->  every client       (membership)
    engine  --EngineReport--> scheduler  (every fetch interval: the pull, SPEC §6)
    scheduler --Assignment--> PE and DE  (pair and LoadPlan fixed; reads start)
    PE --PrefillHeld--> scheduler --> DE (a PE that probes vLLM's prefix cache: hit blocks it
                                          holds; only where Assignment.is_prefill_held_sent)
    DE --DecodeReady--> scheduler --> PE (DE buffer slots known, DE-side hit KV in them)
    PE --PrefillDone--> scheduler --> DE (every layer's KV written into the DE buffer)
    DE --TokenUpdate--> scheduler        (streamed tokens; the last one carries finish_reason)

A request is sent in full once (``Assignment``); everything after carries only its id.

An engine speaks for itself: its control client is ``engine-<id>``, it sends one
``EngineInfo`` and an ``EngineReport`` every fetch interval, and the report of a group's first
engine (its leader) is the group's fetch. (SPEC §6 has a leader speak for its whole group; the
scheduler benchmark's simulated leaders do, with the messages of
``dualpath.bench.leader_protocol``.)
"""

from __future__ import annotations

import array
from collections.abc import Iterable
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
    # A vLLM server the user started with our connector (``dualpath vllm-config``): the
    # OpenAI URL the front door forwards its requests to. "" for a ``dualpath engine``.
    url: str = ""
    # The store namespace its KV is keyed by (``KVIdentity.fingerprint``); the scheduler
    # refuses an engine whose KV would not match the blocks it finds hits for. "": not said.
    kv_fingerprint: str = ""
    # A PE that looks its prompts up in its engine's own prefix cache (``--engine vllm``) and
    # tells each DE how many leading hit blocks it holds (``PrefillHeld``), so that the DE
    # reads none of those. False (ours; a vLLM server's, whose cache is not probed): it never
    # says, and its DEs must not wait to hear it (``Assignment.is_prefill_held_sent``).
    reports_prefill_held: bool = False
    # A DE that prefills a request itself when the scheduler places it there alone
    # (``Assignment.is_local_prefill``: a short append to a session it holds, ``--engine vllm``).
    # False (ours; a vLLM server's, whose requests come over HTTP): always a PE's.
    prefills_locally: bool = False


@message("peers")
@dataclass(frozen=True, slots=True)
class PeerTable:
    engines: tuple[EngineInfo, ...]


@message("report")
@dataclass(frozen=True, slots=True)
class EngineReport:
    """An engine's load at a fetch (SPEC §6: seq_e, tok_e, read_q; and write_q)."""

    engine_id: int
    num_seqs: int
    num_tokens: int
    num_free_kv_blocks: int
    # Tokens this engine has queued for storage reads; a node's read_q sums its engines'.
    read_queue_tokens: int
    # Cumulative counters for metrics and benchmarks: bytes by "link.class" (e.g.
    # "node0.snic.kv"), and "store_read_bytes" (hit KV this engine read), "busy_us" (time in
    # prefill batches or decode steps), "store_<stat>" (its store's StoreStats),
    # "transport_written_<peer>" / "transport_read_<peer>" (KV it wrote to or read from engine
    # <peer> over the transport); and two levels: "buffer_used_bytes" and
    # "buffer_capacity_bytes" (its host KV buffer).
    link_bytes: dict[str, int]
    num_buffer_slots_used: int
    # Tokens this engine has queued for storage writes (a DE persisting KV, SPEC §2); a node's
    # write_q sums its engines' (``dualpath.scheduler.message.NodeSnapshot``).
    write_queue_tokens: int = 0


# EngineReport.link_bytes keys of the transfers an engine started, followed by the peer's id.
TRANSPORT_WRITTEN_PREFIX = "transport_written_"
TRANSPORT_READ_PREFIX = "transport_read_"


@message("assign")
@dataclass(frozen=True, slots=True)
class Assignment:
    """A request placed on a (PE, DE) pair with its read plan; sent to both, once (encoded
    once: the same bytes go to both)."""

    request_id: int
    # The whole prompt, packed (``pack_token_ids``; a list or tuple given here is packed);
    # read-only, like the rest of the message. The codec ships it as one blob of uint32s: for
    # a 32K-token prompt, about 20 us to encode or decode against 1.2-1.4 ms as msgpack ints.
    prompt_token_ids: array.array
    sampling: dict[str, Any]  # dualpath.types.sampling_params_to_dict
    # The hit prefix's leading blocks are read on the PE side, the next ones on the DE side.
    num_prefill_side_blocks: int
    num_decode_side_blocks: int
    prefill_engine_id: int
    decode_engine_id: int
    # The last this many of ``prompt_token_ids`` are output the caller has already been sent
    # (a request going on after the loss of its DE): the PE samples output token
    # ``num_output_tokens`` next, and the DE counts them toward max_tokens and stop rules.
    num_output_tokens: int = 0
    # The PE sends ``PrefillHeld`` for this request and the DE starts its side's reads only
    # once it has it: set where the PE reports what its engine holds
    # (``EngineInfo.reports_prefill_held``) and the DE has blocks to read. Both engines decide
    # from these same bytes; False: the DE reads at once, the PE relies on no DE-side block
    # its engine holds (no PE -> scheduler -> DE round trip before the DE's reads).
    is_prefill_held_sent: bool = False
    # The tenant namespace of the prompt's KV (``types.RequestScope``): both engines key the
    # blocks they read and persist under it (``kv.hashing``), and a vLLM engine gets it with
    # the request, so its own prefix cache keeps tenants apart too. None: the shared one.
    cache_salt: str | None = None
    # The request continues an agent session: its DE keeps the blocks it reads and writes in
    # its store for this long after the request (``KVStore.retain``), each turn extending it.
    # A duration, not a deadline: each engine times it on its own clock. 0: no session.
    session_retention_s: float = 0.0

    def __post_init__(self) -> None:
        if not _is_packed(self.prompt_token_ids):
            object.__setattr__(self, "prompt_token_ids", pack_token_ids(self.prompt_token_ids))

    @property
    def num_hit_blocks(self) -> int:
        return self.num_prefill_side_blocks + self.num_decode_side_blocks

    @property
    def is_local_prefill(self) -> bool:
        """Placed on its DE alone (conditional disaggregation, ``local_prefill_tokens``): the
        DE reads every hit block, prefills the rest and decodes; no PE takes part."""
        return self.prefill_engine_id == self.decode_engine_id


def client_id_of(engine_id: int) -> str:
    """An engine's control client id, and its transport peer name: ``engine-<id>``."""
    return f"engine-{engine_id}"


def engine_id_of(client_id: str) -> int:
    """The engine id in ``engine-<id>``; -1 for any other name."""
    try:
        return int(client_id.removeprefix("engine-"))
    except ValueError:
        return -1


def pack_token_ids(token_ids: Iterable[int]) -> array.array:
    """A new ``array("I")`` of the token ids, the form messages carry them in; ``ValueError``
    for an id outside [0, 2**32)."""
    if _is_packed(token_ids):
        return array.array("I", token_ids)  # a copy (memcpy): the caller keeps its own
    if isinstance(token_ids, bytes | bytearray | memoryview | str):
        # array("I", b"...") would take the bytes as packed ids, not as one id each.
        raise ValueError(f"token ids must be ints, got {type(token_ids).__name__}")
    try:
        return array.array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from exc


def _is_packed(token_ids: object) -> bool:
    return type(token_ids) is array.array and token_ids.typecode == "I"


@message("prefill-held")
@dataclass(frozen=True, slots=True)
class PrefillHeld:
    """PE -> DE, for an Assignment with ``is_prefill_held_sent`` (a PE whose engine keeps a
    prefix cache of its own, vLLM's): it holds the prompt's first ``num_blocks`` blocks, so the
    DE reads none of them on its side (the PE sends them) and starts its side's reads only
    once it knows this."""

    request_id: int
    num_blocks: int


@message("decode-ready")
@dataclass(frozen=True, slots=True)
class DecodeReady:
    """DE -> PE: the prompt's blocks have these DE buffer slots (block order) and the
    DE-side hit blocks are in them."""

    request_id: int
    slots: tuple[int, ...]
    # Leading DE-side hit blocks actually read (with those the PE said it holds: PrefillHeld);
    # a block the DE could not read (and those after it) must be recomputed by the PE.
    num_decode_side_blocks_read: int


@message("prefill-done")
@dataclass(frozen=True, slots=True)
class PrefillDone:
    """PE -> DE: every layer's prompt KV is in the DE buffer; the PE sampled the first token.
    A DE that prefilled the request itself (``Assignment.is_local_prefill``) sends it to the
    scheduler alone."""

    request_id: int
    first_token_id: int
    first_token_logprob: tuple[float, tuple[tuple[int, float], ...]] | None
    # Prompt tokens whose KV came from the store (PE and DE side), for usage reporting.
    num_cached_tokens: int
    # Why the request ends at this token, if it does (a stop or end-of-sequence token, or
    # max_tokens reached; stop strings are the DE's): the DE still sends the finish, and the
    # scheduler finishes the request with it if that DE dies first.
    finish_reason: str | None = None


@message("tokens")
@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """New tokens of a request; ``finish_reason`` set on the last update."""

    request_id: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    # On the last update: keys of the request's blocks the DE is still writing to the store.
    # Until ``KVPersisted`` names the request, the scheduler counts them as hits for a prompt
    # that extends this one (it waits for them rather than recomputing them).
    persisting_keys: tuple[str, ...] = ()


@message("kv-persisted")
@dataclass(frozen=True, slots=True)
class KVPersisted:
    """DE -> scheduler: the ``persisting_keys`` of these finished requests are written (or
    failed to be: the store is the truth, so the scheduler looks them up again)."""

    request_ids: tuple[int, ...]


@message("request-failed")
@dataclass(frozen=True, slots=True)
class RequestFailed:
    request_id: int
    reason: str
    # The request itself is fine and another placement may succeed (a peer engine died or
    # timed out mid-transfer); the scheduler places it again.
    is_retryable: bool = False
    # The engine whose transfer failed, when known (-1: unknown). A PE's failed batch fails
    # every request in it, also those whose own DE is fine: they are placed again at once.
    peer_engine_id: int = -1
    # A vLLM server DE refused the placement: the prompt its server rendered from the client's
    # body is not the one placed. Its vLLM serves the request alone (it computes the whole
    # prompt itself: the client's tokens are right); nothing of the placement is loaded.
    is_prompt_refused: bool = False


@message("cancel")
@dataclass(frozen=True, slots=True)
class CancelRequest:
    request_id: int


# Each side sends this many heartbeats per heartbeat timeout: one late or lost is no death.
HEARTBEATS_PER_TIMEOUT = 4
# An engine gives the scheduler up after this many heartbeat timeouts of silence. More than
# one: the scheduler sends its heartbeat from its loop, which a loaded host can stall for
# seconds, and an engine that leaves and joins again counts as a death. Waiting longer costs
# nothing: the scheduler declares a silent engine dead after one timeout, and then answers
# whatever that engine sends with ``Rejected``, so it leaves at once all the same.
SCHEDULER_SILENCE_TIMEOUTS = 3


@message("heartbeat")
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Scheduler -> engine, periodically: an engine that stops hearing these exits."""

    num_live_engines: int


@message("engine-heartbeat")
@dataclass(frozen=True, slots=True)
class EngineHeartbeat:
    """Engine -> scheduler, every heartbeat period, from a thread of the engine's own
    (``dualpath.cluster.engine_heartbeat``): the engine is alive even while one unit of its
    work (a prefill batch, a decode step) silences its loop, and ``step_s`` says how long that
    unit has run. A step longer than the heartbeat timeout is busy, not dead."""

    engine_id: int
    step_s: float  # the unit of work in progress's time so far; 0.0 between units


@message("shutdown")
@dataclass(frozen=True, slots=True)
class Shutdown:
    reason: str


# --- in process: what the cluster hands the serving side -----------------------------------


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """What the serving side sees of a request: new tokens, then one final event."""

    request_id: int
    token_ids: tuple[int, ...]
    finish_reason: str | None  # set on the last event; "error" with ``error`` on failure
    num_cached_tokens: int
    error: str | None = None
    logprobs: tuple | None = None
    time_s: float = 0.0
    # The error is the cluster's state, not the request's: no engine of a role it needs is
    # alive (the server answers 503, not 500).
    is_unavailable: bool = False
    # Set on the one event that says the request was placed on a vLLM server DE (``url``):
    # the front door forwards it there (``Forward``); that placement's tokens reach the
    # client over HTTP, not as events.
    forward: Forward | None = None
    # A forwarded request's placement was lost with an engine (or a transfer to it): the front
    # door places it again itself, going on from the tokens its client was sent.
    is_engine_lost: bool = False
    # A forwarded request's DE refused its placement's prompt (``RequestFailed``): its server
    # serves the request alone, and its HTTP answer is the client's as ever.
    is_prompt_refused: bool = False
    # On the event that brings a first placement's first token: the seconds of each stage of
    # its path through the scheduler (``cluster.first_token.FIRST_TOKEN_STAGES``).
    first_token_stages_s: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Forward:
    """Where a request placed on vLLM servers goes: the placement's id (the connector's
    ``dualpath_request_id``), its engines, and their OpenAI URLs ("" for a PE that is a
    ``dualpath engine``: it is sent the Assignment only)."""

    request_id: int
    prefill_engine_id: int
    decode_engine_id: int
    prefill_url: str
    decode_url: str

"""The role interface every engine kind implements: one engine's work as a PE or a DE.

An engine process drives its role through ``RoleEngine`` (take a placed request, a peer's
message, a cancel; do one unit of work; say its load) without asking which role, or which
engine kind, it holds. The pieces both kinds share live here, below the cluster:

    RoleEngine              the interface; ``RoleLoad`` what its reports say of its load
    DecodePeers             a PE's reach into every live DE's buffer over the transport
    failed_batch_messages   what a PE sends back for the requests of a batch that raised
    prefill_batcher         a PE's compute-quota batcher, as the simulator's PEs build theirs

Our engine's roles are ``dualpath.cluster.roles``; vLLM's are ``dualpath.vllm.roles``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from dualpath.config import EngineProcessConfig
from dualpath.engine.remote_buffer import TransportRemoteBuffer, TransportStaging
from dualpath.errors import DualPathError, TransferError
from dualpath.kv.store import KVStore
from dualpath.protocol import (
    DECODE,
    Assignment,
    DecodeReady,
    EngineInfo,
    PeerTable,
    PrefillDone,
    PrefillHeld,
    RequestFailed,
    client_id_of,
    engine_id_of,
)
from dualpath.scheduler.attention_predictor import AttentionTimePredictor
from dualpath.scheduler.batching import PrefillBatcher
from dualpath.transfer.transport import BufferDescriptor, Transport

logger = logging.getLogger(__name__)

# Longest context the start-up profile times (~0.4 s for the tiny model on one CPU thread);
# the fitted quadratic term extrapolates beyond it.
MAX_PROFILED_CONTEXT_TOKENS = 2048

Send = Callable[[object], None]
# What the scheduler relays between a request's two engines.
PeerMessage = DecodeReady | PrefillDone | PrefillHeld


@dataclass(frozen=True, slots=True)
class RoleLoad:
    """What an engine's report says of its load (``EngineReport``'s fields)."""

    num_seqs: int
    num_tokens: int
    num_free_blocks: int  # device KV blocks free (a DE's memory gate); 0 on a PE
    read_queue_tokens: int  # storage reads queued (its share of its node's read_q)
    write_queue_tokens: int  # Full Blocks queued for the store (a DE's write_q); 0 on a PE


class RoleEngine(Protocol):
    """One engine's work, whatever its role."""

    num_kv_blocks: int  # device KV blocks (the DE memory gate's unit); 0 on a PE

    def add(self, assignment: Assignment) -> None:
        """Take a placed request (``ValueError`` for one it cannot serve)."""
        ...

    def on_peer_message(self, msg: PeerMessage) -> None:
        """A message the scheduler relays from the request's other engine."""
        ...

    def connect_peers(self, table: PeerTable) -> None: ...

    def cancel(self, request_id: int) -> None: ...

    def work(self, send: Send, between_layers: Callable[[], None]) -> bool:
        """One unit of work, its messages sent through ``send``; True if there was any."""
        ...

    def load(self) -> RoleLoad: ...

    @property
    def num_read_bytes(self) -> int:
        """Hit KV this engine read from the store (its side's share of the read paths)."""
        ...

    @property
    def num_engine_cached_bytes(self) -> int:
        """Hit KV counted cached that neither side read because the engine still held it in
        its own prefix cache (vLLM's); 0 for our engine, which has none."""
        ...

    @property
    def transport_bytes(self) -> Mapping[int, tuple[int, int]]:
        """Peer engine id -> (bytes this engine wrote to it, bytes it read from it) over the
        transport, cumulative: the transfers it started (a PE's; a DE starts none)."""
        ...

    @property
    def store(self) -> KVStore | None: ...

    def close(self, flush_timeout_s: float) -> int:
        """Release everything; the number of store writes abandoned unfinished."""
        ...


def prefill_batcher(
    config: EngineProcessConfig, predictor: AttentionTimePredictor
) -> PrefillBatcher:
    """A PE's batcher: the scheduler config's compute quota and minimum chunk, cut at Full
    Blocks, as the simulator's PEs build theirs."""
    return PrefillBatcher.from_config(
        config.scheduler, predictor, chunk_align_tokens=config.engine.block_size_tokens
    )


class DecodePeers:
    """A PE's reach into every live DE's buffer over the transport (both engine kinds)."""

    def __init__(
        self, transport: Transport, staging: TransportStaging, *, peer_timeout_s: float
    ) -> None:
        self.transport = transport
        self.staging = staging
        self.peer_timeout_s = peer_timeout_s
        self.remotes: dict[int, TransportRemoteBuffer] = {}  # DE engine id -> its buffer
        self._peer_infos: dict[int, EngineInfo] = {}  # what each was connected from
        self._peer_name_to_engine: dict[str, int] = {}  # every DE ever reached

    def moved_bytes(self) -> dict[int, tuple[int, int]]:
        """DE engine id -> (bytes written to it, bytes read from it) over the transport, for
        every DE this PE ever reached (``RoleEngine.transport_bytes``)."""
        return {
            self._peer_name_to_engine[name]: (written, read)
            for name, (written, read) in self.staging.moved_bytes.items()
            if name in self._peer_name_to_engine
        }

    def connect(self, table: PeerTable) -> None:
        """Reach every live DE's buffer. A DE that joined again (restarted under its id) has
        new transport metadata and a new buffer: connected anew. One the table no longer
        lists is dead: its requests wait (the scheduler places them again)."""
        live = {info.engine_id: info for info in table.engines if info.role == DECODE}
        for engine_id in [e for e in self.remotes if e not in live]:
            del self.remotes[engine_id]
            del self._peer_infos[engine_id]
        for engine_id, info in live.items():
            if self._peer_infos.get(engine_id) == info:
                continue
            peer_name = client_id_of(engine_id)
            self._peer_name_to_engine[peer_name] = engine_id
            self.transport.connect(peer_name, info.transport_metadata)
            descriptor = BufferDescriptor.from_dict(msgpack.unpackb(info.buffer_descriptor))
            self.remotes[engine_id] = TransportRemoteBuffer(
                self.staging, peer_name, descriptor, timeout_s=self.peer_timeout_s
            )
            self._peer_infos[engine_id] = info


def failed_batch_messages(
    exc: Exception,
    failed: list[int],
    requests: Mapping[int, Any],
    cancel: Callable[[int], None],
) -> list[RequestFailed]:
    """``RequestFailed`` for the requests of a PE batch that raised ``exc``. A DE died or timed
    out mid-transfer (a ``DualPathError``): placing them again may succeed. Any other error is
    a bug these requests met: placing them again would repeat it. When the transfer names the
    DE, the PE's other ``requests`` (id -> request with its ``assignment``) bound for it are
    cancelled (``cancel(id)``) and given back with the batch: they would fail the next batches
    one by one."""

    def queued_for(engine_id: int) -> list[int]:
        queued = [
            r.request_id for r in requests.values() if r.assignment.decode_engine_id == engine_id
        ]
        for request_id in queued:
            cancel(request_id)
        return queued

    is_retryable = isinstance(exc, DualPathError)
    if is_retryable:
        logger.error("prefill batch failed: %s", exc)
    else:
        logger.error("prefill batch failed", exc_info=exc)
    peer_name = exc.peer_name if isinstance(exc, TransferError) else None
    peer_engine_id = -1 if peer_name is None else engine_id_of(peer_name)
    if peer_engine_id >= 0:
        failed = failed + [r for r in queued_for(peer_engine_id) if r not in failed]
    return [
        RequestFailed(
            request_id,
            f"prefill failed: {exc!r}",
            is_retryable=is_retryable,
            peer_engine_id=peer_engine_id,
        )
        for request_id in failed
    ]

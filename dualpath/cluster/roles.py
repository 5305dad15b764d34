"""What an engine process does for its role: the PE and the DE behind one interface.

``engine_process`` drives either through ``RoleEngine`` (take a placed request, a peer's
message, a cancel; do one unit of work; say its load) without asking which one it holds::

    PrefillRole   PrefillEngine + the transport to every DE's buffer; one unit of work is a
                  prefill batch (``between_layers`` runs between its layers)
    DecodeRole    DecodeEngine over an ``LLMEngine``; one unit of work is a decode step

``make_role`` is the one place that looks at the role.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from dualpath.config import EngineProcessConfig
from dualpath.engine.buffers import KVBuffer
from dualpath.engine.decode import DecodeEngine
from dualpath.engine.llm import LLMEngine
from dualpath.engine.prefill import PrefillEngine
from dualpath.engine.profile import profile_layer_time
from dualpath.engine.remote_buffer import TransportRemoteBuffer, TransportStaging
from dualpath.errors import DualPathError, TransferError
from dualpath.kv.store import FileKVStore, KVStore
from dualpath.model.identity import KVIdentity
from dualpath.model.loader import LoadedModel
from dualpath.protocol import (
    DECODE,
    PREFILL,
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
from dualpath.transfer.traffic import Mover
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


def make_role(
    config: EngineProcessConfig,
    loaded: LoadedModel,
    identity: KVIdentity,
    buffer: KVBuffer,
    transport: Transport,
    *,
    mover: Mover,
    wake: Callable[[], None],
) -> RoleEngine:
    """The engine ``config.role`` names, over the process's model, buffer and transport;
    ``mover`` charges its movements to its links, ``wake`` ends the process's poll early
    (a read finished)."""
    if config.role == DECODE:
        llm_engine = LLMEngine(loaded, config.engine, config.store, mover=mover)
        return DecodeRole(DecodeEngine(llm_engine, buffer, mover=mover, on_read_done=wake))
    assert config.role == PREFILL, config.role
    engine_config = config.engine
    if engine_config.num_threads is not None:
        import torch

        torch.set_num_threads(engine_config.num_threads)
    store = (
        FileKVStore.from_config(config.store, identity.layout, identity.fingerprint)
        if config.store.is_enabled
        else None
    )
    max_model_len = engine_config.max_model_len or loaded.config.max_position_embeddings
    predictor = profile_layer_time(
        loaded.model,
        device=loaded.device,
        max_context_tokens=min(max_model_len, MAX_PROFILED_CONTEXT_TOKENS),
    )
    engine = PrefillEngine(
        loaded.model,
        identity,
        store,
        buffer,
        dtype=loaded.dtype,
        device=loaded.device,
        is_layerwise=config.cluster.settings.is_layerwise,
        mover=mover,
        num_io_threads=engine_config.num_io_threads,
        on_read_done=wake,
        batcher=prefill_batcher(config, predictor),
    )
    max_blocks = -(-loaded.config.max_position_embeddings // engine_config.block_size_tokens)
    staging = TransportStaging(
        transport, identity.layout, max_read_blocks=max_blocks, ring_blocks=max_blocks
    )
    return PrefillRole(engine, transport, staging, peer_timeout_s=config.transfer_timeout_s)


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


class PrefillRole:
    """A PE: prefill batches whose KV goes to each request's DE buffer over the transport."""

    num_kv_blocks = 0

    def __init__(
        self,
        engine: PrefillEngine,
        transport: Transport,
        staging: TransportStaging,
        *,
        peer_timeout_s: float,
    ) -> None:
        self.engine = engine
        self.peers = DecodePeers(transport, staging, peer_timeout_s=peer_timeout_s)
        self.remotes = self.peers.remotes

    def add(self, assignment: Assignment) -> None:
        self.engine.add(assignment)

    def on_peer_message(self, msg: PeerMessage) -> None:
        if isinstance(msg, DecodeReady):
            self.engine.on_decode_ready(msg)
        else:
            logger.warning("a prefill engine got %s", type(msg).__name__)

    def connect_peers(self, table: PeerTable) -> None:
        self.peers.connect(table)

    def cancel(self, request_id: int) -> None:
        self.engine.cancel(request_id)

    def work(self, send: Send, between_layers: Callable[[], None]) -> bool:
        # A request waits until its DE's transport metadata has arrived.
        batch = self.engine.next_batch(
            lambda request: request.assignment.decode_engine_id in self.remotes
        )
        if not batch:
            return False
        try:
            finished = self.engine.run_batch(batch, self.remotes.__getitem__, between_layers)
        except Exception as exc:  # its requests are cancelled here; the engine goes on
            failed = [request.request_id for request, _ in batch]
            messages = failed_batch_messages(exc, failed, self.engine.requests, self.engine.cancel)
            for message in messages:
                send(message)
            return True
        for done in finished:
            send(done)
        return True

    def load(self) -> RoleLoad:
        engine = self.engine
        # A PE persists nothing (SPEC §2): no write queue.
        return RoleLoad(
            len(engine.requests), engine.num_tokens, 0, engine.num_queued_read_tokens, 0
        )

    @property
    def num_read_bytes(self) -> int:
        return self.engine.num_read_bytes

    num_engine_cached_bytes = 0

    @property
    def store(self) -> KVStore | None:
        return self.engine.store

    def close(self, flush_timeout_s: float) -> int:
        self.engine.close()
        return 0


class DecodeRole:
    """A DE: DE-side reads into its buffer, adopted prompts, decode steps, persisted blocks."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self.num_kv_blocks = engine.engine.pool.num_blocks

    def add(self, assignment: Assignment) -> None:
        self.engine.add(assignment)

    def on_peer_message(self, msg: PeerMessage) -> None:
        if isinstance(msg, PrefillDone):
            self.engine.on_prefill_done(msg)
        else:
            logger.warning("a decode engine got %s", type(msg).__name__)

    def connect_peers(self, table: PeerTable) -> None:
        """The DE is only ever the remote side."""

    def cancel(self, request_id: int) -> None:
        self.engine.cancel(request_id)

    def work(self, send: Send, between_layers: Callable[[], None]) -> bool:
        engine = self.engine
        for ready in engine.poll_ready():
            send(ready)
        try:
            updates = engine.step()
        except Exception as exc:
            self._fail_all(exc, send)
            return True
        for update in updates:
            send(update)
        persisted = engine.poll_persisted()
        if persisted is not None:
            send(persisted)
        return bool(updates) or engine.engine.has_unfinished_requests()

    def _fail_all(self, exc: Exception, send: Send) -> None:
        """A decode step raised (a bug: the sampler and the cache raise on no request's
        values): the step's batch is every running request, so all of this engine's requests
        fail and are freed, and the engine goes on serving new ones."""
        logger.exception("decode step failed")
        for request_id in self.engine.request_ids:
            self.engine.cancel(request_id)
            send(RequestFailed(request_id, f"decode failed: {exc!r}"))

    def load(self) -> RoleLoad:
        engine = self.engine
        return RoleLoad(
            engine.num_seqs,
            engine.num_tokens,
            engine.engine.pool.num_free_blocks,
            engine.num_queued_read_tokens,
            engine.num_queued_write_tokens,
        )

    @property
    def num_read_bytes(self) -> int:
        return self.engine.num_read_bytes

    num_engine_cached_bytes = 0

    @property
    def store(self) -> KVStore | None:
        store_io = self.engine.engine.store_io
        return None if store_io is None else store_io.store

    def close(self, flush_timeout_s: float) -> int:
        """Pending store writes get ``flush_timeout_s``; past it they are abandoned and the
        store is left open (its writer threads are stuck in it)."""
        self.engine.close()
        llm_engine = self.engine.engine
        num_abandoned = 0
        if llm_engine.store_io is not None:
            num_abandoned = llm_engine.store_io.flush(flush_timeout_s)
        if not num_abandoned:
            llm_engine.close()
        return num_abandoned

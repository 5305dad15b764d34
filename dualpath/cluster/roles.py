"""Our engine's roles: the PE and the DE behind ``RoleEngine`` (``dualpath.engine.role``).

``engine_process`` drives either without asking which one it holds::

    PrefillRole   PrefillEngine + the transport to every DE's buffer; one unit of work is a
                  prefill batch (``between_layers`` runs between its layers)
    DecodeRole    DecodeEngine over an ``LLMEngine``; one unit of work is a decode step

``make_role`` is the one place that looks at the role (vLLM's roles: ``dualpath.vllm.roles``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType

from dualpath.config import EngineProcessConfig
from dualpath.engine.buffers import KVBuffer
from dualpath.engine.decode import DecodeEngine
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.prefill import PrefillEngine
from dualpath.engine.profile import profile_layer_time
from dualpath.engine.remote_buffer import TransportStaging
from dualpath.engine.role import (
    MAX_PROFILED_CONTEXT_TOKENS,
    DecodePeers,
    PeerMessage,
    RoleEngine,
    RoleLoad,
    Send,
    failed_batch_messages,
    prefill_batcher,
)
from dualpath.kv.file_store import FileKVStore
from dualpath.kv.store import KVStore
from dualpath.model.identity import KVIdentity
from dualpath.model.loader import LoadedModel
from dualpath.protocol import (
    DECODE,
    PREFILL,
    Assignment,
    DecodeReady,
    PeerTable,
    PrefillDone,
    RequestFailed,
)
from dualpath.transfer.traffic import Mover
from dualpath.transfer.transport import Transport

logger = logging.getLogger(__name__)


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
        batch = self.engine.next_batch(self.remotes.get)
        if not batch:
            return False
        try:
            outcome = self.engine.run_batch(batch, between_layers)
        except Exception as exc:  # a bug: its requests are cancelled here; the engine goes on
            failed = [request.request_id for request, _ in batch]
            messages = failed_batch_messages(exc, failed, self.engine.requests, self.engine.cancel)
            for message in messages:
                send(message)
            return True
        sent: set[int] = set()
        for request_id, exc in outcome.failed:  # a transfer error: those it touched fail
            for message in failed_batch_messages(
                exc, [request_id], self.engine.requests, self.engine.cancel
            ):
                if message.request_id not in sent:  # one DE's failures name each other
                    sent.add(message.request_id)
                    send(message)
        for done in outcome.done:
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
        return self.engine.store_reads.num_read_bytes

    num_engine_cached_bytes = 0

    @property
    def transport_bytes(self) -> Mapping[int, tuple[int, int]]:
        return self.peers.moved_bytes()

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
        return self.engine.store_reads.num_read_bytes

    num_engine_cached_bytes = 0
    transport_bytes: Mapping[int, tuple[int, int]] = MappingProxyType({})  # starts none

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

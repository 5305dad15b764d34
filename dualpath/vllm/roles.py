"""A PE and a DE whose model runs on vLLM (``--engine vllm``), behind the same ``RoleEngine``
interface as ours (``dualpath.engine.role``): the same messages in and out, the same buffers,
store reads and transport.

    VllmPrefillRole   Assignment -> PE-side hit blocks read into the PE buffer (StoreReader, as
                      ours); with DecodeReady, the request goes to vLLM for one token, its
                      connector plan loading the hits per layer (the PE side's from the
                      buffer, the DE side's pulled from the DE's buffer) and sending every
                      layer's KV the DE does not hold to the DE's buffer -> PrefillDone
    VllmDecodeRole    Assignment -> buffer slots for the whole prompt, DE-side hit blocks read
                      into them -> DecodeReady; with PrefillDone, the request goes to vLLM as
                      prompt + first token, its plan loading the prompt's KV from the buffer
                      (then freed) and persisting every block not in the store -> TokenUpdates,
                      KVPersisted

A PE's vLLM keeps the KV of prompts it computed in its prefix cache: hit blocks it still holds
are read by neither side (``num_engine_cached_bytes`` counts them, so that the sides' reads
plus these equal the cached tokens' KV). The PE tells the DE how many it holds (PrefillHeld,
relayed by the scheduler as soon as the PE takes the request), and the DE starts its side's
reads once it knows, skipping those; the PE sends them with the rest the DE lacks. A seeded
sampler restarts on the DE (vLLM samples the DE's tokens), so only greedy requests give one
vLLM instance's exact tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from dualpath.config import EngineProcessConfig
from dualpath.engine.buffers import BufferedRequest, BufferReads, KVBuffer
from dualpath.engine.courier import KVTransfer, LoadSource, RemoteBuffer, plan_prefill
from dualpath.engine.decode import PersistingRequests
from dualpath.engine.remote_buffer import TransportStaging
from dualpath.engine.role import (
    MAX_PROFILED_CONTEXT_TOKENS,
    DecodePeers,
    PeerMessage,
    RoleLoad,
    Send,
    failed_batch_messages,
    prefill_batcher,
)
from dualpath.engine.sampling import token_finish_reason
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import FileKVStore, KVStore
from dualpath.model.identity import KVIdentity, vllm_device, vllm_page_order
from dualpath.protocol import (
    DECODE,
    Assignment,
    DecodeReady,
    PeerTable,
    PrefillDone,
    PrefillHeld,
    RequestFailed,
    TokenUpdate,
)
from dualpath.scheduler.batching import PrefillBatcher, PrefillWork
from dualpath.transfer.traffic import Mover
from dualpath.transfer.transport import Transport
from dualpath.types import sampling_params_from_dict
from dualpath.vllm.connector import ConnectorHost, register_host
from dualpath.vllm.engine import (
    PrefixCacheProbe,
    VllmEngineSpec,
    build_engine,
    profile_vllm_layer_time,
    vllm_sampling_params,
    with_plan,
)
from dualpath.vllm_args import check_engine_kind

logger = logging.getLogger(__name__)


def _logprobs_of(output: Any, token_ids: list[int]) -> list | None:
    """Our (logprob, top) pairs for vLLM's per-token logprob dicts, or None."""
    if output.logprobs is None:
        return None
    result = []
    for token_id, entry in zip(token_ids, output.logprobs, strict=True):
        top = sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda item: -item[1])
        result.append((entry[token_id].logprob, tuple(top)))
    return result


@dataclass(eq=False)
class _PrefillRequest(BufferedRequest):
    """``keys``/``slots``/``reads``: its PE-side hit blocks past those vLLM held."""

    # Leading hit blocks vLLM's own prefix cache held when the request came: not read, pinned
    # there (``pinned``) until the request leaves this engine.
    num_engine_cached_blocks: int = 0
    pinned: list = field(default_factory=list)
    decode_ready: DecodeReady | None = None
    plan: KVTransfer | None = None  # set once its reads on both sides are done
    is_in_vllm: bool = False
    num_hit: int = 0  # leading blocks with KV: engine-cached, read by the PE, read by the DE


class VllmPrefillRole:
    """A PE on vLLM: each request is a one-token vLLM request whose KV the connector sends.

    Without a ``batcher`` every request whose reads are done goes to vLLM at once, and vLLM's
    scheduler packs its steps (``max_num_batched_tokens``, chunked prefill). With one (the
    compute-quota batcher, SPEC §6), ready requests queue in it and vLLM gets one batch at a
    time, when it has nothing left to run: whole requests (a request the batcher would cut
    goes whole; vLLM chunks what exceeds its step budget itself)."""

    num_kv_blocks = 0

    def __init__(
        self,
        engine: Any,
        host: ConnectorHost,
        buffer: KVBuffer,
        peers: DecodePeers,
        *,
        store: KVStore | None,
        mover: Mover,
        wake: Callable[[], None],
        eos_token_ids: tuple[int, ...],
        num_io_threads: int,
        batcher: PrefillBatcher | None = None,
    ) -> None:
        self.engine = engine
        self.batcher = batcher
        self.prefix_cache = PrefixCacheProbe(engine)
        self.host = host
        self.buffer = buffer
        self.peers = peers
        self.block_size = host.layout.block_size_tokens
        self.eos_token_ids = eos_token_ids
        # The PE reads its hit blocks into its buffer; the connector loads them from there.
        self.store_reads: BufferReads[_PrefillRequest] = BufferReads(
            "PE", store, buffer, mover, num_io_threads, wake
        )
        self.requests: dict[int, _PrefillRequest] = {}
        # Hit KV counted cached but read by neither side: vLLM still held it.
        self.num_engine_cached_bytes = 0
        self._outbox: list[object] = []  # messages to the DEs, sent at the next chance

    def add(self, assignment: Assignment) -> None:
        num_pe_blocks = assignment.num_prefill_side_blocks
        self.buffer.check_fits(num_pe_blocks)
        prompt = list(assignment.prompt_token_ids)
        # A hit already in vLLM's memory is not read (nor pulled) again: only the blocks after.
        pinned = self.prefix_cache.pin(prompt, assignment.num_hit_blocks)
        num_cached = len(pinned)
        keys = block_keys(
            prompt[: num_pe_blocks * self.block_size], self.block_size, self.host.fingerprint
        )
        request = _PrefillRequest(
            assignment,
            sampling_params_from_dict(assignment.sampling),
            keys[num_cached:],
            num_engine_cached_blocks=num_cached,
            pinned=pinned,
        )
        self.requests[request.request_id] = request
        if assignment.num_decode_side_blocks:  # the DE waits for this before reading
            self._outbox.append(PrefillHeld(request.request_id, num_cached))
        self.store_reads.add(request, len(request.keys), self._start_reads)

    def _start_reads(self, request: _PrefillRequest) -> None:
        self.store_reads.read(request, request.keys, request.slots)

    def on_peer_message(self, msg: PeerMessage) -> None:
        request = self.requests.get(msg.request_id) if isinstance(msg, DecodeReady) else None
        if request is not None:
            request.decode_ready = msg

    def connect_peers(self, table: PeerTable) -> None:
        self.peers.connect(table)

    def cancel(self, request_id: int) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.is_in_vllm:
            self.engine.abort_request([str(request_id)])
            self.host.plans.pop(request_id, None)
        elif request.plan is not None and self.batcher is not None:
            self.batcher.remove(request_id)
        self._unpin(request)
        self.store_reads.release(request)

    def _unpin(self, request: _PrefillRequest) -> None:
        self.prefix_cache.unpin(request.pinned)
        request.pinned = []

    def _submit_ready(self) -> None:
        """Plan every request whose reads are done, whose DE is ready and reachable, and hand
        vLLM the planned ones (all, or the batcher's next batch once vLLM is idle)."""
        for request in self.requests.values():
            if request.plan is not None or request.decode_ready is None:
                continue
            if not request.is_read:
                continue
            remote = self.peers.remotes.get(request.assignment.decode_engine_id)
            if remote is None:
                continue
            request.plan = self._plan(request, remote)
            if self.batcher is None:
                self._submit(request)
                continue
            num_cached = request.num_hit * self.block_size
            num_prompt = len(request.assignment.prompt_token_ids)
            self.batcher.add(PrefillWork(request.request_id, num_cached, num_prompt - num_cached))
        if self.batcher is None or self.engine.has_unfinished_requests():
            return
        for chunk in self.batcher.next_batch().chunks:
            if not chunk.is_last_chunk:  # cut by the quota: it goes whole, vLLM chunks it
                self.batcher.remove(chunk.request_id)
            self._submit(self.requests[chunk.request_id])

    def _submit(self, request: _PrefillRequest) -> None:
        assert request.plan is not None, f"request {request.request_id} is not planned"
        request.is_in_vllm = True
        self.host.plans[request.request_id] = request.plan
        params = vllm_sampling_params(
            request.params,
            max_tokens=1,
            min_tokens=1 if request.assignment.num_output_tokens < request.params.min_tokens else 0,
        )
        self.engine.add_request(
            str(request.request_id),
            {"prompt_token_ids": list(request.assignment.prompt_token_ids)},
            with_plan(params, request.request_id),
        )

    def _plan(self, request: _PrefillRequest, remote: RemoteBuffer) -> KVTransfer:
        """What the connector loads and sends for a request whose reads on both sides are done
        (``plan_prefill``: vLLM's own cache, then the PE buffer, then the DE's)."""
        assignment, ready, reads = request.assignment, request.decode_ready, request.reads
        assert ready is not None and reads is not None, "a request not ready"
        transfer, request.num_hit = plan_prefill(
            request.request_id,
            buffer=self.buffer,
            pe_slots=request.slots,
            num_prefill_side_blocks=assignment.num_prefill_side_blocks,
            num_pe_read=reads.result(),
            remote=remote,
            de_slots=ready.slots,
            num_de_read=ready.num_decode_side_blocks_read,
            num_prompt_tokens=len(assignment.prompt_token_ids),
            block_size=self.block_size,
            num_engine_cached=request.num_engine_cached_blocks,
        )
        return transfer

    def _flush_outbox(self, send: Send) -> None:
        outbox, self._outbox = self._outbox, []
        for msg in outbox:
            send(msg)

    def work(self, send: Send, between_layers: Callable[[], None]) -> bool:
        self._flush_outbox(send)
        self._submit_ready()
        if not self.engine.has_unfinished_requests():
            return False

        def between_layers_and_send() -> None:  # requests placed mid-step tell their DEs now
            between_layers()
            self._flush_outbox(send)

        self.host.between_layers = between_layers_and_send
        try:
            outputs = self.engine.step()
        finally:
            self.host.between_layers = None
        for output in outputs:
            if output.finished:
                self._finish(int(output.request_id), output, send)
        return True

    def _finish(self, request_id: int, output: Any, send: Send) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        plan = request.plan
        assert plan is not None
        if plan.transfer_error is not None:
            self._fail(request, plan.transfer_error, send)
            return
        del self.requests[request_id]
        self.host.plans.pop(request_id, None)
        # Neither side read the engine-cached blocks (the DE skipped them: PrefillHeld).
        self.num_engine_cached_bytes += (
            request.num_engine_cached_blocks * self.host.layout.full_block_bytes
        )
        self._unpin(request)
        self.store_reads.release(request)
        completion = output.outputs[0]
        (token_id,) = completion.token_ids
        logprobs = _logprobs_of(completion, [token_id])
        send(
            PrefillDone(
                request_id,
                token_id,
                None if logprobs is None else logprobs[0],
                # Prompt tokens cached: read from the store, or in vLLM's own prefix cache.
                request.num_hit * self.block_size,
                token_finish_reason(
                    request.params,
                    token_id,
                    request.assignment.num_output_tokens,
                    self.eos_token_ids,
                ),
            )
        )

    def _fail(self, request: _PrefillRequest, exc: Exception, send: Send) -> None:
        """A send to the request's DE failed: it and every request queued for that DE go back
        to the scheduler (as a native PE's failed batch)."""
        self.cancel(request.request_id)
        for message in failed_batch_messages(exc, [request.request_id], self.requests, self.cancel):
            send(message)

    def load(self) -> RoleLoad:
        num_tokens = sum(len(r.assignment.prompt_token_ids) for r in self.requests.values())
        read_tokens = self.store_reads.num_queued_blocks(waiting=True) * self.block_size
        return RoleLoad(len(self.requests), num_tokens, 0, read_tokens, 0)

    @property
    def num_read_bytes(self) -> int:
        return self.store_reads.num_read_bytes

    @property
    def store(self) -> KVStore | None:
        return self.store_reads.store

    def close(self, flush_timeout_s: float) -> int:
        self.store_reads.close()
        return 0


@dataclass(eq=False)
class _DecodeRequest(BufferedRequest):
    """``slots``: one per prompt block; ``keys``: the DE side's hit blocks, ``reads``: those
    of them past the ones the PE's engine holds."""

    # Leading blocks the PE's engine holds (PrefillHeld): not read here. None: not known yet.
    num_held_by_prefill: int | None = None
    num_skipped: int = 0  # leading DE-side blocks not read: the PE's engine holds them
    is_ready_sent: bool = False
    prefill_done: PrefillDone | None = None
    plan: KVTransfer | None = None  # set once it is in vLLM


class VllmDecodeRole:
    """A DE on vLLM: each prefilled request goes to vLLM as prompt + first token, its prompt KV
    loaded from this engine's buffer; vLLM decodes it, the connector persists its blocks."""

    def __init__(
        self,
        engine: Any,
        host: ConnectorHost,
        buffer: KVBuffer,
        *,
        wake: Callable[[], None],
        eos_token_ids: tuple[int, ...],
        num_io_threads: int,
    ) -> None:
        self.engine = engine
        self.host = host
        self.buffer = buffer
        # The DE read path: DE-side hit blocks read into this buffer, for the PE to pull.
        self.store_reads: BufferReads[_DecodeRequest] = BufferReads(
            "DE", host.store, buffer, host.mover, num_io_threads, wake
        )
        self.block_size = host.layout.block_size_tokens
        self.eos_token_ids = eos_token_ids
        self._block_pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        self.num_kv_blocks = self._block_pool.num_gpu_blocks
        self.requests: dict[int, _DecodeRequest] = {}
        self._persisting = PersistingRequests(self._pending_writes)

    def add(self, assignment: Assignment) -> None:
        prompt = list(assignment.prompt_token_ids)
        num_slots = -(-len(prompt) // self.block_size)
        self.buffer.check_fits(num_slots)
        first, end = assignment.num_prefill_side_blocks, assignment.num_hit_blocks
        keys = block_keys(prompt[: end * self.block_size], self.block_size, self.host.fingerprint)
        request = _DecodeRequest(
            assignment, sampling_params_from_dict(assignment.sampling), keys[first:end]
        )
        if not request.keys:
            request.num_held_by_prefill = 0  # nothing to read: no need to wait for the PE
        self.requests[request.request_id] = request
        self.store_reads.add(request, num_slots, self._start_reads)

    def _start_reads(self, request: _DecodeRequest) -> None:
        """Read the DE side's hit blocks the PE's engine does not hold, once the slots are
        there and the PE has said what it holds."""
        if not request.slots or request.num_held_by_prefill is None or request.reads is not None:
            return
        first = request.assignment.num_prefill_side_blocks
        request.num_skipped = min(len(request.keys), max(0, request.num_held_by_prefill - first))
        start = first + request.num_skipped
        self.store_reads.read(
            request,
            request.keys[request.num_skipped :],
            request.slots[start : first + len(request.keys)],
        )

    def on_peer_message(self, msg: PeerMessage) -> None:
        request = self.requests.get(msg.request_id)
        if request is None or isinstance(msg, DecodeReady):
            return
        if isinstance(msg, PrefillHeld):
            request.num_held_by_prefill = msg.num_blocks
            self._start_reads(request)
        else:
            request.prefill_done = msg

    def connect_peers(self, table: PeerTable) -> None:
        """The DE is only ever the remote side."""

    def cancel(self, request_id: int) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.plan is not None:
            self.engine.abort_request([str(request_id)])
            self.host.plans.pop(request_id, None)
        self.store_reads.release(request)  # nothing left to free once its load is done

    def _adopt_prefilled(self) -> None:
        """Hand vLLM every request whose prompt KV is in the buffer."""
        for request in self.requests.values():
            done = request.prefill_done
            if done is None or request.plan is not None:
                continue
            assignment = request.assignment
            prompt = list(assignment.prompt_token_ids)
            request.plan = KVTransfer(
                request.request_id,
                load=LoadSource(self.buffer, request.slots, len(prompt)),
                persist_from_block=done.num_cached_tokens // self.block_size,
                on_loaded=partial(self.store_reads.release, request),
            )
            self.host.plans[request.request_id] = request.plan
            num_before = assignment.num_output_tokens + 1  # output so far, the first token too
            # A request that ends at its first token still has its prompt KV taken in and
            # persisted: vLLM makes one token more, which is not sent.
            params = vllm_sampling_params(
                request.params,
                max_tokens=max(1, request.params.max_tokens - num_before),
                min_tokens=max(0, request.params.min_tokens - num_before),
            )
            self.engine.add_request(
                str(request.request_id),
                {"prompt_token_ids": [*prompt, done.first_token_id]},
                with_plan(params, request.request_id),
            )

    def work(self, send: Send, between_layers: Callable[[], None]) -> bool:
        for request in self.requests.values():
            if request.is_ready_sent or not request.is_read:
                continue
            request.is_ready_sent = True
            num_covered = request.num_skipped + request.reads.result()
            send(DecodeReady(request.request_id, tuple(request.slots), num_covered))
        self._adopt_prefilled()
        if not self.engine.has_unfinished_requests():
            return False
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug: every request of the step fails, the engine goes on
            logger.exception("decode step failed")
            for request_id in list(self.requests):
                self.cancel(request_id)
                send(RequestFailed(request_id, f"decode failed: {exc!r}"))
            return True
        for output in outputs:
            update = self._update(int(output.request_id), output)
            if update is not None:
                send(update)
        persisted = self._persisting.poll()
        if persisted is not None:
            send(persisted)
        return True

    def _update(self, request_id: int, output: Any) -> TokenUpdate | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        done = request.prefill_done
        assert done is not None and request.plan is not None
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        finish_reason = completion.finish_reason if output.finished else None
        if done.finish_reason is not None:  # it ended at the PE's token: nothing more is sent
            token_ids = []
            finish_reason = done.finish_reason if output.finished else None
        persisting: tuple = ()
        if output.finished:
            del self.requests[request_id]
            plan = self.host.plans.pop(request_id)
            persisting = self._persisting.add(request_id, tuple(plan.persisted_keys))
        return TokenUpdate(
            request_id,
            tuple(token_ids),
            finish_reason,
            done.num_cached_tokens,
            None if not token_ids else _logprobs_of(completion, token_ids),
            persisting,
        )

    def _pending_writes(self, keys: tuple) -> tuple:
        store_io = self.host.store_io
        return () if store_io is None or not keys else store_io.pending(keys)

    def load(self) -> RoleLoad:
        requests = self.requests.values()
        num_tokens = sum(len(r.assignment.prompt_token_ids) + r.params.max_tokens for r in requests)
        store_io = self.host.store_io
        num_writes = 0 if store_io is None else store_io.num_unfinished_writes
        return RoleLoad(
            len(self.requests),
            num_tokens,
            self._block_pool.get_num_free_blocks(),
            self.store_reads.num_queued_blocks(waiting=False) * self.block_size,
            num_writes * self.block_size,
        )

    @property
    def num_read_bytes(self) -> int:
        return self.store_reads.num_read_bytes

    num_engine_cached_bytes = 0  # the PE's vLLM holds the hits it did not read

    @property
    def store(self) -> KVStore | None:
        return self.host.store

    def close(self, flush_timeout_s: float) -> int:
        self.store_reads.close()
        store_io = self.host.store_io
        return 0 if store_io is None else store_io.flush(flush_timeout_s)


def make_vllm_role(
    config: EngineProcessConfig,
    model_config: Any,
    identity: KVIdentity,
    buffer: KVBuffer,
    transport: Transport,
    *,
    mover: Mover,
    wake: Callable[[], None],
) -> VllmPrefillRole | VllmDecodeRole:
    """The engine ``config.role`` names, on a vLLM engine built in this process with our
    connector; the process is pinned to one core per thread (vLLM's CPU build ignores its own
    binding variable in-process), engine ``e`` of a host on cores ``e * threads ...``."""
    engine_config = config.engine
    check_engine_kind(config.cluster, engine_config)
    store = (
        FileKVStore.from_config(config.store, identity.layout, identity.fingerprint)
        if config.store.is_enabled
        else None
    )
    host = ConnectorHost(
        identity.layout,
        identity.fingerprint,
        store=store if config.role == DECODE else None,  # a PE persists nothing (SPEC §2)
        mover=mover,
        is_layerwise=config.cluster.settings.is_layerwise,
        num_io_threads=engine_config.num_io_threads,
        max_pending_write_bytes=engine_config.max_pending_write_bytes,
        page_order=vllm_page_order(model_config, vllm_device()),
    )
    key = f"engine-{config.engine_id}"
    register_host(key, host)
    num_threads = engine_config.num_threads or 1
    num_cores = os.cpu_count() or 1
    first_core = (config.engine_id * num_threads) % num_cores
    cores = tuple(sorted({(first_core + i) % num_cores for i in range(num_threads)}))
    engine = build_engine(
        VllmEngineSpec(
            Path(config.model_dir),
            engine_key=key,
            block_size_tokens=engine_config.block_size_tokens,
            dtype=engine_config.dtype,
            max_model_len=engine_config.max_model_len,
            kv_cache_bytes=engine_config.kv_cache_bytes,
            # The engine's KV memory as configured, not rounded to vLLM's whole GiB.
            num_kv_blocks=engine_config.num_device_blocks
            or engine_config.kv_cache_bytes // identity.layout.full_block_bytes,
            cores=cores,
            args=engine_config.vllm_args,
        )
    )
    eos_token_ids = tuple(model_config.eos_token_ids)
    if config.role == DECODE:
        return VllmDecodeRole(
            engine,
            host,
            buffer,
            wake=wake,
            eos_token_ids=eos_token_ids,
            num_io_threads=engine_config.num_io_threads,
        )
    batcher = None
    if engine_config.vllm_prefill_batching == "quota":
        max_model_len = engine_config.max_model_len or model_config.max_position_embeddings
        predictor = profile_vllm_layer_time(
            engine,
            # A profiled prompt reaches the whole context, and vLLM adds one output token.
            max_context_tokens=min(max_model_len - 1, MAX_PROFILED_CONTEXT_TOKENS),
            num_layers=identity.layout.num_layers,
        )
        batcher = prefill_batcher(config, predictor)
        logger.info(
            "prefill batching: quota %.4f s a layer; vLLM's profile predicts %.4f s a layer "
            "for 1,024 new tokens, %.4f s for 1,024 after 1,024 cached",
            batcher.quota_s,
            predictor.predict_s([(0, 1024)]),
            predictor.predict_s([(1024, 1024)]),
        )
    max_blocks = -(-model_config.max_position_embeddings // engine_config.block_size_tokens)
    staging = TransportStaging(
        transport, identity.layout, max_read_blocks=max_blocks, ring_blocks=max_blocks
    )
    return VllmPrefillRole(
        engine,
        host,
        buffer,
        DecodePeers(transport, staging, peer_timeout_s=config.transfer_timeout_s),
        store=store,
        mover=mover,
        wake=wake,
        eos_token_ids=eos_token_ids,
        num_io_threads=engine_config.num_io_threads,
        batcher=batcher,
    )

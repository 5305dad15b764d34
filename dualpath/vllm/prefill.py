"""A prefill engine whose model runs on vLLM (``--engine vllm``): each placed request's
PE-side hit blocks are read into the PE buffer, then, once its DE is ready, it goes to vLLM for
one token, the connector loading its hits layer by layer (the PE side's from the buffer, the DE
side's pulled from the DE's buffer) and sending the DE every layer's KV it lacks
(``roles.py`` says how the two sides meet)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dualpath.engine.buffers import BufferedRequest, BufferReads, KVBuffer
from dualpath.engine.courier import KVTransfer, RemoteBuffer, plan_prefill
from dualpath.engine.role import DecodePeers, PeerMessage, RoleLoad, Send, failed_batch_messages
from dualpath.engine.sampling import token_finish_reason
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import KVStore
from dualpath.protocol import Assignment, DecodeReady, PeerTable, PrefillDone, PrefillHeld
from dualpath.scheduler.batching import PrefillBatcher, PrefillWork
from dualpath.transfer.traffic import Mover
from dualpath.types import sampling_params_from_dict
from dualpath.vllm.engine import (
    PrefixCacheProbe,
    logprobs_of,
    step_between_layers,
    vllm_prompt,
    vllm_sampling_params,
    with_plan,
)

if TYPE_CHECKING:  # the role runs without vLLM's imports where its engine is given (tests)
    from dualpath.vllm.connector import ConnectorHost

logger = logging.getLogger(__name__)


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
        # vLLM's own prefix cache, looked up and pinned on this thread; an engine that steps
        # itself on another thread (a vLLM server's) brings its own probe.
        self.prefix_cache = getattr(engine, "prefix_cache", None) or PrefixCacheProbe(engine)
        # It tells each request's DE how many leading hit blocks vLLM holds (PrefillHeld) only
        # where it looks them up; its EngineInfo says so, and the scheduler's Assignment tells
        # both engines whether the DE waits for it.
        self.reports_prefill_held = self.prefix_cache.enabled
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
        # The DE reads every block of its side unless it hears what vLLM holds (PrefillHeld).
        num_held_max = (
            assignment.num_hit_blocks if assignment.is_prefill_held_sent else num_pe_blocks
        )
        # Both vLLM's cache and the store are looked up in the request's tenant namespace.
        salt = assignment.cache_salt
        pinned = self.prefix_cache.pin(prompt, num_held_max, cache_salt=salt)
        num_cached = len(pinned)
        keys = block_keys(
            prompt[: num_pe_blocks * self.block_size],
            self.block_size,
            self.host.fingerprint,
            cache_salt=salt,
        )
        request = _PrefillRequest(
            assignment,
            sampling_params_from_dict(assignment.sampling),
            keys[num_cached:],
            num_engine_cached_blocks=num_cached,
            pinned=pinned,
        )
        self.requests[request.request_id] = request
        if assignment.is_prefill_held_sent:  # the DE waits for this before reading
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
        assignment = request.assignment
        self.engine.add_request(
            str(request.request_id),
            vllm_prompt(assignment.prompt_token_ids, cache_salt=assignment.cache_salt),
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

        outputs = step_between_layers(self.engine, self.host, between_layers_and_send)
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
        logprobs = logprobs_of(completion, [token_id])
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
    def transport_bytes(self) -> Mapping[int, tuple[int, int]]:
        return self.peers.moved_bytes()

    @property
    def store(self) -> KVStore | None:
        return self.store_reads.store

    def close(self, flush_timeout_s: float) -> int:
        self.store_reads.close()
        return 0

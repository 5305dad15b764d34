"""A decode engine whose model runs on vLLM (``--engine vllm``): each placed request gets
buffer slots for its whole prompt and its DE-side hit blocks read into them; once prefilled it
goes to vLLM as prompt + first token, the connector loading the prompt's KV from the buffer and
persisting every block the store lacks as it fills (``roles.py`` says how the sides meet).

A request placed on the DE alone (``Assignment.is_local_prefill``: a short append) is prefilled
here: the hit blocks vLLM's prefix cache does not hold are read into the buffer, then it goes
to vLLM whole, the connector loading them, vLLM computing the rest and decoding on; its first
token goes out as the PE's would (``PrefillDone``, to the scheduler)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from dualpath.engine.buffers import BufferedRequest, BufferReads, KVBuffer
from dualpath.engine.courier import KVTransfer, LoadSource
from dualpath.engine.decode import PersistingRequests
from dualpath.engine.role import PeerMessage, RoleLoad, Send
from dualpath.engine.session_blocks import SessionBlocks
from dualpath.kv.hashing import block_keys
from dualpath.kv.store import KVStore
from dualpath.protocol import (
    Assignment,
    DecodeReady,
    PeerTable,
    PrefillDone,
    PrefillHeld,
    RequestFailed,
    TokenUpdate,
)
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
class _DecodeRequest(BufferedRequest):
    """``slots``: one per prompt block; ``keys``: the DE side's hit blocks, ``reads``: those
    of them past the ones the PE's engine holds."""

    # Leading blocks the PE's engine holds (PrefillHeld): not read here. None: not known yet.
    num_held_by_prefill: int | None = None
    num_skipped: int = 0  # leading DE-side blocks not read: the PE's engine holds them
    is_ready_sent: bool = False
    prefill_done: PrefillDone | None = None
    plan: KVTransfer | None = None  # set once it is in vLLM
    # Prefilled here (``Assignment.is_local_prefill``): ``num_skipped`` leading hit blocks
    # vLLM's prefix cache held, pinned there (``pinned``) until its first token.
    pinned: list = field(default_factory=list)
    num_hit: int = 0  # leading blocks with KV: vLLM-held and read (set once in vLLM)


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
        self._block_pool = getattr(engine, "block_pool", None) or (
            engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        )
        # Held while the connector frees a loaded request's slots, for an engine that steps
        # itself on another thread (a vLLM server's); none otherwise.
        self.lock: Any = getattr(engine, "lock", None) or contextlib.nullcontext()
        self.num_kv_blocks = self._block_pool.num_gpu_blocks
        self.requests: dict[int, _DecodeRequest] = {}
        self._persisting = PersistingRequests(self._pending_writes)
        self._sessions = SessionBlocks(host.store)
        # Requests placed here alone are prefilled here (their hits looked up in vLLM's own
        # prefix cache first: ``prefix_cache``); a vLLM server's come over HTTP through its
        # PE: never.
        self.prefills_locally = getattr(engine, "prefills_locally", True)
        # Hit KV counted cached but not read: vLLM held it (requests prefilled here).
        self.num_engine_cached_bytes = 0

    @functools.cached_property
    def prefix_cache(self) -> Any:
        """vLLM's own prefix cache, looked up and pinned on this thread (an engine that steps
        itself on another thread brings its own probe); built for the first local prefill."""
        return getattr(self.engine, "prefix_cache", None) or PrefixCacheProbe(self.engine)

    def _unpin(self, request: _DecodeRequest) -> None:
        if request.pinned:
            self.prefix_cache.unpin(request.pinned)
            request.pinned = []

    def add(self, assignment: Assignment) -> None:
        if assignment.is_local_prefill:
            self._add_local(assignment)
            return
        prompt = list(assignment.prompt_token_ids)
        num_slots = -(-len(prompt) // self.block_size)
        self.buffer.check_fits(num_slots)
        first, end = assignment.num_prefill_side_blocks, assignment.num_hit_blocks
        keys = block_keys(
            prompt[: end * self.block_size],
            self.block_size,
            self.host.fingerprint,
            cache_salt=assignment.cache_salt,
        )
        request = _DecodeRequest(
            assignment, sampling_params_from_dict(assignment.sampling), keys[first:end]
        )
        if not assignment.is_prefill_held_sent:  # the PE tells nothing: read at once
            request.num_held_by_prefill = 0
        self._sessions.on_assigned(assignment, keys)
        self.requests[request.request_id] = request
        self.store_reads.add(request, num_slots, self._start_reads)

    def _add_local(self, assignment: Assignment) -> None:
        """A request this DE prefills: slots for the hit blocks vLLM's cache does not hold."""
        if not self.prefills_locally:  # a scheduler bug: this engine never said it does
            raise ValueError("this decode engine does not prefill requests placed on it alone")
        prompt = list(assignment.prompt_token_ids)
        num_hit = assignment.num_hit_blocks
        self.buffer.check_fits(num_hit)
        salt = assignment.cache_salt
        keys = block_keys(
            prompt[: num_hit * self.block_size],
            self.block_size,
            self.host.fingerprint,
            cache_salt=salt,
        )
        pinned = self.prefix_cache.pin(prompt, num_hit, cache_salt=salt)
        request = _DecodeRequest(
            assignment,
            sampling_params_from_dict(assignment.sampling),
            keys[len(pinned) :],
            num_skipped=len(pinned),
            pinned=pinned,
        )
        self._sessions.on_assigned(assignment, keys)
        self.requests[request.request_id] = request
        self.store_reads.add(
            request, len(request.keys), lambda r: self.store_reads.read(r, r.keys, r.slots)
        )

    def _start_reads(self, request: _DecodeRequest) -> None:
        """Read the DE side's hit blocks the PE's engine does not hold, once the slots are
        there and, where the Assignment says it will (``is_prefill_held_sent``), the PE has
        said what it holds."""
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
        self._sessions.forget(request_id)
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.plan is not None:
            self.engine.abort_request([str(request_id)])
            self.host.plans.pop(request_id, None)
        self._unpin(request)
        self.store_reads.release(request)  # nothing left to free once its load is done

    def _adopt_local(self) -> None:
        """Hand vLLM every request prefilled here whose reads are done, whole: the connector
        loads the hit blocks read (a short read ends the hit there), vLLM computes the rest."""
        for request in self.requests.values():
            if request.plan is not None or not request.assignment.is_local_prefill:
                continue
            if not request.is_read:
                continue
            assert request.reads is not None
            num_read = request.reads.result()
            num_hit = request.num_skipped + num_read
            load = None
            if num_read:
                load = LoadSource(
                    self.buffer,
                    request.slots[:num_read],
                    num_hit * self.block_size,
                    first_block=request.num_skipped,
                )
            request.plan = KVTransfer(
                request.request_id,
                load=load,
                persist_from_block=num_hit,
                on_loaded=partial(self._release_loaded, request),
            )
            request.num_hit = num_hit
            if load is None:  # nothing to load: slots (a failed read's) go now
                self.store_reads.release(request)
            self._add_to_vllm(request, request.assignment.num_output_tokens, [])

    def _add_to_vllm(self, request: _DecodeRequest, num_before: int, extra: list[int]) -> None:
        """vLLM takes the request: its prompt and ``extra`` tokens, ``num_before`` output tokens
        counted toward its limits already."""
        assert request.plan is not None
        assignment = request.assignment
        self.host.plans[request.request_id] = request.plan
        # A request that ends at its first token still has its prompt KV taken in and
        # persisted: vLLM makes one token more, which is not sent.
        params = vllm_sampling_params(
            request.params,
            max_tokens=max(1, request.params.max_tokens - num_before),
            min_tokens=max(0, request.params.min_tokens - num_before),
        )
        # Salted, vLLM's prefix cache keeps the request's blocks in its tenant's namespace,
        # and the connector persists them under its salt (``connector.py``).
        self.engine.add_request(
            str(request.request_id),
            vllm_prompt([*assignment.prompt_token_ids, *extra], cache_salt=assignment.cache_salt),
            with_plan(params, request.request_id),
        )

    def _adopt_prefilled(self) -> None:
        """Hand vLLM every request whose prompt KV is in the buffer."""
        for request in self.requests.values():
            done = request.prefill_done
            if done is None or request.plan is not None:
                continue
            assignment = request.assignment
            request.plan = KVTransfer(
                request.request_id,
                load=LoadSource(self.buffer, request.slots, len(assignment.prompt_token_ids)),
                persist_from_block=done.num_cached_tokens // self.block_size,
                on_loaded=partial(self._release_loaded, request),
            )
            # Output so far, the first token too.
            self._add_to_vllm(request, assignment.num_output_tokens + 1, [done.first_token_id])

    def _release_loaded(self, request: _DecodeRequest) -> None:
        with self.lock:
            self.store_reads.release(request)

    def _send_ready(self, send: Send) -> None:
        """DecodeReady for every request whose slots and reads are done: its PE may prefill."""
        for request in self.requests.values():
            if request.is_ready_sent or not request.is_read:
                continue
            if request.assignment.is_local_prefill:  # no PE waits for it
                continue
            request.is_ready_sent = True
            num_covered = request.num_skipped + request.reads.result()
            send(DecodeReady(request.request_id, tuple(request.slots), num_covered))

    def work(self, send: Send, between_layers: Callable[[], None]) -> bool:
        self._send_ready(send)
        self._adopt_prefilled()
        self._adopt_local()
        if not self.engine.has_unfinished_requests():
            return False

        # Mid-step, requests placed meanwhile take their slots, start their reads and tell
        # their PEs they are ready, rather than waiting for the step's end: the PE waits for
        # that to prefill, and the scheduler for this DE's report to place more.
        def between_layers_and_send() -> None:
            between_layers()
            self._send_ready(send)

        try:
            outputs = step_between_layers(self.engine, self.host, between_layers_and_send)
        except Exception as exc:  # a bug: every request of the step fails, the engine goes on
            logger.exception("decode step failed")
            for request_id in list(self.requests):
                self.cancel(request_id)
                send(RequestFailed(request_id, f"decode failed: {exc!r}"))
            return True
        for output in outputs:
            for message in self._updates(int(output.request_id), output):
                send(message)
        persisted = self._persisting.poll()
        if persisted is not None:
            send(persisted)
        return True

    def _updates(self, request_id: int, output: Any) -> list:
        """The messages of one request's step: its tokens (TokenUpdate), the first of a request
        prefilled here as a PE's (PrefillDone)."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = None if not token_ids else logprobs_of(completion, token_ids)
        messages: list = []
        if request.prefill_done is None:  # prefilled here: its first token
            self._unpin(request)  # vLLM's request holds those blocks now
            request.prefill_done = PrefillDone(
                request_id,
                token_ids[0],
                None if logprobs is None else logprobs[0],
                request.num_hit * self.block_size,
            )
            messages.append(request.prefill_done)
            self.num_engine_cached_bytes += request.num_skipped * self.host.layout.full_block_bytes
            token_ids = token_ids[1:]
            logprobs = None if logprobs is None else logprobs[1:]
            if not token_ids and not output.finished:
                return messages
        messages.append(self._update(request, output, token_ids, logprobs))
        return messages

    def _update(
        self, request: _DecodeRequest, output: Any, token_ids: list[int], logprobs: list | None
    ) -> TokenUpdate:
        request_id = request.request_id
        done = request.prefill_done
        assert done is not None and request.plan is not None
        completion = output.outputs[0]
        finish_reason = completion.finish_reason if output.finished else None
        if done.finish_reason is not None:  # it ended at the PE's token: nothing more is sent
            token_ids = []
            finish_reason = done.finish_reason if output.finished else None
        persisting: tuple = ()
        if output.finished:
            del self.requests[request_id]
            plan = self.host.plans.pop(request_id)
            persisting = self._persisting.add(request_id, tuple(plan.persisted_keys))
            self._sessions.on_finished(request_id, plan.persisted_keys)
            self._release_loaded(request)  # slots a load vLLM's cache made moot still held
        return TokenUpdate(
            request_id,
            tuple(token_ids),
            finish_reason,
            done.num_cached_tokens,
            None if not token_ids else logprobs,
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

    transport_bytes: Mapping[int, tuple[int, int]] = MappingProxyType({})  # starts none

    @property
    def store(self) -> KVStore | None:
        return self.host.store

    def close(self, flush_timeout_s: float) -> int:
        self.store_reads.close()
        store_io = self.host.store_io
        return 0 if store_io is None else store_io.flush(flush_timeout_s)

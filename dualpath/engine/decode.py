"""The decode engine (DE): receives a prompt's KV in its buffer, then decodes (SPEC §2).

Per request::

    Assignment   -> buffer slots for every prompt block; DE-side hit blocks read from storage
                    through this node's SNIC into their slots; DecodeReady tells the PE where
    (the PE writes the PE-side hit blocks and the miss tokens' KV into the slots, layer by layer)
    PrefillDone  -> the buffer holds the whole prompt KV: copy it into the paged KV cache,
                    free the slots, persist the prompt's new full blocks, decode from the
                    PE's first token, persist each block as it fills
    finished     -> the last TokenUpdate names the blocks still being written; KVPersisted
                    follows once they are (the scheduler waits for them, see coordinator)

Memory is gated twice and never deadlocks: slots wait for a free buffer (FIFO), and a prompt
waits for free device blocks before it is adopted; both are released as requests finish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from dualpath.engine.buffers import BufferedRequest, BufferReads, KVBuffer
from dualpath.engine.courier import KVCourier, KVTransfer, LoadSource, StepTransfer
from dualpath.engine.llm_engine import LLMEngine
from dualpath.engine.session_blocks import SessionBlocks
from dualpath.kv.hashing import BlockKey, block_keys
from dualpath.protocol import (
    Assignment,
    DecodeReady,
    KVPersisted,
    PrefillDone,
    TokenUpdate,
)
from dualpath.transfer.traffic import Mover, direct_move
from dualpath.types import TokenLogprob, sampling_params_from_dict

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class DecodeRequest(BufferedRequest):
    """``slots``: one per prompt block; ``keys``/``reads``: the DE side's hit blocks
    (``keys`` holds every hit block's key, the DE side's from ``num_prefill_side_blocks``)."""

    is_ready_sent: bool = False
    prefill_done: PrefillDone | None = None


class PersistingRequests:
    """Finished requests whose blocks a store writer still holds, until every one is written
    (or failed to be): what ``KVPersisted`` reports. ``pending(keys)`` says which of ``keys``
    are still queued or being written (``KVStoreIO.pending``)."""

    def __init__(self, pending: Callable[[tuple[BlockKey, ...]], tuple[BlockKey, ...]]) -> None:
        self._pending = pending
        self._keys: dict[int, tuple[BlockKey, ...]] = {}  # request id -> keys it waits for

    def add(self, request_id: int, keys: tuple[BlockKey, ...]) -> tuple[BlockKey, ...]:
        """Track a finished request's ``keys``; those still being written (its
        ``TokenUpdate.persisting_keys``)."""
        persisting = self._pending(keys) if keys else ()
        if persisting:
            self._keys[request_id] = persisting
        return persisting

    def poll(self) -> KVPersisted | None:
        """KVPersisted for the requests whose blocks have all been written since the last
        call, or None."""
        done = [request_id for request_id, keys in self._keys.items() if not self._pending(keys)]
        for request_id in done:
            del self._keys[request_id]
        return KVPersisted(tuple(done)) if done else None


class DecodeEngine:
    def __init__(
        self,
        engine: LLMEngine,
        buffer: KVBuffer,
        *,
        mover: Mover = direct_move,
        num_io_threads: int = 4,
        on_read_done: Callable[[], None] | None = None,
    ) -> None:
        """``on_read_done`` is called from a reading thread when a request's DE-side reads
        end (the engine loop then stops waiting for messages)."""
        self.engine = engine
        self.buffer = buffer
        self.block_size = engine.block_size
        self.store = None if engine.store_io is None else engine.store_io.store
        self.mover = mover
        self.store_reads: BufferReads[DecodeRequest] = BufferReads(
            "DE", self.store, buffer, mover, num_io_threads, on_read_done
        )
        # Takes a prefilled prompt's KV from the buffer into the paged cache.
        self.courier = KVCourier(
            mover, num_layers=buffer.layout.num_layers, block_size=self.block_size
        )
        self.requests: dict[int, DecodeRequest] = {}
        self._num_cached_tokens: dict[int, int] = {}
        self._persisting = PersistingRequests(self._pending_writes)
        self._sessions = SessionBlocks(self.store)

    def add(self, assignment: Assignment) -> None:
        params = sampling_params_from_dict(assignment.sampling)
        prompt = list(assignment.prompt_token_ids)
        self.engine.validate_request(prompt, params)
        self.buffer.check_fits(-(-len(prompt) // self.block_size))
        hit_tokens = assignment.num_hit_blocks * self.block_size
        keys = block_keys(
            prompt[:hit_tokens],
            self.block_size,
            self.engine.fingerprint,
            cache_salt=assignment.cache_salt,
        )
        request = DecodeRequest(assignment, params, keys)
        self._sessions.on_assigned(assignment, keys)
        self.requests[request.request_id] = request
        num_slots = -(-request.num_prompt_tokens // self.block_size)
        self.store_reads.add(request, num_slots, self._start_reads)

    def _start_reads(self, request: DecodeRequest) -> None:
        first, end = request.assignment.num_prefill_side_blocks, request.assignment.num_hit_blocks
        self.store_reads.read(request, request.keys[first:end], request.slots[first:end])

    def poll_ready(self) -> list[DecodeReady]:
        """DecodeReady for every request whose slots and DE-side reads are done."""
        ready = []
        for request in self.requests.values():
            if request.is_ready_sent or not request.is_read:
                continue
            request.is_ready_sent = True
            ready.append(
                DecodeReady(request.request_id, tuple(request.slots), request.reads.result())
            )
        return ready

    def on_prefill_done(self, msg: PrefillDone) -> None:
        request = self.requests.get(msg.request_id)
        if request is not None:
            request.prefill_done = msg

    def _adopt_prefilled(self) -> None:
        """Move every prefilled prompt whose device blocks are free into the paged cache."""
        for request in list(self.requests.values()):
            done = request.prefill_done
            if done is None:
                continue
            logprob = None
            if done.first_token_logprob is not None:
                value, top = done.first_token_logprob
                logprob = TokenLogprob(done.first_token_id, value, tuple(map(tuple, top)))
            is_adopted = self.engine.add_prefilled(
                request.request_id,
                list(request.assignment.prompt_token_ids),
                request.params,
                first_token_id=done.first_token_id,
                first_logprob=logprob,
                num_cached_tokens=done.num_cached_tokens,
                fill_blocks=lambda table, request=request: self._fill(request, table),
                num_output_tokens=request.assignment.num_output_tokens,
                cache_salt=request.assignment.cache_salt,
            )
            if not is_adopted:
                return  # FIFO: later prompts wait behind this one
            self._num_cached_tokens[request.request_id] = done.num_cached_tokens
            del self.requests[request.request_id]
            self.store_reads.release(request)

    def _fill(self, request: DecodeRequest, block_table: list[int]) -> None:
        load = LoadSource(self.buffer, request.slots, request.num_prompt_tokens)
        transfer = KVTransfer(request.request_id, load=load)
        step = StepTransfer(transfer, block_table, load_num=request.num_prompt_tokens)
        self.courier.run_loads([step], self.engine.cache)

    def step(self) -> list[TokenUpdate]:
        """Adopt prefilled prompts, run one decode step, and return the token updates."""
        self._adopt_prefilled()
        finished = {out.request_id: out for out in self.engine.step()}
        logprobs = self.engine.pop_new_logprobs()
        updates = []
        for request_id, token_ids in self.engine.pop_new_tokens().items():
            out = finished.pop(request_id, None)
            updates.append(self._update(request_id, token_ids, out, logprobs.get(request_id)))
        for request_id, out in finished.items():  # finished without a new token this step
            updates.append(self._update(request_id, [], out, None))
        return updates

    def _update(
        self, request_id: int, token_ids: list[int], out, logprobs: list[TokenLogprob] | None
    ) -> TokenUpdate:
        num_cached = self._num_cached_tokens.get(request_id, 0)
        persisting: tuple[BlockKey, ...] = ()
        if out is not None:
            self._num_cached_tokens.pop(request_id, None)
            persisting = self._persisting.add(request_id, out.written_block_keys)
            self._sessions.on_finished(request_id, out.written_block_keys)
        return TokenUpdate(
            request_id,
            tuple(token_ids),
            None if out is None else out.finish_reason,
            num_cached,
            None if logprobs is None else tuple((lp.logprob, lp.top) for lp in logprobs),
            persisting,
        )

    def _pending_writes(self, keys: tuple[BlockKey, ...]) -> tuple[BlockKey, ...]:
        store_io = self.engine.store_io
        return () if store_io is None or not keys else store_io.pending(keys)

    def poll_persisted(self) -> KVPersisted | None:
        """KVPersisted for the finished requests whose blocks have all been written since the
        last call (or failed to be), or None."""
        return self._persisting.poll()

    def cancel(self, request_id: int) -> None:
        self._sessions.forget(request_id)
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.store_reads.release(request)
        if self.engine.abort_request(request_id):
            self._num_cached_tokens.pop(request_id, None)

    @property
    def num_queued_read_tokens(self) -> int:
        """Tokens queued for storage reads on this engine (its share of its node's read_q):
        reads submitted and not done. Unlike the PE's, requests waiting for buffer slots are
        not counted: the DE buffer holds every request's whole prompt whichever side reads
        it, so waiting for it delays both read paths alike and says nothing about this
        node's SNIC (counting it pushed reads to the PE's SNIC during the first turns)."""
        return self.store_reads.num_queued_blocks(waiting=False) * self.block_size

    @property
    def num_queued_write_tokens(self) -> int:
        """Tokens of Full Blocks this engine persists (SPEC §2) that are not written yet: its
        share of its node's write_q, which the read-side choice adds to read_q (both load the
        node's SNIC; ``dualpath.scheduler.cluster_view``)."""
        store_io = self.engine.store_io
        return 0 if store_io is None else store_io.num_unfinished_writes * self.block_size

    @property
    def num_tokens(self) -> int:
        """tok_e: prompt + max output tokens of every assigned, unfinished request."""
        pending = sum(r.num_prompt_tokens + r.params.max_tokens for r in self.requests.values())
        running = sum(s.num_prompt_tokens + s.params.max_tokens for s in self.engine.running)
        waiting = sum(s.num_prompt_tokens + s.params.max_tokens for s in self.engine.waiting)
        return pending + running + waiting

    @property
    def request_ids(self) -> list[int]:
        """Every request this engine holds: waiting for its prompt KV, or in the paged cache."""
        in_cache = [s.request_id for s in (*self.engine.running, *self.engine.waiting)]
        return [*self.requests, *in_cache]

    @property
    def num_seqs(self) -> int:
        return len(self.requests) + len(self.engine.running) + len(self.engine.waiting)

    def close(self) -> None:
        self.store_reads.close()
        self.courier.close()

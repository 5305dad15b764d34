"""A request's life in the scheduler: submitted, placed, relayed between its engines, streamed,
finished, failed or placed again (SPEC §2, §6, §8). Every event for the caller is a
``RequestEvent`` under the caller's id (``drain_events``).

**Re-placement** (SPEC §8) of a request whose engine died: ``replacement.py`` says how.

**Persist waits.** A request whose hit prefix stops at a block a DE is still writing (an agent's
next turn, sent the moment the last one finished) waits for that write rather than being placed
with a short hit (``dualpath.cluster.persisting``).

**Sessions.** A request of an agent session prefers the DE of the session's last turn, and its
DE keeps the session's blocks in its store for the retention time (``dualpath.cluster.sessions``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
from collections.abc import Callable, Sequence

from dualpath.cluster.first_token import FirstTokenStages
from dualpath.cluster.hits import PromptHits
from dualpath.cluster.membership import Membership
from dualpath.cluster.pairing import Pairing
from dualpath.cluster.persisting import PersistingBlocks
from dualpath.cluster.replacement import DelayedPlacements, retry_after_failure
from dualpath.cluster.request_state import (
    Delays,
    RequestState,
    may_place_again,
    needs_engine,
    num_requests_by_engine,
)
from dualpath.cluster.sessions import Sessions
from dualpath.control.codec import check_encodable, encode
from dualpath.errors import PeerUnavailable
from dualpath.protocol import (
    DECODE,
    Assignment,
    CancelRequest,
    DecodeReady,
    Forward,
    KVPersisted,
    PrefillDone,
    RequestEvent,
    RequestFailed,
    TokenUpdate,
    pack_token_ids,
)
from dualpath.queues import drain
from dualpath.scheduler import LoadPlan, SchedulerRequest
from dualpath.types import NO_SCOPE, RequestScope, SamplingParams, sampling_params_to_dict

logger = logging.getLogger(__name__)


class RequestLifecycle:
    def __init__(
        self,
        membership: Membership,
        hits: PromptHits,
        persisting: PersistingBlocks[RequestState],
        *,
        place: Callable[[SchedulerRequest], None],
        suspect: Callable[[int], None],
        retry_after_s: float,
        sessions: Sessions | None = None,
        pairing: Pairing | None = None,
    ) -> None:
        """``sessions``: the agent sessions' DEs (None: sessions off)."""
        self.membership = membership
        self.hits = hits
        self.persisting = persisting
        self._place = place  # into the policy's FIFO
        self._suspect = suspect  # an engine a transfer failed with: placed on no more for now
        self.retry_after_s = retry_after_s
        # Who of the pair does what (``pairing.py``); by default every request goes to both.
        self.pairing = pairing or Pairing(membership.engines, block_size=hits.block_size)
        self.sessions = Sessions(0.0) if sessions is None else sessions
        self.clock = membership.clock
        self._requests: dict[int, RequestState] = {}
        # Caller's id -> current placement's id, for re-placed requests only.
        self._client_id_to_request_id: dict[int, int] = {}
        self._delayed = DelayedPlacements()
        self._submissions: queue.SimpleQueue[RequestState] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[RequestEvent] = queue.SimpleQueue()
        self._request_ids = itertools.count()
        self.num_assigned = 0
        self.num_replaced = 0  # placements abandoned with a lost engine and made again
        self.num_failed_unavailable = 0  # failed for lack of an engine of a role
        # From an engine's loss to the first token of the request's next placement.
        self.replacement_delays = Delays()
        # Each stage of first placements' path to their first token.
        self.first_token = FirstTokenStages()

    # --- the serving side (any thread) --------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        scope: RequestScope = NO_SCOPE,
    ) -> int:
        """Queue a request (token ids already validated); returns its id. The prompt is packed
        and its store keys hashed here, on the caller's thread, not in the loop."""
        token_ids = pack_token_ids(prompt_token_ids)
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        sampling = sampling_params_to_dict(params)
        check_encodable(sampling, "sampling parameters")
        request_id = next(self._request_ids)
        state = RequestState(request_id, request_id, token_ids, params, sampling, 0, scope=scope)
        self.first_token.start(state, self.clock())
        self._look_up_hit(state)
        self._submissions.put(state)
        return request_id

    def _look_up_hit(self, state: RequestState) -> None:
        """How much of what the request prefills the store holds now, and the keys of its
        blocks while a write it may wait for could be under way (any thread)."""
        keys = self.hits.block_keys(state.prompt_token_ids, state.scope.cache_salt)
        state.num_cached_tokens = self.hits.num_cached_tokens(keys)
        state.block_keys = keys if self.persisting.is_enabled else None

    def placement(self, request_id: int) -> tuple[int | None, int | None] | None:
        """(PE, DE) engine ids of a request (the caller's id) that is in flight, None for an
        engine not chosen yet; None once it is done. A snapshot, for tools."""
        state = self._requests.get(self._client_id_to_request_id.get(request_id, request_id))
        return None if state is None else (state.prefill_engine_id, state.decode_engine_id)

    def num_requests_by_engine(self) -> dict[int, int]:
        """``request_state.num_requests_by_engine`` of the requests in flight (see
        ``engine_lost``). For /metrics, and for tests that must strike an engine while it
        holds requests."""
        return num_requests_by_engine(self._requests.values())

    def drain_events(self) -> list[RequestEvent]:
        return drain(self._events)

    # --- placement (the loop) -----------------------------------------------------------------

    def take_submitted(self) -> None:
        """Queue the submitted requests for placement (failed at once with a role missing)."""
        for state in drain(self._submissions):
            self._requests[state.request_id] = state
            reason = self.membership.unavailable_reason
            if reason is not None:
                self._fail(state.request_id, reason, is_unavailable=True)
            else:
                self._enqueue(state)

    def _enqueue(self, state: RequestState) -> None:
        """Queue the request for placement, unless its hit prefix stops at a block a DE is
        still writing: then it waits for that write (at most ``persist_wait_s``)."""
        if self._is_waiting_for_writes(state):
            return
        state.block_keys = None  # placement needs only the hit length
        self._place(
            SchedulerRequest(
                state.request_id,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_cached_tokens=state.num_cached_tokens,
                max_num_output_tokens=max(1, state.params.max_tokens - state.num_output_tokens),
                preferred_decode_engine_id=self.sessions.decode_engine_of(
                    state.scope.session_id, self.clock()
                ),
            )
        )

    def _is_waiting_for_writes(self, state: RequestState) -> bool:
        keys = state.block_keys
        if keys is None:
            return False
        block_size = self.hits.block_size
        num_hit = state.num_cached_tokens // block_size
        while num_hit < len(keys):
            writer_id = self.persisting.writer_of(keys[num_hit])
            if writer_id is not None:
                self.persisting.wait(writer_id, state)
                return True
            # Not being written: absent, or written since the submit's lookup.
            num_more = self.hits.num_more_blocks(keys[num_hit:])
            if not num_more:
                break
            num_hit += num_more
            state.num_cached_tokens = num_hit * block_size
        return False

    def _enqueue_all(self, states: list[RequestState]) -> None:
        """Queue requests released from waiting (those not cancelled meanwhile)."""
        for state in states:
            if state.request_id in self._requests:
                self._enqueue(state)

    def release_due(self) -> None:
        """Re-placements whose delay is over, and requests whose persist wait expired."""
        now_s = self.clock()
        for state in self._delayed.due(now_s):
            self._enqueue_again(state)
        if self.persisting:
            self._enqueue_all(self.persisting.expire(now_s))

    def assign(self, request_id: int, pe: int, de: int, plan: LoadPlan) -> None:
        """The request's pair and read plan are final: one Assignment to both engines, or to its
        DE alone where that DE prefills it (``pairing.py``)."""
        state = self._requests.get(request_id)
        if state is None:  # cancelled while queued
            return
        pe, plan = self.pairing.paired(pe, de, plan, len(state.prompt_token_ids))
        state.prefill_engine_id, state.decode_engine_id = pe, de
        assignment = Assignment(
            request_id=request_id,
            prompt_token_ids=state.prompt_token_ids,
            sampling=state.sampling,
            num_prefill_side_blocks=plan.num_prefill_side_blocks,
            num_decode_side_blocks=plan.num_decode_side_blocks,
            prefill_engine_id=pe,
            decode_engine_id=de,
            num_output_tokens=state.num_output_tokens,
            is_prefill_held_sent=self.pairing.is_prefill_held_sent(pe, plan),
            cache_salt=state.scope.cache_salt,
            session_retention_s=self.sessions.retention_s_of(state.scope.session_id),
        )
        try:
            data = encode(assignment)  # once: both engines get the same bytes
        except (TypeError, ValueError, OverflowError) as exc:  # submit checked; never here
            logger.exception("request %d cannot be sent", state.client_request_id)
            self._fail(request_id, f"the request cannot be sent to its engines: {exc}")
            return
        try:
            self.membership.send_encoded_to_engine(de, data)
            if pe != de:
                self.membership.send_encoded_to_engine(pe, data)
        except PeerUnavailable as exc:
            self._fail(request_id, f"engine unavailable at assignment: {exc}")
            return
        self.num_assigned += 1
        now_s = self.clock()
        self.first_token.mark(state, "placement", now_s)
        self.sessions.on_assigned(state.scope.session_id, de, now_s)
        self._forward_if_served(state, pe, de)

    def _forward_if_served(self, state: RequestState, pe: int, de: int) -> None:
        """A request placed on a vLLM server DE: the front door is told where to forward it
        (the connectors of both already hold its Assignment)."""
        decode_url = self.membership.engine_url(de)
        if not decode_url:
            return
        state.is_forwarded = True
        forward = Forward(state.request_id, pe, de, self.membership.engine_url(pe), decode_url)
        self._events.put(
            RequestEvent(
                state.client_request_id,
                (),
                None,
                state.num_cached_tokens,
                time_s=self.clock(),
                forward=forward,
            )
        )

    # --- the engines' messages (the loop) -----------------------------------------------------

    def on_decode_ready(self, msg: DecodeReady, now_s: float) -> None:
        """The DE holds the prompt's slots and its side's hit KV: the PE may prefill."""
        state = self._requests.get(msg.request_id)
        if state is not None:
            self.first_token.mark(state, "decode_ready", now_s)
        self.relay(msg.request_id, msg, to_prefill=True)

    def relay(self, request_id: int, msg: object, *, to_prefill: bool) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        target = state.prefill_engine_id if to_prefill else state.decode_engine_id
        try:
            self.membership.send_to_engine(target, msg)
        except PeerUnavailable as exc:
            self._fail(request_id, str(exc))

    def on_prefill_done(self, msg: PrefillDone, now_s: float) -> None:
        """The first token (of this placement) streams out; the DE learns its KV is complete."""
        state = self._requests.get(msg.request_id)
        if state is None:
            return
        state.is_prefill_done = True
        self.first_token.mark(state, "prefill", now_s)
        if state.reported_cached_tokens is None:
            state.reported_cached_tokens = msg.num_cached_tokens
        if state.is_forwarded:  # the DE's server samples and streams every token itself
            self.relay(msg.request_id, msg, to_prefill=False)
            return
        state.finish_reason_pending = msg.finish_reason
        logprobs = None if msg.first_token_logprob is None else (msg.first_token_logprob,)
        stages_s = self.first_token.of(state)
        self._emit(state, (msg.first_token_id,), None, logprobs, now_s, stages_s)
        if not state.is_local_prefill:  # not from the DE itself
            self.relay(msg.request_id, msg, to_prefill=False)

    def on_tokens(self, msg: TokenUpdate, now_s: float) -> None:
        state = self._requests.get(msg.request_id)
        if state is None:
            return
        state.finish_reason_pending = None
        if state.is_forwarded:  # its tokens went to the front door over HTTP: only the end
            if msg.finish_reason is not None:
                self._emit(state, (), msg.finish_reason, None, now_s)
        else:
            self._emit(state, msg.token_ids, msg.finish_reason, msg.logprobs, now_s)
        if msg.finish_reason is not None:
            self._pop(msg.request_id)
            self.sessions.on_finished(state.scope.session_id, now_s)
            if msg.persisting_keys and state.decode_engine_id is not None:
                self.persisting.add(
                    msg.request_id, state.decode_engine_id, msg.persisting_keys, now_s
                )

    def _emit(
        self,
        state: RequestState,
        token_ids: tuple[int, ...],
        finish_reason: str | None,
        logprobs: tuple | None,
        now_s: float,
        first_token_stages_s: tuple[float, ...] | None = None,
    ) -> None:
        """Tokens to the caller, remembered (a placement after a loss goes on from them)."""
        if token_ids:
            state.output_token_ids += token_ids
            if state.lost_at_s is not None:
                self.replacement_delays.add(now_s - state.lost_at_s)
                state.lost_at_s = None
        self._events.put(
            RequestEvent(
                state.client_request_id,
                token_ids,
                finish_reason,
                state.reported_cached_tokens or 0,
                logprobs=logprobs,
                time_s=now_s,
                first_token_stages_s=first_token_stages_s,
            )
        )

    def on_persisted(self, msg: KVPersisted) -> None:
        self._enqueue_all(self.persisting.written(msg.request_ids))

    def on_failed(self, msg: RequestFailed, now_s: float) -> None:
        state = self._requests.get(msg.request_id)
        if state is not None and state.is_forwarded:
            if msg.is_retryable and msg.peer_engine_id >= 0:
                self._suspect(msg.peer_engine_id)
            self._fail(
                msg.request_id,
                msg.reason,
                is_engine_lost=msg.is_retryable,
                is_prompt_refused=msg.is_prompt_refused,
            )
        elif msg.is_retryable and state is not None and may_place_again(state):
            # The PE lost a DE (``replacement.retry_after_failure``); that DE is suspected:
            # nothing more is placed on it until it reports again.
            if msg.peer_engine_id >= 0:
                self._suspect(msg.peer_engine_id)
            retry = retry_after_failure(state, msg, self.membership.is_alive)
            if retry.wait_for_peer is not None:
                at_s = now_s + self.retry_after_s  # if it is not declared dead before
                self._place_again(state, msg.reason, at_s=at_s, peer=retry.wait_for_peer)
            else:
                self._place_again(state, msg.reason, counts=retry.counts)
        else:
            self._fail(msg.request_id, msg.reason)

    # --- endings ------------------------------------------------------------------------------

    def cancel(self, request_id: int) -> None:
        """Stop a request (the caller's id) wherever it is; its engines free its buffers and
        KV."""
        state = self._pop(self._client_id_to_request_id.get(request_id, request_id))
        if state is None:
            return
        for engine_id in dict.fromkeys((state.prefill_engine_id, state.decode_engine_id)):
            if engine_id is not None:
                with contextlib.suppress(PeerUnavailable):  # a dead engine frees nothing
                    self.membership.send_to_engine(engine_id, CancelRequest(state.request_id))

    def _pop(self, request_id: int) -> RequestState | None:
        """Forget a placement's request (finished, failed or cancelled)."""
        state = self._requests.pop(request_id, None)
        if state is not None and state.client_request_id != request_id:
            del self._client_id_to_request_id[state.client_request_id]
        return state

    def _fail(
        self,
        request_id: int,
        reason: str,
        *,
        is_unavailable: bool = False,
        is_engine_lost: bool = False,
        is_prompt_refused: bool = False,
    ) -> None:
        state = self._pop(request_id)
        if state is None:
            return
        logger.warning("request %d failed: %s", state.client_request_id, reason)
        self.num_failed_unavailable += is_unavailable
        self._events.put(
            RequestEvent(
                state.client_request_id,
                (),
                "error",
                state.num_cached_tokens,
                error=reason,
                is_unavailable=is_unavailable,
                is_engine_lost=is_engine_lost,
                is_prompt_refused=is_prompt_refused,
            )
        )
        self._cancel_on_live_engines(state)

    def _cancel_on_live_engines(self, state: RequestState) -> None:
        """Free the placement on its live engines (a PE is done with a prefilled one)."""
        engines = (state.decode_engine_id,)
        if not state.is_prefill_done and not state.is_local_prefill:
            engines = (state.prefill_engine_id, state.decode_engine_id)
        for engine_id in engines:
            if engine_id is not None and self.membership.is_alive(engine_id):
                self.membership.send_to_engine(engine_id, CancelRequest(state.request_id))

    # --- lost engines -------------------------------------------------------------------------

    def engine_lost(self, engine_id: int, why: str) -> None:
        """Every request that still needs the dead engine is placed again or fails (see the
        module docstring); so are those waiting for its writes, and, with no engine of a role
        left, every request that needs one fails. Its sessions start afresh elsewhere."""
        self.sessions.engine_lost(engine_id)
        for request_id, request in list(self._requests.items()):
            if needs_engine(request, engine_id):
                if request.is_forwarded:  # the front door places it again from its stream
                    self._fail(request_id, why, is_engine_lost=True)
                elif request.finish_reason_pending is not None:  # only its finish was lost
                    self._emit(request, (), request.finish_reason_pending, None, self.clock())
                    self._pop(request_id)
                elif may_place_again(request):
                    self._place_again(request, why)
                else:
                    self._fail(request_id, why)
        for state in self._delayed.waiting_for(engine_id):  # known dead now
            self._enqueue_again(state)
        self._enqueue_all(self.persisting.engine_lost(engine_id))
        self._fail_unplaceable()

    def _fail_unplaceable(self) -> None:
        """With no live engine of a role left, every request that still needs one fails now
        (nothing could place it): all of them without a DE, those not prefilled without a PE."""
        reason = self.membership.unavailable_reason
        if reason is None:
            return
        needs_decode = not self.membership.num_live_engines_of(DECODE)
        for request_id, request in list(self._requests.items()):
            if needs_decode or not request.is_prefill_done:  # (a re-placed one is not)
                self._fail(request_id, reason, is_unavailable=True)
        self._delayed.clear()

    def _place_again(
        self,
        state: RequestState,
        why: str,
        *,
        at_s: float = 0.0,
        peer: int | None = None,
        counts: bool = True,
    ) -> None:
        """Abandon this placement (its live engines free it) and queue the request again under
        a fresh id, now or at ``at_s``, its hit looked up anew; see the module docstring."""
        self._cancel_on_live_engines(state)
        del self._requests[state.request_id]
        state.request_id = next(self._request_ids)
        self._requests[state.request_id] = state
        self._client_id_to_request_id[state.client_request_id] = state.request_id
        state.abandon_placement(counts=counts, now_s=self.clock())
        logger.warning(
            "request %d placed again (placement %d): %s",
            state.client_request_id,
            state.num_placements,
            why,
        )
        self.num_replaced += 1
        if at_s > self.clock():
            self._delayed.add(at_s, state, peer)
        else:
            self._enqueue_again(state)

    def _enqueue_again(self, state: RequestState) -> None:
        if state.request_id not in self._requests:
            return  # cancelled meanwhile
        self._look_up_hit(state)
        self._enqueue(state)

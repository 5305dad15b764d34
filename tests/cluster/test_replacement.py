"""The re-placement rules on their own: which failures wait for a dead peer, which count."""

from __future__ import annotations

import array

from dualpath.cluster.replacement import DelayedPlacements, Retry, retry_after_failure
from dualpath.cluster.request_state import MAX_COLLATERAL, RequestState
from dualpath.protocol import RequestFailed
from dualpath.types import SamplingParams


def _state(decode_engine_id: int | None = 2) -> RequestState:
    state = RequestState(0, 0, array.array("i"), SamplingParams(), {}, 0)
    state.decode_engine_id = decode_engine_id
    return state


def _failed(peer_engine_id: int) -> RequestFailed:
    return RequestFailed(0, "prefill failed", is_retryable=True, peer_engine_id=peer_engine_id)


def test_a_request_whose_own_decode_engine_failed_waits_until_it_is_known_dead() -> None:
    state = _state(2)
    assert retry_after_failure(state, _failed(2), lambda e: True) == Retry(2, counts=True)
    assert retry_after_failure(state, _failed(-1), lambda e: True) == Retry(2, counts=True)
    assert retry_after_failure(state, _failed(2), lambda e: False) == Retry(None, counts=True)


def test_collateral_losses_go_at_once_and_count_only_past_their_bound() -> None:
    state = _state(2)
    retries = [retry_after_failure(state, _failed(3), lambda e: True) for _ in range(6)]
    assert [r.wait_for_peer for r in retries] == [None] * 6
    assert [r.counts for r in retries] == [False] * MAX_COLLATERAL + [True]


def test_delayed_placements_leave_when_due_or_when_their_peer_is_dead() -> None:
    delayed = DelayedPlacements()
    a, b, c = _state(), _state(), _state()
    delayed.add(10.0, a, 2)
    delayed.add(5.0, b, 3)
    delayed.add(20.0, c, None)
    assert delayed.due(4.0) == []
    assert delayed.waiting_for(2) == [a]
    assert delayed.due(6.0) == [b]
    assert delayed.due(6.0) == []
    delayed.clear()
    assert delayed.due(100.0) == []

"""When a request that lost an engine is placed again (SPEC §8): the rules, apart from the
lifecycle (``lifecycle.py``) that applies them.

**Re-placement** (SPEC §8). A request whose engine dies is placed again (at most
``MAX_PLACEMENTS`` times in all) under a fresh internal id, so that a late message about the
lost attempt finds nothing; the caller keeps its id. One that has not produced a token yet
starts over. One that is streaming goes on where the client's stream stands: its prompt and
the tokens sent so far are prefilled on a PE (what the store holds of them is a hit) and a DE
continues from there (``Assignment.num_output_tokens``), so the client gets each token once
and the same tokens as without the loss (greedy, or seeded: token i has its own seed). Once
prefilled a request no longer needs its PE. Those a PE gave up on because their DE failed
mid-transfer (``RequestFailed.is_retryable``) are placed again one heartbeat timeout later,
when a dead peer is known. With no engine of a role left, the requests that need one fail at
once as unavailable.

    retry = retry_after_failure(state, msg, is_alive)   # a PE gave a request back
    delayed.add(at_s, state, peer); delayed.due(now_s); delayed.waiting_for(peer)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dualpath.cluster.request_state import MAX_COLLATERAL, RequestState
from dualpath.protocol import RequestFailed


@dataclass(frozen=True, slots=True)
class Retry:
    """How a request a PE gave back is placed again."""

    # Once this DE is declared dead (at most a heartbeat timeout later), so that nothing is
    # placed on it again; None: at once.
    wait_for_peer: int | None
    counts: bool  # toward MAX_PLACEMENTS


def retry_after_failure(
    state: RequestState, msg: RequestFailed, is_alive: Callable[[int], bool]
) -> Retry:
    """The PE lost a DE (``msg.is_retryable``). A request whose own DE it was waits until that
    DE is known dead; one that only shared the failed batch goes at once, and its loss does
    not count toward the limit, up to MAX_COLLATERAL such losses (counted on ``state``), so
    that no request loops forever."""
    peer = state.decode_engine_id
    is_own_peer = msg.peer_engine_id in (-1, peer)
    if is_own_peer and peer is not None and is_alive(peer):
        return Retry(wait_for_peer=peer, counts=True)
    state.num_collateral += not is_own_peer
    return Retry(wait_for_peer=None, counts=is_own_peer or state.num_collateral > MAX_COLLATERAL)


class DelayedPlacements:
    """Re-placements that wait for a lost peer to be declared dead, at most until a time."""

    def __init__(self) -> None:
        self._entries: list[tuple[float, RequestState, int | None]] = []

    def add(self, at_s: float, state: RequestState, peer: int | None) -> None:
        self._entries.append((at_s, state, peer))

    def due(self, now_s: float) -> list[RequestState]:
        """Those whose time has come, taken out."""
        return self._take(lambda at_s, peer: at_s <= now_s)

    def waiting_for(self, peer: int) -> list[RequestState]:
        """Those waiting for ``peer``, now known dead, taken out."""
        return self._take(lambda at_s, waited_for: waited_for == peer)

    def clear(self) -> None:
        self._entries.clear()

    def _take(self, is_due: Callable[[float, int | None], bool]) -> list[RequestState]:
        if not self._entries:
            return []
        taken = [state for at_s, state, peer in self._entries if is_due(at_s, peer)]
        self._entries = [e for e in self._entries if not is_due(e[0], e[2])]
        return taken

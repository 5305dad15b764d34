"""Agent sessions in the scheduler process: which DE served each one last (SPEC §10).

A request may name the agent session it continues (``RequestScope.session_id``: the
``X-Session-Id`` header, Dynamo's ``X-Dynamo-Session-ID``, or vLLM's body field
``session_id``). Its next turn is placed on the same DE while that DE is in service and its
memory gate admits the request (``SchedulerRequest.preferred_decode_engine_id``, honoured by
the policy; otherwise the policy's own choice), and that DE keeps the session's blocks in its
store for ``retention_s`` after each turn (``Assignment.session_retention_s``,
``dualpath.engine.session_blocks``), so an agent back from a slow tool finds its KV.

    sessions = Sessions(retention_s=300.0)
    preferred = sessions.decode_engine_of("agent-7", now_s)    # None: first turn, or forgotten
    outcome = sessions.on_assigned("agent-7", decode_engine_id, now_s)  # "first", "same_de", "moved"
    sessions.on_finished("agent-7", now_s)                       # the retention runs from here
    sessions.engine_lost(decode_engine_id)                       # its sessions start afresh

Bounded: a session is forgotten ``retention_s`` after its last turn (the store's marks end
then too), and beyond ``max_num_sessions`` the one seen least recently goes first. The table
is kept in the order sessions were last seen, so both run from its front. ``retention_s`` 0
turns sessions off: no preference, no retention, nothing remembered (requests are still
counted by outcome "first"). Loop thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Far more agents than one cluster serves at once; an entry is about 200 bytes and its id.
MAX_NUM_SESSIONS = 100_000
AFFINITY_OUTCOMES = ("first", "same_de", "moved")


@dataclass(slots=True)
class _Session:
    decode_engine_id: int
    last_seen_s: float


class Sessions:
    def __init__(self, retention_s: float, *, max_num_sessions: int = MAX_NUM_SESSIONS) -> None:
        if retention_s < 0:
            raise ValueError(f"retention_s must be >= 0, got {retention_s}")
        if max_num_sessions <= 0:
            raise ValueError(f"max_num_sessions must be > 0, got {max_num_sessions}")
        self.retention_s = retention_s
        self.max_num_sessions = max_num_sessions
        self._session_id_to_session: OrderedDict[str, _Session] = OrderedDict()
        # Placements of session requests by outcome: its session had no DE remembered
        # ("first"), went to the DE it had ("same_de"), or to another ("moved").
        self.outcome_to_num_placements = dict.fromkeys(AFFINITY_OUTCOMES, 0)

    def decode_engine_of(self, session_id: str | None, now_s: float) -> int | None:
        """The DE of the session's last turn, if it is remembered."""
        if session_id is None or not self.retention_s:
            return None
        self._forget_expired(now_s)
        session = self._session_id_to_session.get(session_id)
        return None if session is None else session.decode_engine_id

    def retention_s_of(self, session_id: str | None) -> float:
        """What the DE of a request keeps its blocks for (``Assignment.session_retention_s``)."""
        return 0.0 if session_id is None else self.retention_s

    def on_assigned(self, session_id: str | None, decode_engine_id: int, now_s: float) -> str:
        """A session request was placed on ``decode_engine_id``: remembered, and the outcome
        counted, logged (INFO) and returned ("" for a request without a session)."""
        if session_id is None:
            return ""
        previous = self.decode_engine_of(session_id, now_s)
        if previous is None:
            outcome = "first"
        else:
            outcome = "same_de" if previous == decode_engine_id else "moved"
        self.outcome_to_num_placements[outcome] += 1
        logger.info("session %r: decode engine %d (%s)", session_id, decode_engine_id, outcome)
        if self.retention_s:
            self._see(session_id, decode_engine_id, now_s)
        return outcome

    def on_finished(self, session_id: str | None, now_s: float) -> None:
        """A session request ended: the session counts as seen now (its retention runs from
        its last turn's end, as its DE's store marks do)."""
        if session_id is None or not self.retention_s:
            return
        session = self._session_id_to_session.get(session_id)
        if session is not None:
            self._see(session_id, session.decode_engine_id, now_s)

    def engine_lost(self, engine_id: int) -> None:
        """Forget the sessions of a lost DE: their next turns are placed afresh."""
        lost = [
            s
            for s, session in self._session_id_to_session.items()
            if session.decode_engine_id == engine_id
        ]
        for session_id in lost:
            del self._session_id_to_session[session_id]

    def num_active(self, now_s: float) -> int:
        """Sessions seen within the retention time."""
        self._forget_expired(now_s)
        return len(self._session_id_to_session)

    def _see(self, session_id: str, decode_engine_id: int, now_s: float) -> None:
        sessions = self._session_id_to_session
        sessions.pop(session_id, None)
        sessions[session_id] = _Session(decode_engine_id, now_s)
        while len(sessions) > self.max_num_sessions:
            sessions.popitem(last=False)

    def _forget_expired(self, now_s: float) -> None:
        sessions = self._session_id_to_session
        while sessions:
            session = next(iter(sessions.values()))
            if now_s - session.last_seen_s < self.retention_s:
                return
            sessions.popitem(last=False)

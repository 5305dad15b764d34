"""Who is in the cluster and alive: engines joining, liveness, and the way to reach them.

An engine joins with an ``EngineInfo`` over its control client (``engine-<id>``) and must fit
the topology (its node and role). A control client may speak for several engines (a group
leader, ``dualpath.bench.leader_protocol``): hearing from it keeps all of them alive.

Liveness is hearing anything from an engine's client: its loop's messages, or the
``EngineHeartbeat`` its heartbeat thread sends every heartbeat period whatever the loop does
(``dualpath.cluster.engine_heartbeat``). A heartbeat says how long the engine's unit of work in
progress has run: one longer than ``heartbeat_timeout_s`` is busy, not dead (logged once per
step, listed by ``busy_engines``). An engine whose client stays silent for
``heartbeat_timeout_s`` (its process stopped or gone, or its heartbeat thread) is due to be
declared dead (checked once per heartbeat period, ``heartbeat_timeout_s /
HEARTBEATS_PER_TIMEOUT``), and so is one whose process this host saw exit
(``on_engine_exited``); the coordinator declares it dead, then re-places its requests.

    membership.register(client_id, info, now_s)     # EngineInfo
    engine = membership.sender(client_id, now_s)    # any other message: its live engine
    membership.on_heartbeat(engine, step_s)         # EngineHeartbeat: busy, or not
    membership.check_liveness(declare_dead)        # once per heartbeat period
    membership.send_to_engine(engine_id, msg)       # PeerUnavailable if no client speaks for it
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass

from dualpath.control.channel import ControlServer
from dualpath.control.codec import encode
from dualpath.errors import PeerUnavailable
from dualpath.protocol import (
    DECODE,
    HEARTBEATS_PER_TIMEOUT,
    PREFILL,
    EngineInfo,
    Heartbeat,
    PeerTable,
    Shutdown,
    engine_id_of,
)
from dualpath.queues import drain
from dualpath.scheduler import ClusterTopology, EngineRole

logger = logging.getLogger(__name__)


@dataclass
class Client:
    """A control client that speaks for engines: itself, or its group (a leader)."""

    client_id: str
    last_seen_s: float


@dataclass
class EngineState:
    info: EngineInfo
    client: Client
    is_alive: bool = True
    # How long the engine's unit of work in progress had run at its last heartbeat (0.0:
    # between units, or no heartbeat yet).
    step_s: float = 0.0


class Membership:
    def __init__(
        self,
        topology: ClusterTopology,
        server: ControlServer,
        *,
        heartbeat_timeout_s: float,
        clock: Callable[[], float],
        kv_fingerprint: str = "",
    ) -> None:
        self.server = server
        self.kv_fingerprint = kv_fingerprint  # "": engines' KV namespaces are not checked
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.engine_id_to_node = {e: n.node_id for n in topology.nodes for e in n.engine_ids}
        self._engine_id_to_role = {
            e: PREFILL if g.role == EngineRole.PREFILL else DECODE
            for g in topology.groups
            for e in g.engine_ids
        }
        self.engines: dict[int, EngineState] = {}
        self._client_id_to_engine_id: dict[str, int] = {}
        self.is_peer_table_stale = False  # membership changed: announce once this loop turn
        self._last_heartbeat_s = 0.0
        self.has_been_ready = False  # every engine has joined once (see unavailable_reason)
        self._dead_engine_id_to_why: dict[int, str] = {}
        self.engine_deaths: dict[int, int] = {}  # id -> times declared dead
        # Live engines by role, kept by join and declare_dead: read on every submission, so
        # not counted by walking every engine (1,152 at 48P96D).
        self._role_to_num_live = dict.fromkeys((PREFILL, DECODE), 0)
        # Engine processes this host saw exit, with their exit code (the launcher's watch).
        self._exited: queue.SimpleQueue[tuple[int, int | str]] = queue.SimpleQueue()

    # --- counts (any thread: they read counters only) ----------------------------------------

    @property
    def num_expected_engines(self) -> int:
        return len(self.engine_id_to_node)

    @property
    def num_live_engines(self) -> int:
        return sum(self._role_to_num_live.values())

    def num_live_engines_of(self, role: str) -> int:
        return self._role_to_num_live[role]

    def is_ready(self) -> bool:
        """Every engine of the topology has registered and is alive."""
        return self.num_live_engines == self.num_expected_engines

    @property
    def unavailable_reason(self) -> str | None:
        """Why no request can be served now (no live engine of a role), or None. Before every
        engine has joined once, engines are still coming and nothing is unavailable."""
        if not self.has_been_ready:
            return None
        missing = [role for role in (PREFILL, DECODE) if not self._role_to_num_live[role]]
        if not missing:
            return None
        return f"no {' and no '.join(missing)} engine is alive"

    def dead_engines(self) -> dict[int, str]:
        """Engines declared dead: id -> why."""
        return dict(self._dead_engine_id_to_why)

    def is_alive(self, engine_id: int) -> bool:
        state = self.engines.get(engine_id)
        return state is not None and state.is_alive

    def busy_engines(self) -> dict[int, float]:
        """Live engines in a step longer than the heartbeat timeout, by their heartbeats:
        id -> how long the step had run at the last one (s). (Loop thread: it walks engines.)"""
        return {
            e: s.step_s
            for e, s in self.engines.items()
            if s.is_alive and s.step_s > self.heartbeat_timeout_s
        }

    # --- joining ------------------------------------------------------------------------------

    def register(self, client_id: str, info: EngineInfo, now_s: float) -> bool:
        """An engine joins, speaking for itself; one that does not fit the topology is told
        to shut down (False)."""
        problem = self.topology_problem(info) or self.kind_problem(info)
        if problem is not None:
            logger.error("engine %s does not fit the topology: %s", info, problem)
            self.server.send(client_id, Shutdown(problem))
            return False
        self.join(info, Client(client_id, now_s))
        logger.info("engine %d (%s, node %d) joined", info.engine_id, info.role, info.node_id)
        return True

    def topology_problem(self, info: EngineInfo) -> str | None:
        """Why the engine does not fit the topology, or None if it does."""
        if self.engine_id_to_node.get(info.engine_id) != info.node_id:
            return f"engine {info.engine_id} not in the topology (as node {info.node_id})"
        expected_role = self._engine_id_to_role[info.engine_id]
        if info.role != expected_role:
            return f"engine {info.engine_id} must be {expected_role}"
        return None

    def kind_problem(self, info: EngineInfo) -> str | None:
        """Why the engine cannot serve beside the live ones, or None: its KV must be keyed as
        the scheduler's store lookups are, and a vLLM server (``url``) is paired only with
        DEs that are vLLM servers too (the front door forwards a request to its DE)."""
        if (
            info.kv_fingerprint
            and self.kv_fingerprint
            and info.kv_fingerprint != self.kv_fingerprint
        ):
            return (
                f"engine {info.engine_id}'s KV is keyed {info.kv_fingerprint}, the scheduler's "
                f"store lookups {self.kv_fingerprint}: start both with the same model, dtype, "
                "block size and engine kind (e.g. 'dualpath serve --engine vllm --block-size N')"
            )
        others = [s.info for e, s in self.engines.items() if s.is_alive and e != info.engine_id]
        decodes = [i for i in others if i.role == DECODE]
        if info.role == DECODE and any(bool(i.url) != bool(info.url) for i in decodes):
            return "a cluster's decode engines are all vLLM servers or all dualpath engines"
        served_decodes = bool(info.url) if info.role == DECODE else None
        if decodes:
            served_decodes = bool(decodes[0].url)
        served_prefills = [i for i in others if i.role == PREFILL and i.url]
        if info.role == PREFILL and info.url:
            served_prefills.append(info)
        if served_prefills and served_decodes is False:
            return "a vLLM server prefill engine needs decode engines that are vLLM servers"
        return None

    def engine_url(self, engine_id: int) -> str:
        """The engine's OpenAI URL if it is a vLLM server, else ""."""
        state = self.engines.get(engine_id)
        return "" if state is None else state.info.url

    def engine_urls(self) -> dict[int, str]:
        """Live engines that are vLLM servers: id -> OpenAI URL."""
        return {e: s.info.url for e, s in self.engines.items() if s.is_alive and s.info.url}

    def join(self, info: EngineInfo, client: Client) -> None:
        """``info`` (fitting the topology) joins through ``client``; one that joins again
        replaces its earlier self, counted once."""
        previous = self.engines.get(info.engine_id)
        if previous is not None and previous.is_alive:
            self._role_to_num_live[previous.info.role] -= 1
        self.engines[info.engine_id] = EngineState(info, client)
        self._role_to_num_live[info.role] += 1
        self._dead_engine_id_to_why.pop(info.engine_id, None)
        self.is_peer_table_stale = True

    def sender(self, client_id: str, now_s: float) -> EngineState | None:
        """The live engine a message from ``client_id`` comes from (its client is heard from
        now), or None for one that has not joined or was declared dead."""
        engine_id = self._client_id_to_engine_id.get(client_id)
        if engine_id is None:  # parsed once per client: this runs for every report
            engine_id = self._client_id_to_engine_id[client_id] = engine_id_of(client_id)
        engine = self.engines.get(engine_id)
        if engine is None or not engine.is_alive:
            return None
        engine.client.last_seen_s = now_s
        return engine

    # --- liveness -----------------------------------------------------------------------------

    def on_heartbeat(self, engine: EngineState, step_s: float) -> None:
        """``engine``'s heartbeat (its client already heard from, ``sender``): in a unit of
        work for ``step_s``. A step past the heartbeat timeout is logged once, as busy."""
        timeout_s = self.heartbeat_timeout_s
        if step_s > timeout_s >= engine.step_s:
            logger.warning(
                "engine %d is busy in a step of %.1f s, longer than the %.1f s heartbeat "
                "timeout: alive (its heartbeats arrive), not declared dead",
                engine.info.engine_id,
                step_s,
                timeout_s,
            )
        engine.step_s = step_s

    def on_engine_exited(self, engine_id: int, exit_code: int) -> None:
        """An engine process of this host exited (any thread): it is due to be declared dead
        at the loop's next turn, without waiting for the heartbeat timeout."""
        self._exited.put((engine_id, exit_code))

    def on_engine_unreachable(self, engine_id: int, why: str) -> None:
        """A vLLM server engine's HTTP connection failed (any thread): due to be declared
        dead at the loop's next turn."""
        self._exited.put((engine_id, why))

    def exited_engines(self) -> list[tuple[int, str]]:
        """Live engines whose process exited or whose server is unreachable, with why: to
        declare dead now."""
        due: list[tuple[int, str]] = []
        for engine_id, cause in drain(self._exited):
            if self.is_alive(engine_id) and all(engine_id != e for e, _ in due):
                # (once: several streams find a lost server unreachable at once)
                why = cause if isinstance(cause, str) else f"its process exited with code {cause}"
                due.append((engine_id, why))
        return due

    def check_liveness(self, declare_dead: Callable[[int, str], None]) -> None:
        """``declare_dead(engine_id, why)`` for each live engine silent for
        ``heartbeat_timeout_s``, then the heartbeat to every client. Once per heartbeat period,
        not per loop turn: a turn takes about a millisecond at scale, and this walks every
        engine (1,152 at 48P96D)."""
        now_s = self.clock()
        timeout_s = self.heartbeat_timeout_s
        if now_s - self._last_heartbeat_s < timeout_s / HEARTBEATS_PER_TIMEOUT:
            return
        self._last_heartbeat_s = now_s
        for engine_id, state in list(self.engines.items()):
            silent_s = now_s - state.client.last_seen_s
            if state.is_alive and silent_s > timeout_s:
                declare_dead(engine_id, f"silent for {silent_s:.1f} s (no message, no heartbeat)")
        self.broadcast(Heartbeat(self.num_live_engines))

    def declare_dead(self, engine_id: int, why: str, *, forget_client: bool = True) -> EngineState:
        """Mark the engine dead; its client is forgotten (its later messages rejected) once it
        speaks for no live engine, unless not ``forget_client`` (a new process of the engine
        speaks through it now)."""
        state = self.engines[engine_id]
        assert state.is_alive, f"engine {engine_id} declared dead twice"
        state.is_alive = False
        self._role_to_num_live[state.info.role] -= 1
        self._dead_engine_id_to_why[engine_id] = why
        self.engine_deaths[engine_id] = self.engine_deaths.get(engine_id, 0) + 1
        if forget_client and not any(
            e.is_alive and e.client is state.client for e in self.engines.values()
        ):
            self.server.forget(state.client.client_id)  # it speaks for no live engine any more
        logger.error("engine %d declared dead: %s", engine_id, why)
        self.is_peer_table_stale = True
        return state

    # --- sending ------------------------------------------------------------------------------

    def send_to_engine(self, engine_id: int, msg: object) -> None:
        """Send to the client that speaks for the engine; ``PeerUnavailable`` if none does."""
        self.send_encoded_to_engine(engine_id, encode(msg))

    def send_encoded_to_engine(self, engine_id: int, data: bytes) -> None:
        state = self.engines.get(engine_id)
        if state is None:
            raise PeerUnavailable(f"engine {engine_id} has not joined")
        self.server.send_encoded(state.client.client_id, data)

    def broadcast(self, msg: object) -> None:
        """Send to every client that speaks for a live engine, once each; encoded once (a
        PeerTable at 48P96D lists 1,152 engines)."""
        client_ids = dict.fromkeys(s.client.client_id for s in self.engines.values() if s.is_alive)
        data = encode(msg)
        for client_id in client_ids:
            with contextlib.suppress(PeerUnavailable):  # not welcomed yet
                self.server.send_encoded(client_id, data)

    def announce_peers(self) -> None:
        """The live engines to every client, once a loop turn at most, if they changed."""
        if self.is_peer_table_stale:
            self.is_peer_table_stale = False
            self.broadcast(PeerTable(tuple(e.info for e in self.engines.values() if e.is_alive)))

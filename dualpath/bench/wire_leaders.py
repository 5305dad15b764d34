"""Simulated group leaders for the over-the-wire scheduler bench (``bench.scheduler_wire``).

``run_driver`` runs in a process of its own (spawned), so that the leaders' CPU is never counted
as the scheduler's. Each leader is a real ``ControlClient``: hello with the cluster token,
``GroupInfo``, then every ``fetch_interval_s`` a full ``GroupReport`` of its engines (SPEC §6),
whether or not anything changed. The leaders' schedules are staggered evenly over the interval:
144 leaders at 10 ms are 14,400 reports/s. Assignments change the simulated engines' state
(``SimulatedLeader``) until the request "finishes".

The driver needs about a core of its own for 14,400 reports/s on the VM we measured on;
``num_late_reports`` counts reports sent over one fetch interval after they were due.
"""

from __future__ import annotations

import array
import heapq
import time
from dataclasses import dataclass
from typing import Any

from dualpath.bench.leader_protocol import GroupInfo, GroupReport
from dualpath.bench.paper_cluster import DECODE_KV_CAPACITY_BLOCKS, KV_BYTES_PER_TOKEN
from dualpath.control.channel import ControlClient
from dualpath.control.codec import encode
from dualpath.protocol import PREFILL, Assignment, EngineInfo

BLOCK_SIZE_TOKENS = 64
# Simulated speeds. A PE prefills 1.25x what 2,350 requests/s of 32.7K tokens need from 384 PEs
# (~200K tokens/s), so the cluster keeps up and the FIFO stays short; a DE emits one token per
# request every TPOT_S (the SLO is 50 ms).
PREFILL_TOKENS_PER_S = 250_000.0
TPOT_S = 0.040
SETTLE_ROUNDS = 3  # the driver has settled once every leader fetched this often (PeerTables in)
BYTES_SAMPLE_EVERY = 64  # one GroupReport / Assignment in this many is encoded again and measured
# A real engine's counters: cumulative bytes per link ("<link>.<class>") and store reads.
_LINK_CLASSES = ("inference", "kv")


@dataclass(frozen=True, slots=True)
class LeaderPlan:
    """One group as its leader sees it; engines in topology order, the leader first."""

    group_id: int
    role: str  # PREFILL or DECODE
    engine_ids: tuple[int, ...]
    node_ids: tuple[int, ...]  # per engine


@dataclass(frozen=True, slots=True)
class DriverConfig:
    endpoint: str
    token: str
    leaders: tuple[LeaderPlan, ...]
    fetch_interval_s: float
    link_bytes_interval_s: float
    engine_read_tokens_per_s: float  # a node's storage read rate shared by its engines


def run_driver(
    config: DriverConfig, stop: Any, is_settled: Any, num_taken_in: Any, results: Any
) -> None:
    """The spawned driver: join every leader, then fetch on schedule until ``stop``.

    ``stop`` and ``is_settled`` are events, ``num_taken_in`` a shared counter of Assignments
    the leaders took in, ``results`` a queue that gets ``driver_stats`` at the end.
    """
    leaders = [SimulatedLeader(plan, config, num_taken_in) for plan in config.leaders]
    for leader in leaders:
        leader.client.connect(timeout_s=30.0)
    for leader in leaders:  # all at once, so the scheduler announces the membership rarely
        leader.join()
    interval_s = config.fetch_interval_s
    start_s = time.monotonic()
    due = [(start_s + i * interval_s / len(leaders), i) for i in range(len(leaders))]
    report_times_s = array.array("d")
    num_late = 0
    while not stop.is_set():
        due_s, index = due[0]
        now_s = time.monotonic()
        if due_s > now_s:
            time.sleep(due_s - now_s)
            continue
        num_late += now_s - due_s > interval_s
        leaders[index].fetch(now_s)
        report_times_s.append(now_s)
        if len(report_times_s) == SETTLE_ROUNDS * len(leaders):
            is_settled.set()
        # A leader more than an interval late reports now, then every interval from now: it
        # does not send the reports it missed in a burst.
        next_due_s = due_s + interval_s
        heapq.heapreplace(due, (next_due_s if next_due_s > now_s else now_s + interval_s, index))
    last_message_s = time.monotonic()  # take in the last Assignments, until all is quiet
    while time.monotonic() - last_message_s < 0.5:
        if any([leader.receive(time.monotonic()) for leader in leaders]):
            last_message_s = time.monotonic()
        time.sleep(0.01)
    results.put(driver_stats(leaders, config, report_times_s, num_late))
    for leader in leaders:
        leader.client.close()


def driver_stats(
    leaders: list[SimulatedLeader],
    config: DriverConfig,
    report_times_s: array.array,
    num_late: int,
) -> dict[str, Any]:
    """What the bench needs from the driver: every Assignment as each side received it,
    report times, and per message kind its count and mean encoded size (sampled)."""
    messages: dict[str, dict[str, float]] = {}
    for leader in leaders:
        for kind, (count, sampled_bytes, num_sampled) in leader.messages.items():
            total = messages.setdefault(kind, {"count": 0, "bytes": 0, "num_sampled": 0})
            total["count"] += count
            total["bytes"] += sampled_bytes
            total["num_sampled"] += num_sampled
    return {
        "prefill_assignments": [a for x in leaders if x.is_prefill for a in x.assignments],
        "decode_assignments": [a for x in leaders if not x.is_prefill for a in x.assignments],
        "num_misrouted": sum(leader.num_misrouted for leader in leaders),
        "report_times_s": report_times_s.tobytes(),
        "num_late_reports": num_late,
        "fetch_interval_s": config.fetch_interval_s,
        "messages": {
            kind: {
                "count": total["count"],
                "mean_bytes": total["bytes"] / total["num_sampled"]
                if total["num_sampled"]
                else None,
            }
            for kind, total in sorted(messages.items())
        },
    }


class SimulatedLeader:
    """A group leader speaking for its simulated engines over a real ControlClient.

    Each engine's state is what SPEC §6 reports: seq_e and tok_e (a PE counts whole prompts, a
    DE prompt + max output, as the policy does), free KV blocks (DE) and read_q. An Assignment
    adds to them; a request leaves a PE once prefilled (FIFO at ``PREFILL_TOKENS_PER_S``) and a
    DE after its prefill and ``max_tokens`` x ``TPOT_S``. read_q drains at the node's storage
    rate shared by its engines. Link counters grow with the KV each side reads and moves.
    """

    def __init__(self, plan: LeaderPlan, config: DriverConfig, num_taken_in: Any) -> None:
        self.plan = plan
        self.is_prefill = plan.role == PREFILL
        self.client = ControlClient(config.endpoint, f"engine-{plan.engine_ids[0]}", config.token)
        self._num_taken_in = num_taken_in
        self._read_tokens_per_s = config.engine_read_tokens_per_s
        self._link_bytes_interval_s = config.link_bytes_interval_s
        num_engines = len(plan.engine_ids)
        self._position = {engine_id: i for i, engine_id in enumerate(plan.engine_ids)}
        self._num_seqs = [0] * num_engines
        self._num_tokens = [0] * num_engines
        self._num_free_blocks = [0 if self.is_prefill else DECODE_KV_CAPACITY_BLOCKS] * num_engines
        self._read_queue_tokens = [0.0] * num_engines
        self._busy_until_s = [0.0] * num_engines  # a PE prefills its requests one after another
        self._finishes: list[tuple[float, int, int, int]] = []  # (time, position, tokens, blocks)
        self._link_bytes = [
            {
                f"{link}.{kind}": 0
                for link in (f"node{node_id}.snic", f"engine{e}.cnic", f"engine{e}.host_memory")
                for kind in _LINK_CLASSES
            }
            | {"store_read_bytes": 0}
            for e, node_id in zip(plan.engine_ids, plan.node_ids, strict=True)
        ]
        self._last_fetch_s = self._last_link_bytes_s = time.monotonic()
        self.assignments: list[tuple[int, int, int]] = []  # (request_id, PE, DE) as received
        self.num_misrouted = 0
        # Per message kind: (count, sampled encoded bytes, number sampled).
        self.messages: dict[str, tuple[int, int, int]] = {}

    def join(self) -> None:
        infos = tuple(
            EngineInfo(
                e, self.plan.role, node_id, "simulated", b"", b"", 64, DECODE_KV_CAPACITY_BLOCKS
            )
            for e, node_id in zip(self.plan.engine_ids, self.plan.node_ids, strict=True)
        )
        self._send(GroupInfo(infos))

    def fetch(self, now_s: float) -> None:
        """One fetch: take in what arrived, let time pass, report the whole group."""
        self.receive(now_s)
        self._advance(now_s)
        link_bytes: tuple[dict[str, int], ...] = ()
        if now_s - self._last_link_bytes_s >= self._link_bytes_interval_s:
            self._last_link_bytes_s = now_s
            link_bytes = tuple(self._link_bytes)  # encoded right away: no copy needed
        self._send(
            GroupReport(
                self.plan.group_id,
                self.plan.engine_ids,
                tuple(self._num_seqs),
                tuple(self._num_tokens),
                tuple(self._num_free_blocks),
                tuple(map(int, self._read_queue_tokens)),
                link_bytes,
                (0,) * len(self.plan.engine_ids),
            )
        )

    def receive(self, now_s: float) -> bool:
        """Take in what arrived; True if anything did."""
        messages = self.client.poll(0.0)
        for msg in messages:
            self._count(msg)
            if isinstance(msg, Assignment):
                self._num_taken_in.value += 1
                self._on_assignment(msg, now_s)
        return bool(messages)

    def _on_assignment(self, assignment: Assignment, now_s: float) -> None:
        self.assignments.append(
            (assignment.request_id, assignment.prefill_engine_id, assignment.decode_engine_id)
        )
        if self.is_prefill:
            engine_id, num_side_blocks = (
                assignment.prefill_engine_id,
                assignment.num_prefill_side_blocks,
            )
        else:
            engine_id, num_side_blocks = (
                assignment.decode_engine_id,
                assignment.num_decode_side_blocks,
            )
        position = self._position.get(engine_id)
        if position is None:
            self.num_misrouted += 1
            return
        num_prompt_tokens = len(assignment.prompt_token_ids)
        read_bytes = num_side_blocks * BLOCK_SIZE_TOKENS * KV_BYTES_PER_TOKEN
        counters = self._link_bytes[position]
        counters[f"node{self.plan.node_ids[position]}.snic.kv"] += read_bytes
        counters["store_read_bytes"] += read_bytes
        counters[f"engine{engine_id}.host_memory.kv"] += read_bytes
        counters[f"engine{engine_id}.cnic.kv"] += num_prompt_tokens * KV_BYTES_PER_TOKEN
        counters[f"engine{engine_id}.cnic.inference"] += 1024  # control and token traffic
        self._read_queue_tokens[position] += num_side_blocks * BLOCK_SIZE_TOKENS
        prefill_s = num_prompt_tokens / PREFILL_TOKENS_PER_S
        if self.is_prefill:
            num_tokens, num_blocks = num_prompt_tokens, 0
            self._busy_until_s[position] = max(now_s, self._busy_until_s[position]) + prefill_s
            finish_s = self._busy_until_s[position]
        else:
            max_tokens = assignment.sampling["max_tokens"]
            num_tokens = num_prompt_tokens + max_tokens
            num_blocks = -(-num_tokens // BLOCK_SIZE_TOKENS)
            finish_s = now_s + prefill_s + max_tokens * TPOT_S
        self._num_seqs[position] += 1
        self._num_tokens[position] += num_tokens
        self._num_free_blocks[position] -= num_blocks
        heapq.heappush(self._finishes, (finish_s, position, num_tokens, num_blocks))

    def _advance(self, now_s: float) -> None:
        """Finish what is due and drain the read queues up to ``now_s``."""
        while self._finishes and self._finishes[0][0] <= now_s:
            _, position, num_tokens, num_blocks = heapq.heappop(self._finishes)
            self._num_seqs[position] -= 1
            self._num_tokens[position] -= num_tokens
            self._num_free_blocks[position] += num_blocks
        num_read_tokens = self._read_tokens_per_s * (now_s - self._last_fetch_s)
        self._last_fetch_s = now_s
        self._read_queue_tokens = [max(0.0, q - num_read_tokens) for q in self._read_queue_tokens]

    def _send(self, msg: object) -> None:
        self._count(msg)
        self.client.send(msg)

    def _count(self, msg: object) -> None:
        """Count every message; measure one GroupReport / Assignment in BYTES_SAMPLE_EVERY."""
        kind = type(msg).__name__
        count, sampled_bytes, num_sampled = self.messages.get(kind, (0, 0, 0))
        if isinstance(msg, GroupReport | Assignment) and count % BYTES_SAMPLE_EVERY == 0:
            sampled_bytes += len(encode(msg))
            num_sampled += 1
        self.messages[kind] = (count + 1, sampled_bytes, num_sampled)

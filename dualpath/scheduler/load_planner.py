"""The LoadPlanner: which side reads a request's hit KV from storage (SPEC §2, §6).

STYLE principle 2: the planner decides, the mover moves. A planner is pure: it gets the number
of hit Full Blocks, both nodes' SNIC queues and how many reads the scheduler planned before on
the same pair of nodes, and returns a ``LoadPlan``. The engine's traffic manager (or the
simulator's flows) executes the plan and reports back; the scheduler only adds the planned
tokens to its view of each node's ``read_q`` until the next report.

A node's SNIC queue is what its SNIC still has to move, in tokens: SPEC §6's ``read_q`` plus
``write_q``, the Full Blocks its DE has queued for persistence (SPEC §2). Counting the writes
is our extension (``ClusterView`` says why); a node that writes nothing (a PE node, or any node
once its writes are done) is compared by ``read_q`` alone, as SPEC §6 states.

Policies, by the name ``SchedulerConfig.read_path`` uses:

* ``"dual"`` -- SPEC §6: the whole request on the side whose node has the shorter queue in
  tokens (``read_q``, and ``write_q``: above); on a tie, the DE side.
* ``"split"`` -- our extension (SPEC §8): the hit blocks are divided so that both nodes' SNIC
  queues finish together, given each node's storage rate; the two finish times differ by at
  most one block's read time.
* ``"pe"`` / ``"de"`` -- always that side; ``"pe"`` is Basic's classic path.
* ``"round_robin"`` -- the load-oblivious baseline's choice (our reading of the paper's round
  robin, SPEC §7, the ablation's "+dual path" step): the whole request on the PE side, then
  the DE side, in turn, ignoring both queues. The turn counts the requests with a hit that the
  scheduler planned before on the same (PE node, DE node) pair (``ClusterView`` keeps the
  counts, the planner stays pure), so each pair splits its reads evenly between the two SNICs
  and no regular placement pattern (e.g. a DE group placing an even number of requests per
  fetch on alternating nodes) can put every DE-side turn on the same node. On 1P2D the PE
  node then reads half of the requests and each DE node a quarter (SNIC max/avg ~1.5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from dualpath.config import READ_PATHS


@dataclass(frozen=True, slots=True, init=False)
class LoadPlan:
    """How a request's hit Full Blocks are split between the two storage read paths.

    The leading blocks go through the PE node's SNIC, the rest through the DE node's SNIC::

        hit blocks: | 0 .. num_prefill_side_blocks-1 | .. num_hit_blocks-1 |
                      PE path: storage -> PE buffer    DE path: storage -> DE buffer -> PE GPU

    A whole-request plan has one count at zero. Block indices are positions in the request's
    hit prefix; the engine maps them to store handles.
    """

    num_prefill_side_blocks: int
    num_decode_side_blocks: int

    def __init__(self, num_prefill_side_blocks: int, num_decode_side_blocks: int) -> None:
        object.__setattr__(self, "num_prefill_side_blocks", num_prefill_side_blocks)
        object.__setattr__(self, "num_decode_side_blocks", num_decode_side_blocks)

    @property
    def num_hit_blocks(self) -> int:
        return self.num_prefill_side_blocks + self.num_decode_side_blocks

    @property
    def is_split(self) -> bool:
        return self.num_prefill_side_blocks > 0 and self.num_decode_side_blocks > 0


class LoadPlanner(Protocol):
    """Chooses the read side(s) of one request; pure, and may be called any number of times."""

    def plan(
        self,
        num_hit_blocks: int,
        prefill_queue_tokens: float,
        decode_queue_tokens: float,
        prefill_read_tokens_per_s: float,
        decode_read_tokens_per_s: float,
        *,
        num_earlier_plans: int,
    ) -> LoadPlan:
        """The plan for ``num_hit_blocks`` given each node's SNIC queue (tokens queued for
        storage reads and writes) and storage read rate.

        ``num_earlier_plans``: requests with a hit planned before this one on the same (PE
        node, DE node) pair; only the turn-taking ``"round_robin"`` planner reads it.
        """
        ...


class FixedSideLoadPlanner:
    """Every hit block through one side: the PE node (the classic path; Basic) or the DE node."""

    def __init__(self, *, on_prefill_side: bool) -> None:
        self.on_prefill_side = on_prefill_side
        self._plans = _WholeRequestPlans(on_prefill_side=on_prefill_side)

    def plan(
        self,
        num_hit_blocks: int,
        prefill_queue_tokens: float,
        decode_queue_tokens: float,
        prefill_read_tokens_per_s: float,
        decode_read_tokens_per_s: float,
        *,
        num_earlier_plans: int = 0,
    ) -> LoadPlan:
        return self._plans[num_hit_blocks]


class _WholeRequestPlanner:
    """A planner that puts a whole request on one side, chosen per request: the cached plans
    of both sides (``_WholeRequestPlans``)."""

    def __init__(self) -> None:
        self._plans_by_side = (
            _WholeRequestPlans(on_prefill_side=False),
            _WholeRequestPlans(on_prefill_side=True),
        )

    def _whole_request(self, num_hit_blocks: int, *, on_prefill_side: bool) -> LoadPlan:
        return self._plans_by_side[on_prefill_side][num_hit_blocks]


class ShorterQueueLoadPlanner(_WholeRequestPlanner):
    """SPEC §6: the whole request on the side with the shorter queue (``read_q``, plus
    ``write_q``: module docstring); tie -> DE side.

    The comparison is in tokens, as SPEC states it, even when the two nodes read at different
    rates; ``SplitLoadPlanner`` is the rate-aware policy.
    """

    def plan(
        self,
        num_hit_blocks: int,
        prefill_queue_tokens: float,
        decode_queue_tokens: float,
        prefill_read_tokens_per_s: float,
        decode_read_tokens_per_s: float,
        *,
        num_earlier_plans: int = 0,
    ) -> LoadPlan:
        return self._whole_request(
            num_hit_blocks, on_prefill_side=prefill_queue_tokens < decode_queue_tokens
        )


class SplitLoadPlanner:
    """Our extension: divide the hit blocks so both nodes' SNIC queues finish together.

    With k blocks on the PE side, b tokens per block, queues q and rates r, the queues finish at

        t_pe(k) = (q_pe + k*b) / r_pe        t_de(k) = (q_de + (n-k)*b) / r_de

    The real-valued k* that equalises them is rounded to the integer k in [0, n] that minimises
    max(t_pe, t_de); ties go to fewer PE-side blocks (the DE side, as in SPEC §6). When
    0 < k < n the two finish times then differ by at most one block's read time on the slower
    of the two nodes; when one queue is so long that even all n blocks on the other side finish
    first, every block goes to the other side.
    """

    def __init__(self, block_size_tokens: int) -> None:
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be > 0, got {block_size_tokens}")
        self._block_size_tokens = block_size_tokens

    def plan(
        self,
        num_hit_blocks: int,
        prefill_queue_tokens: float,
        decode_queue_tokens: float,
        prefill_read_tokens_per_s: float,
        decode_read_tokens_per_s: float,
        *,
        num_earlier_plans: int = 0,
    ) -> LoadPlan:
        n = num_hit_blocks
        if n == 0:
            return LoadPlan(0, 0)
        b = self._block_size_tokens
        q_pe, q_de = prefill_queue_tokens, decode_queue_tokens
        r_pe, r_de = prefill_read_tokens_per_s, decode_read_tokens_per_s
        k_real = (r_pe * (q_de + n * b) - r_de * q_pe) / (b * (r_pe + r_de))
        k_floor = min(max(math.floor(k_real), 0), n)
        # Float rounding can put k_real on the wrong side of an integer: compare floor(k*) and
        # its neighbours by their finish times (strict <, so a tie keeps the smaller k).
        best_k, best_finish_s = -1, math.inf
        for k in (k_floor - 1, k_floor, k_floor + 1):
            if 0 <= k <= n:
                finish_s = max((q_pe + k * b) / r_pe, (q_de + (n - k) * b) / r_de)
                if finish_s < best_finish_s:
                    best_k, best_finish_s = k, finish_s
        return LoadPlan(best_k, n - best_k)


class RoundRobinLoadPlanner(_WholeRequestPlanner):
    """The baseline's turn-taking choice: the whole request on the PE side on even turns, on
    the DE side on odd ones, whatever the queues (module docstring). Pure: the caller passes
    the turn."""

    def plan(
        self,
        num_hit_blocks: int,
        prefill_queue_tokens: float,
        decode_queue_tokens: float,
        prefill_read_tokens_per_s: float,
        decode_read_tokens_per_s: float,
        *,
        num_earlier_plans: int,
    ) -> LoadPlan:
        return self._whole_request(num_hit_blocks, on_prefill_side=num_earlier_plans % 2 == 0)


class _WholeRequestPlans(dict[int, LoadPlan]):
    """A planner's whole-request plans by number of hit blocks, built on first use.

    LoadPlan is immutable, so equal plans may be one object; building a frozen dataclass on
    every placement would cost about a microsecond. At most one entry per hit length.
    """

    def __init__(self, *, on_prefill_side: bool) -> None:
        super().__init__()
        self._on_prefill_side = on_prefill_side

    def __missing__(self, num_hit_blocks: int) -> LoadPlan:
        num_pe_blocks = num_hit_blocks if self._on_prefill_side else 0
        plan = LoadPlan(num_pe_blocks, num_hit_blocks - num_pe_blocks)
        self[num_hit_blocks] = plan
        return plan


def make_load_planner(read_path: str, *, block_size_tokens: int) -> LoadPlanner:
    """The planner ``SchedulerConfig.read_path`` names."""
    if read_path == "dual":
        return ShorterQueueLoadPlanner()
    if read_path == "split":
        return SplitLoadPlanner(block_size_tokens)
    if read_path == "pe":
        return FixedSideLoadPlanner(on_prefill_side=True)
    if read_path == "de":
        return FixedSideLoadPlanner(on_prefill_side=False)
    if read_path == "round_robin":
        return RoundRobinLoadPlanner()
    raise ValueError(f"read_path must be one of {READ_PATHS}, got {read_path!r}")

"""What a placement's one Assignment tells its engines of how they share the request, decided
from the engines' ``EngineInfo``s (``RequestLifecycle.assign``):

    pairing = Pairing(membership.engines, block_size=64, local_prefill_tokens=256)
    pe, plan = pairing.paired(pe, de, plan, num_prompt_tokens)  # the DE alone, or as placed
    pairing.is_prefill_held_sent(pe, plan)                      # the DE waits for PrefillHeld

**Conditional disaggregation.** A request the store misses by at most ``local_prefill_tokens``
(an agent's short append to its session) goes to its DE alone where the DE prefills
(``EngineInfo.prefills_locally``): prefilled where it decodes, it costs neither the PE's step
nor the whole prompt's KV sent to the DE, and the DE's vLLM often still holds the session's
earlier turns. Its hit blocks are all the DE side's; the scheduler's choice of PE is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping

from dualpath.cluster.membership import EngineState
from dualpath.protocol import DECODE
from dualpath.scheduler import LoadPlan


class Pairing:
    def __init__(
        self,
        engines: Mapping[int, EngineState],
        *,
        block_size: int,
        local_prefill_tokens: int = 0,
    ) -> None:
        """``engines``: the joined engines, by id (kept up to date by their owner)."""
        self.engines = engines
        self.block_size = block_size
        self.local_prefill_tokens = local_prefill_tokens
        self.num_local = 0  # requests sent to their DE alone

    def paired(
        self, pe: int, de: int, plan: LoadPlan, num_prompt_tokens: int
    ) -> tuple[int, LoadPlan]:
        """(PE, plan) of the Assignment: ``(de, every hit on the DE side)`` for a request its
        DE prefills itself, else ``(pe, plan)``."""
        if not self.local_prefill_tokens:
            return pe, plan
        num_missed = num_prompt_tokens - plan.num_hit_blocks * self.block_size
        engine = self.engines.get(de)
        if num_missed > self.local_prefill_tokens or engine is None:
            return pe, plan
        if not engine.info.prefills_locally:
            return pe, plan
        self.num_local += 1
        return de, LoadPlan(0, plan.num_hit_blocks)

    def is_prefill_held_sent(self, pe: int, plan: LoadPlan) -> bool:
        """Whether the DE's reads wait for the PE's ``PrefillHeld``: the PE says what its
        engine holds (its ``EngineInfo``) and the DE has blocks of its side to read (a DE that
        prefills the request itself looks its own engine's cache up)."""
        engine = self.engines.get(pe)
        if engine is None or engine.info.role == DECODE:
            return False
        return engine.info.reports_prefill_held and plan.num_decode_side_blocks > 0

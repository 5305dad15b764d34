"""What a workload replays, in SPEC §7's terms: turns, total, context, append and gen means.

Means are over sessions of a per-session quantity, as SPEC §7's table reads: a session's
append (gen) is its mean per turn, the first prompt counted as turn 1's append. Lengths come
from the replay rules, so the numbers hold for any workload, synthetic or trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dualpath.workload.types import Workload


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    num_sessions: int
    turns: float  # mean turns per session
    total_tokens: float  # mean final context: the last prompt plus the last output
    context_tokens: float  # mean over sessions of the mean prompt over their turns
    append_tokens: float  # mean over sessions of the mean tokens appended per turn
    gen_tokens: float  # mean over sessions of the mean tokens generated per turn
    max_total_tokens: int  # the longest session's final context
    # Σ tokens the previous turn's context (prompt and output) holds / Σ prompt tokens: the hit
    # ratio of an infinite cache that keeps generated KV and hits at any token.
    ideal_hit_ratio: float


def workload_stats(workload: Workload) -> WorkloadStats:
    turns, totals, contexts, appends, gens = [], [], [], [], []
    hit_tokens = prompt_tokens = 0
    for session in workload.sessions:
        prompts = session.prompt_lengths_tokens()
        outputs = [t.output_tokens for t in session.turns]
        turns.append(session.num_turns)
        totals.append(prompts[-1] + outputs[-1])
        contexts.append(np.mean(prompts))
        appends.append(np.mean([t.num_append_tokens for t in session.turns]))
        gens.append(np.mean(outputs))
        prompt_tokens += sum(prompts)
        for turn, previous_prompt, previous_output in zip(
            session.turns[1:], prompts, outputs, strict=False
        ):
            kept = turn.keep_prefix_tokens
            hit_tokens += previous_prompt + previous_output if kept is None else kept
    return WorkloadStats(
        num_sessions=workload.num_sessions,
        turns=float(np.mean(turns)),
        total_tokens=float(np.mean(totals)),
        context_tokens=float(np.mean(contexts)),
        append_tokens=float(np.mean(appends)),
        gen_tokens=float(np.mean(gens)),
        max_total_tokens=int(max(totals)),
        ideal_hit_ratio=hit_tokens / prompt_tokens,
    )

"""Agents as the simulator replays them: per turn a prompt length, a hit and an output length.

Built from ``dualpath.workload`` (unchanged): synthetic trajectories come from
``fit_trajectories`` (the same lengths ``generate_trajectories`` starts from for a seed,
without drawing token ids the simulator never reads), traces from any ``Workload``.

Hits (SPEC §2-§3): the store holds every full block of a turn's prompt and of its generated
tokens whose KV exists (the last generated token is never fed back, so it has none); a turn's
hit is the longest whole-block prefix of that, cut to the kept prefix of an edited trace turn
and below the prompt (at least one token is computed). Hits only occur within an agent, as
SPEC §7 replays them; a trace's sharing across sessions is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.kv.hashing import block_keys
from dualpath.workload import PRESETS, Workload, fit_trajectories


@dataclass(frozen=True, slots=True)
class AgentTrace:
    """One agent's turns; the i-th entries of the three tuples describe turn i."""

    agent_id: int
    arrival_s: float
    prompt_tokens: tuple[int, ...]
    hit_tokens: tuple[int, ...]  # whole Full Blocks, < prompt_tokens
    output_tokens: tuple[int, ...]  # >= 1

    @property
    def num_turns(self) -> int:
        return len(self.prompt_tokens)


def _hits(
    prompts: list[int], outputs: list[int], kept: list[int | None], block_size_tokens: int
) -> tuple[int, ...]:
    hits = [0]
    for i in range(1, len(prompts)):
        stored = prompts[i - 1] + outputs[i - 1] - 1  # tokens with KV after turn i-1
        if kept[i] is not None:
            stored = min(stored, kept[i])
        stored = min(stored, prompts[i] - 1)
        hits.append(max(0, stored) // block_size_tokens * block_size_tokens)
    return tuple(hits)


def synthetic_agents(
    preset: str,
    num_agents: int,
    *,
    seed: int,
    block_size_tokens: int,
    arrivals_s: list[float] | None = None,
) -> list[AgentTrace]:
    """``num_agents`` trajectories of a SPEC §7 preset ("32k", "48k", "64k"), all at t=0 unless
    ``arrivals_s`` is given."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    lengths, _ = fit_trajectories(PRESETS[preset], num_agents, seed=seed)
    agents = []
    for index, one in enumerate(lengths):
        appends = [int(a) for a in one.append_tokens]
        outputs = [int(g) for g in one.output_tokens]
        prompts = []
        context = 0
        for turn, append in enumerate(appends):
            context += append + (outputs[turn - 1] if turn else 0)
            prompts.append(context)
        hits = _hits(prompts, outputs, [None] * len(prompts), block_size_tokens)
        arrival_s = 0.0 if arrivals_s is None else float(arrivals_s[index])
        agents.append(AgentTrace(index, arrival_s, tuple(prompts), hits, tuple(outputs)))
    return agents


def workload_agents(workload: Workload, *, block_size_tokens: int) -> list[AgentTrace]:
    """Agents from any ``Workload`` (e.g. ``load_mooncake_trace``), sessions in order.

    Hits within a session follow the replay rule (``_hits``). Across sessions, as the store
    finds them by content (``kv.hashing``): a session's first prompt also hits the leading
    Full Blocks that the first prompts of sessions arriving before it hold (Mooncake's
    traces share prefixes between requests, e.g. one system prompt). Later turns hold the
    session's own generated tokens, which no other session's prompt can match."""
    first_hits = _first_prompt_hits(workload, block_size_tokens)
    agents = []
    for index, session in enumerate(workload.sessions):
        prompts = list(session.prompt_lengths_tokens())
        outputs = [turn.output_tokens for turn in session.turns]
        kept = [turn.keep_prefix_tokens for turn in session.turns]
        hits = (first_hits[index],) + _hits(prompts, outputs, kept, block_size_tokens)[1:]
        agents.append(AgentTrace(index, session.arrival_s, tuple(prompts), hits, tuple(outputs)))
    return agents


def _first_prompt_hits(workload: Workload, block_size_tokens: int) -> list[int]:
    """Per session, the tokens of its first prompt whose Full Blocks an earlier-arriving
    session's first prompt stored (ties in arrival: the order of ``workload.sessions``)."""
    fingerprint = "0" * 32  # one model: every key in one namespace
    stored: set[str] = set()
    hits = [0] * len(workload.sessions)
    order = sorted(range(len(workload.sessions)), key=lambda i: workload.sessions[i].arrival_s)
    for index in order:
        prompt = workload.sessions[index].first_prompt()
        keys = block_keys(prompt, block_size_tokens, fingerprint)
        num_hit_blocks = 0
        while num_hit_blocks < len(keys) and keys[num_hit_blocks] in stored:
            num_hit_blocks += 1
        # At least the prompt's last token is computed (its logits give the first token).
        last_full_block = (len(prompt) - 1) // block_size_tokens
        hits[index] = min(num_hit_blocks, last_full_block) * block_size_tokens
        stored.update(keys)
    return hits


def scaled_append_agents(
    preset: str, num_agents: int, append_factor: float, *, seed: int, block_size_tokens: int = 64
) -> list[AgentTrace]:
    """A preset's trajectories with every append after the first prompt multiplied by
    ``append_factor`` (SPEC §7's append-length scaling, Fig. 9); turns and outputs unchanged,
    so contexts grow past the preset's max length."""
    lengths, _ = fit_trajectories(PRESETS[preset], num_agents, seed=seed)
    agents = []
    for index, one in enumerate(lengths):
        appends = [int(a) for a in one.append_tokens]
        appends = appends[:1] + [max(1, round(a * append_factor)) for a in appends[1:]]
        outputs = [int(g) for g in one.output_tokens]
        prompts, context = [], 0
        for turn, append in enumerate(appends):
            context += append + (outputs[turn - 1] if turn else 0)
            prompts.append(context)
        hits = _hits(prompts, outputs, [None] * len(prompts), block_size_tokens)
        agents.append(AgentTrace(index, 0.0, tuple(prompts), hits, tuple(outputs)))
    return agents


def copied_agents(
    agents: list[AgentTrace], num_copies: int, *, arrival_step_s: float = 0.0
) -> list[AgentTrace]:
    """``num_copies`` copies of ``agents`` with fresh ids (SPEC §7: more trajectories are made
    by copying; copies are cache-disjoint, which hits within an agent already are). The
    copies keep every turn; SPEC's prepended 1-token synthetic first turn is left out. Copy
    c arrives ``c * arrival_step_s`` after the original (online arrivals interleave)."""
    return [
        AgentTrace(
            copy * len(agents) + a.agent_id,
            a.arrival_s + copy * arrival_step_s,
            a.prompt_tokens,
            a.hit_tokens,
            a.output_tokens,
        )  # fmt: skip
        for copy in range(num_copies)
        for a in agents
    ]

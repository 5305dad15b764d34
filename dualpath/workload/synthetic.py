"""Synthetic agent trajectories fitted to SPEC §7's table (32K/48K/64K), seeded and scalable.

    from dualpath.workload import PRESETS, generate_trajectories, workload_stats
    workload = generate_trajectories(PRESETS["64k"], 64, seed=0, vocab_size=32_000)
    print(workload_stats(workload))  # turns, total, context, append and gen means

**Reading the table.** Turns T, total S (a trajectory's final context) and context C (the mean
prompt over its turns) are means over trajectories; append a and gen g are means over
trajectories of a trajectory's per-turn mean, the first prompt counted as turn 1's append.
Since a trajectory's per-turn append + gen is S_j / T_j, the table implies
mean(S/T) = a + g, which is 1.6-1.7x mean(S) / mean(T) in all three rows: turn counts vary
widely, and long trajectories have shorter turns.

**Model.** Turn i of T has append a_i and output g_i; prompt_i = sum_{k<=i} a_k +
sum_{k<i} g_k; total = prompt_T + g_T; context = mean_i prompt_i. Per trajectory j:

1. Turns T_j = clip(round(c * exp(sigma_T * z_j)), 2, floor(S_j / m)), z_j ~ N(0, 1), c
   setting the sample mean to T (bisection). sigma_T is fitted (bisection) so that
   mean(S_j / T_j) = a + g. The cap says a turn holds at least m tokens on average (appends
   and outputs; ``TrajectoryTargets.min_tokens_per_turn``, 128): every one of the 37 real
   agent sessions in ``shared/traces/agentic_coding_dev.jsonl`` averages at least 131 (the
   median session ~1,200), while the uncapped lognormal's longest trajectory of 2,048 had
   3,196 turns of 17 tokens (5 generated), and an offline JCT is that one trajectory's tail.
   The cap binds on 1-5% of trajectories (32K-64K, 2,048 of them), the means still fit, and
   sigma_T rises a little to make up for the lost tail (64K: 0.74 -> 0.78).
2. Total S_j = M - (M - S) * w_j, w_j ~ Gamma(2) scaled to sample mean 1: the mean is S and
   no trajectory exceeds the max length M (clipped below at S / 4, which is rare).
3. First prompt p_j = f * rho_j * S_j, rho_j lognormal(0.3) with mean 1. As a prompt grows
   about linearly, context_j ~ (S_j + p_j) / 2, so p ~ 2C - S: a large first prompt (system
   prompt and task, ~6K-10K tokens). f is fitted (bisection) to the context C.
4. The rest R_j = S_j - p_j splits into outputs G_j = theta * R_j (theta sets mean(G/T) to g)
   and appends A_j = R_j - G_j, which gives mean append = mean(S/T) - mean(G/T) = a.
5. Appends a_2..a_T and outputs g_1..g_T share A_j and G_j by lognormal weights (sigma 1.0
   and 0.8: tool results are heavy-tailed), at least 1 token each, sums exact.

The fits are in-sample, so every set, even one trajectory, matches the targets up to rounding.
Then the scaling knobs, in order: ``turn_scale`` keeps the first ceil(T_j * turn_scale) turns,
``max_turns`` caps them, ``length_scale`` multiplies every length (rounded, >= 1 token) and the
last turns are dropped while the total exceeds floor(M * length_scale). The achieved
statistics (``stats.workload_stats``) are the honest record of what this leaves.

Token ids are random ordinary ids; outputs are only lengths (the model generates them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from dualpath.workload.tokens import allowed_token_ids, random_token_ids
from dualpath.workload.types import Session, Turn, Workload

_MIN_TURNS = 2  # an agent trajectory is multi-turn by definition
_TOTAL_GAMMA_SHAPE = 2.0  # totals spread below the max length (sd = (M - S) / sqrt(2))
_FIRST_PROMPT_SIGMA = 0.3  # tasks differ, system prompts less so
_APPEND_SIGMA = 1.0  # tool results: mostly short, sometimes a whole file
_OUTPUT_SIGMA = 0.8
_BISECTION_STEPS = 60


@dataclass(frozen=True, slots=True)
class TrajectoryTargets:
    """One row of SPEC §7's table: the per-trajectory means the generator fits."""

    max_total_tokens: int  # no trajectory's final context exceeds this
    num_turns: float
    append_tokens: float  # mean per turn, the first prompt included
    gen_tokens: float  # mean generated per turn
    total_tokens: float  # mean final context
    context_tokens: float  # mean prompt over a trajectory's turns
    # No trajectory averages fewer tokens (appends + outputs) per turn (module docstring).
    min_tokens_per_turn: int = 128

    def __post_init__(self) -> None:
        if self.num_turns < _MIN_TURNS:
            raise ValueError(f"num_turns must be >= {_MIN_TURNS}, got {self.num_turns}")
        if not 2 <= self.min_tokens_per_turn <= self.total_tokens / self.num_turns:
            raise ValueError(
                f"min_tokens_per_turn must be in [2, total_tokens / num_turns="
                f"{self.total_tokens / self.num_turns:g}], got {self.min_tokens_per_turn}"
            )
        if min(self.append_tokens, self.gen_tokens) < 1:
            raise ValueError(
                f"append_tokens and gen_tokens must be >= 1, got {self.append_tokens}, "
                f"{self.gen_tokens}"
            )
        if not 2 * self.num_turns <= self.total_tokens <= self.max_total_tokens:
            raise ValueError(
                f"total_tokens must be in [2 * num_turns, max_total_tokens="
                f"{self.max_total_tokens}], got {self.total_tokens}"
            )
        if not 0 < self.context_tokens < self.total_tokens:
            raise ValueError(
                f"context_tokens must be in (0, total_tokens={self.total_tokens}), "
                f"got {self.context_tokens}"
            )


PRESETS: dict[str, TrajectoryTargets] = {
    "32k": TrajectoryTargets(32_768, 60, 608, 148, 28_639, 17_183),
    "48k": TrajectoryTargets(49_152, 106, 474, 172, 42_607, 25_120),
    "64k": TrajectoryTargets(65_536, 157, 429, 176, 55_958, 32_721),
}


@dataclass(frozen=True, slots=True)
class TrajectoryFit:
    """The fitted model parameters (at length_scale 1, before any turn cut), for reports."""

    turns_sigma: float  # sigma_T of step 1
    first_prompt_fraction: float  # f of step 3: mean first prompt / total
    output_fraction: float  # theta of step 4: outputs / (total - first prompt)


@dataclass(frozen=True, slots=True, eq=False)
class TrajectoryLengths:
    """One trajectory's token counts, before token ids (a simulator may need no more)."""

    append_tokens: np.ndarray  # a_1 (the first prompt) .. a_T, int64
    output_tokens: np.ndarray  # g_1 .. g_T, int64


def generate_trajectories(
    targets: TrajectoryTargets,
    num_trajectories: int,
    *,
    seed: int,
    vocab_size: int,
    avoid_token_ids: Iterable[int] = (),
    length_scale: float = 1.0,
    turn_scale: float = 1.0,
    max_turns: int | None = None,
) -> Workload:
    """``num_trajectories`` distinct trajectories (all arriving at 0 s) fitted to ``targets``.

    Deterministic in ``seed``; draws no global random state. Append tokens are drawn from
    ``[0, vocab_size)`` minus ``avoid_token_ids``. To scale down for a small machine, cut
    lengths with ``length_scale`` and turns with ``turn_scale`` or ``max_turns``; ``ValueError``
    if a first turn no longer fits ``floor(max_total_tokens * length_scale)``.
    """
    if not 0 < length_scale <= 1 or not 0 < turn_scale <= 1:
        raise ValueError(
            f"length_scale and turn_scale must be in (0, 1], got {length_scale}, {turn_scale}"
        )
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    allowed = allowed_token_ids(vocab_size, avoid_token_ids)
    lengths, _ = fit_trajectories(targets, num_trajectories, seed=seed)
    token_seeds = np.random.SeedSequence(seed).spawn(2)[1].spawn(num_trajectories)
    max_total = math.floor(targets.max_total_tokens * length_scale)
    sessions = []
    for index, (one, token_seed) in enumerate(zip(lengths, token_seeds, strict=True)):
        keep = math.ceil(one.output_tokens.size * turn_scale)
        if max_turns is not None:
            keep = min(keep, max_turns)
        cut = TrajectoryLengths(one.append_tokens[:keep], one.output_tokens[:keep])
        scaled = _fit_max_total(_scale(cut, length_scale), max_total, index)
        rng = np.random.default_rng(token_seed)
        sessions.append(_make_session(f"trajectory-{index}", scaled, rng, allowed))
    source = (
        f"synthetic max={targets.max_total_tokens} x{num_trajectories} seed={seed} "
        f"length_scale={length_scale} turn_scale={turn_scale} max_turns={max_turns}"
    )
    return Workload(tuple(sessions), source)


def fit_trajectories(
    targets: TrajectoryTargets, num_trajectories: int, *, seed: int
) -> tuple[list[TrajectoryLengths], TrajectoryFit]:
    """Steps 1-5 of the module docstring at full scale: the lengths ``generate_trajectories``
    starts from (for the same seed), and the fitted parameters."""
    if num_trajectories < 1:
        raise ValueError(f"num_trajectories must be >= 1, got {num_trajectories}")
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[0])
    n, max_total = num_trajectories, targets.max_total_tokens
    turn_z = rng.standard_normal(n)
    spread = _mean_one(rng.gamma(_TOTAL_GAMMA_SHAPE, 1.0, n))
    totals = max_total - (max_total - targets.total_tokens) * spread
    totals = np.floor(np.clip(totals, targets.total_tokens / 4, max_total))
    first_weights = _mean_one(rng.lognormal(0.0, _FIRST_PROMPT_SIGMA, n))
    turns, turns_sigma = _fit_turns(targets, totals, turn_z)
    append_weights = [_mean_one(rng.lognormal(0.0, _APPEND_SIGMA, t - 1)) / (t - 1) for t in turns]
    output_weights = [_mean_one(rng.lognormal(0.0, _OUTPUT_SIGMA, t)) / t for t in turns]
    split = _FirstPromptSplit(targets, totals, turns, first_weights, append_weights, output_weights)
    fraction = _bisect(split.context_error, 0.0, 1.0)
    first, outputs, theta = split(fraction)
    lengths = []
    for j in range(n):
        total, t = int(totals[j]), int(turns[j])
        first_j = int(np.clip(round(first[j]), 1, total - (2 * t - 1)))
        outputs_j = int(np.clip(round(outputs[j]), t, total - first_j - (t - 1)))
        appends = _allocate_at_least_one(total - first_j - outputs_j, append_weights[j])
        lengths.append(
            TrajectoryLengths(
                np.concatenate([[first_j], appends]).astype(np.int64),
                _allocate_at_least_one(outputs_j, output_weights[j]),
            )
        )
    fit = TrajectoryFit(turns_sigma, float(np.mean(first / totals)), theta)
    return lengths, fit


def _fit_turns(
    targets: TrajectoryTargets, totals: np.ndarray, turn_z: np.ndarray
) -> tuple[np.ndarray, float]:
    """Step 1: turn counts whose mean is the target and mean(S/T) = append + gen, none with
    fewer than ``min_tokens_per_turn`` tokens a turn."""
    cap = np.maximum(_MIN_TURNS, totals // targets.min_tokens_per_turn)

    def turns_for(sigma: float) -> np.ndarray:
        raw = np.exp(sigma * turn_z)

        def turns_at(log_scale: float) -> np.ndarray:
            return np.clip(np.round(math.exp(log_scale) * raw), _MIN_TURNS, cap)

        # The mean is a step function of the scale: of the two ends the bisection leaves,
        # take the one whose mean is nearer the target.
        low, high = _bisect_bracket(
            lambda x: float(np.mean(turns_at(x))) - targets.num_turns,
            -math.log(raw.max()),
            math.log(float(cap.max())) - math.log(raw.min()),
        )
        return min(
            (turns_at(low), turns_at(high)),
            key=lambda t: abs(float(np.mean(t)) - targets.num_turns),
        )

    per_turn = targets.append_tokens + targets.gen_tokens
    sigma = _bisect(lambda s: float(np.mean(totals / turns_for(s))) - per_turn, 0.0, 3.0)
    return turns_for(sigma).astype(np.int64), sigma


class _FirstPromptSplit:
    """Steps 3-4 for a first-prompt fraction f, in real numbers, and the mean context they
    give (the integer lengths built from them differ by rounding only)."""

    def __init__(
        self,
        targets: TrajectoryTargets,
        totals: np.ndarray,
        turns: np.ndarray,
        first_weights: np.ndarray,
        append_weights: list[np.ndarray],
        output_weights: list[np.ndarray],
    ) -> None:
        self._targets = targets
        self._totals = totals
        self._turns = turns
        self._first_weights = first_weights
        # The share of a trajectory's appends (outputs) in its average prompt: prompt_i holds
        # a_2..a_i and g_1..g_(i-1).
        self._append_share = np.array([_prompt_share(w, 1) for w in append_weights])
        self._output_share = np.array([_prompt_share(w, 0) for w in output_weights])

    def __call__(self, fraction: float) -> tuple[np.ndarray, np.ndarray, float]:
        """First prompts, outputs (sums per trajectory) and theta."""
        totals, turns = self._totals, self._turns
        first = np.clip(fraction * self._first_weights * totals, 1, totals - (2 * turns - 1))
        rest = totals - first
        theta = self._targets.gen_tokens / float(np.mean(rest / turns))
        return first, np.clip(theta * rest, turns, rest - (turns - 1)), theta

    def context_error(self, fraction: float) -> float:
        first, outputs, _ = self(fraction)
        turns = self._turns
        appends = self._totals - first - outputs
        # Every append and output holds 1 token plus its weighted share of the rest.
        context = (
            first
            + (turns - 1)
            + (appends - (turns - 1)) * self._append_share
            + (outputs - turns) * self._output_share
        )
        return float(np.mean(context)) - self._targets.context_tokens


def _mean_one(values: np.ndarray) -> np.ndarray:
    return values / values.mean()


def _prompt_share(weights: np.ndarray, offset: int) -> float:
    """Mean over turns i = 1..T of the weight in prompt_i, for weights of turns offset+1..T
    (a weight of turn k is in prompt_i for i >= k + (1 - offset))."""
    t = weights.size + offset
    k = np.arange(1, weights.size + 1) + offset  # the turn each weight belongs to
    num_prompts_holding = t - k + offset  # appends: i >= k; outputs: i > k
    return float(np.sum(weights * num_prompts_holding) / t)


def _bisect(error: Callable[[float], float], low: float, high: float) -> float:
    """The root of an increasing ``error`` in [low, high], or the end nearer to it."""
    low, high = _bisect_bracket(error, low, high)
    return (low + high) / 2


def _bisect_bracket(
    error: Callable[[float], float], low: float, high: float
) -> tuple[float, float]:
    """``_bisect``'s last bracket: error(low) < 0 <= error(high), or both the end nearer the
    root when it is outside [low, high]."""
    if error(low) >= 0:
        return low, low
    if error(high) <= 0:
        return high, high
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        if error(middle) < 0:
            low = middle
        else:
            high = middle
    return low, high


def _allocate_at_least_one(total: int, weights: np.ndarray) -> np.ndarray:
    """``total`` split into ``weights.size`` ints >= 1, in proportion to the weights beyond
    the first token each; largest remainders get the leftover units, so the sum is exact."""
    spare = total - weights.size
    assert spare >= 0, f"{total} tokens cannot give {weights.size} parts a token each"
    exact = spare * weights / weights.sum()
    parts = np.floor(exact).astype(np.int64)
    leftover = spare - int(parts.sum())
    parts[np.argsort(parts - exact, kind="stable")[:leftover]] += 1
    return parts + 1


def _scale(lengths: TrajectoryLengths, length_scale: float) -> TrajectoryLengths:
    if length_scale == 1.0:
        return lengths
    return TrajectoryLengths(
        np.maximum(1, np.round(lengths.append_tokens * length_scale)).astype(np.int64),
        np.maximum(1, np.round(lengths.output_tokens * length_scale)).astype(np.int64),
    )


def _fit_max_total(
    lengths: TrajectoryLengths, max_total_tokens: int, index: int
) -> TrajectoryLengths:
    """Drop the last turns while the total exceeds the max (rounding up to 1 token per turn
    can push a scaled-down trajectory over it)."""
    totals = np.cumsum(lengths.append_tokens + lengths.output_tokens)
    keep = int(np.searchsorted(totals, max_total_tokens, side="right"))
    if keep == 0:
        raise ValueError(
            f"trajectory {index}: its first turn ({int(totals[0])} tokens) exceeds the scaled "
            f"max length {max_total_tokens}; raise length_scale"
        )
    return TrajectoryLengths(lengths.append_tokens[:keep], lengths.output_tokens[:keep])


def _make_session(
    session_id: str, lengths: TrajectoryLengths, rng: np.random.Generator, allowed: np.ndarray
) -> Session:
    tokens = random_token_ids(rng, int(lengths.append_tokens.sum()), allowed)
    tokens.flags.writeable = False  # the appends are views of it: no copy per turn
    appends = np.split(tokens, np.cumsum(lengths.append_tokens)[:-1])
    turns = tuple(
        Turn(append, int(output))
        for append, output in zip(appends, lengths.output_tokens, strict=True)
    )
    return Session(session_id, 0.0, turns)

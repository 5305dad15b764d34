"""SPEC §7's experiments on the simulator: runs, a table beside the paper's figure, checks.

    dualpath simulate --experiment offline-jct --json out.json --png out.png

Each experiment is a list of ``RunSpec``s plus checks computed from the runs only (so every
``ours`` can be recomputed from the JSON's ``runs``). ``scale_down`` K makes every cluster's
nodes K times smaller (and the agents K times fewer); ``full`` runs the paper's whole grid.
Checks compare with SPEC §7's printed figures. One number was fitted (``calibration.py``):
``prefill_efficiency`` to Table 3's 2P4D JCT; the check against that figure says
``fitted``, every other check is a prediction.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dualpath.config import parse_node_shape
from dualpath.sim.calibration import CALIBRATION_TARGET_JCT_S
from dualpath.sim.metrics import ttfts_and_tpots
from dualpath.sim.runner import BLOCK_SIZE_TOKENS, RunResult, RunSpec, map_runs, run_simulation

if TYPE_CHECKING:
    from dualpath.sim.online import OnlineProbe
    from dualpath.sim.profiles import HardwareProfile, ModelProfile

logger = logging.getLogger(__name__)

V32 = "deepseek-v3.2-660b"
MAX_LEN_BY_PRESET = {"32k": 32_768, "48k": 49_152, "64k": 65_536}


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    paper: float  # exactly as SPEC §7 prints it (percentages in percent)
    ours: float
    tolerance: float  # absolute, in the paper's unit
    fitted: bool = False  # True only for the calibration target

    @property
    def ok(self) -> bool:
        return abs(self.ours - self.paper) <= self.tolerance

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "paper": self.paper,
            "ours": round(self.ours, 4),
            "tolerance": self.tolerance,
            "ok": self.ok,
            "fitted": self.fitted,
        }


@dataclass
class ExperimentResult:
    name: str
    runs: list[dict] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    table: list[str] = field(default_factory=list)
    num_events: int = 0
    sim_wall_s: float = 0.0


def latency_percentiles(result: RunResult) -> dict[str, dict[str, float | None]]:
    """TTFT (submit -> first token) and TPOT (per output token after the first) over the
    run's finished requests, as ``dualpath bench`` reports them (p50 / p90 / p99, seconds)."""
    from dualpath.bench.stats import percentiles

    ttfts, tpots = ttfts_and_tpots(result.records)
    rounded = {}
    for name, values in (("ttft_s", ttfts), ("tpot_s", tpots)):
        rounded[name] = {
            q: None if v is None else round(v, 6) for q, v in percentiles(values).items()
        }
    return rounded


def _rounded(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)  # nan (nothing measured): None


def run_record(experiment: str, result: RunResult, capacity_aps: float | None = None) -> dict:
    spec = result.spec
    return {
        "experiment": experiment,
        "model": spec.model_name,
        "nodes": spec.nodes,
        "agents": max(1, spec.num_agents // spec.scale_down),
        "max_len": MAX_LEN_BY_PRESET.get(spec.preset, spec.preset),
        "mode": spec.mode if spec.scheduler is None else f"{spec.mode}[{spec.scheduler}]",
        "jct_s": round(result.jct_s, 3),
        "snic_load_balance": _rounded(result.snic_load_balance),
        "attention_balance": _rounded(result.attention_balance),
        "capacity_aps": capacity_aps,
        "scale_down": spec.scale_down,
        "quota_per_forward": spec.quota_per_forward,
        "seed": spec.seed,
        "num_requests": result.num_requests,
        **latency_percentiles(result),
        "wall_s": round(result.wall_s, 3),
        "events_per_s": round(result.events_per_s),
    }


# An online capacity search: ``online.find_capacity``'s (spec, start_aps, window_s, copies).
Search = tuple[RunSpec, float, float, int]


@dataclass
class _Shared:
    """What the experiments of one command share: each run and each search is made once."""

    # Keyed by the spec and its agents: ``RunSpec.agents`` is left out of the spec's
    # equality, so two specs with different given workloads compare equal.
    runs: dict[tuple[RunSpec, object], RunResult] = field(default_factory=dict)
    searches: dict[Search, list[OnlineProbe]] = field(default_factory=dict)


class _Runner:
    """Runs specs once each (memoised) and records them for the JSON.

    With ``jobs`` > 1, ``prefetch`` runs an experiment's independent specs ahead in that many
    worker processes (``runner.map_runs``) and ``find_capacities`` spreads online searches
    the same way; a run is recorded when the experiment asks for it, so the JSON's runs,
    their order and every check are those of one run at a time. ``shared`` by several
    runners (``run_experiments``) makes a run or a search once for all of them; each
    experiment still records it among its own runs."""

    def __init__(
        self,
        experiment: ExperimentResult,
        on_run: Callable[[dict], None] | None,
        *,
        quota_per_forward: bool = False,
        seed: int = 0,
        progress: bool = False,
        jobs: int = 1,
        shared: _Shared | None = None,
    ):
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {jobs}")
        self._experiment = experiment
        self._quota_per_forward = quota_per_forward
        self.seed = seed  # the workload seed of every run (explicit workloads read it too)
        self._progress = progress  # a bar per run (one bar over the runs with jobs > 1)
        self._jobs = jobs
        shared = _Shared() if shared is None else shared
        self._results = shared.runs
        self._searches = shared.searches
        self._recorded: set[tuple[RunSpec, object]] = set()  # in this experiment's runs
        self._on_run = on_run

    def adjust(self, spec: RunSpec) -> RunSpec:
        """The spec as this experiment runs it: on its workload seed and, with the quota read
        per forward, that reading and (``factors=None``) its own fitted factors."""
        if spec.seed != self.seed:
            spec = replace(spec, seed=self.seed)
        if not self._quota_per_forward or spec.quota_per_forward:
            return spec
        return replace(spec, quota_per_forward=True, factors=None)

    def __call__(self, spec: RunSpec, **labels: object) -> RunResult:
        """``labels`` go into the run's JSON record (e.g. what a given workload is)."""
        spec = self.adjust(spec)
        key = (spec, spec.agents)
        result = self._results.get(key)
        if result is None:
            result = run_simulation(spec, progress=self._progress)
            self._results[key] = result
        if key not in self._recorded:
            self._recorded.add(key)
            self.add(run_record(self._experiment.name, result) | labels, result)
        return result

    def prefetch(self, work: Iterable[RunSpec | Search]) -> None:
        """Make runs (specs) and online searches ahead, ``jobs`` at a time, in the order
        given (the longest first is best); nothing to do with one job."""
        if self._jobs > 1:
            self._make(work)

    def find_capacities(self, searches: Sequence[Search]) -> list[list[OnlineProbe]]:
        """``online.find_capacity`` for each search, ``jobs`` at a time; a search made
        before (``prefetch``, or another experiment of the command) is not made again."""
        self._make(searches)
        return [self._searches[search] for search in searches]

    def _make(self, work: Iterable[RunSpec | Search]) -> None:
        """The runs and searches of ``work`` not made yet, ``jobs`` at a time, kept for every
        runner that shares them (not recorded: a run is when the experiment asks for it)."""
        runs: dict[tuple[RunSpec, object], RunSpec] = {}
        searches: dict[Search, Search] = {}
        for item in work:
            if isinstance(item, RunSpec):
                spec = self.adjust(item)
                if (spec, spec.agents) not in self._results:
                    runs[spec, spec.agents] = spec
            elif item not in self._searches:
                searches[item] = item
        calls = [(item,) for item in [*runs.values(), *searches.values()]]
        results = map_runs(_run_or_search, calls, jobs=self._jobs, progress=self._progress)
        self._results.update(zip(runs, results[: len(runs)], strict=True))
        self._searches.update(zip(searches, results[len(runs) :], strict=True))

    @property
    def experiment_name(self) -> str:
        return self._experiment.name

    def add(self, record: dict, result: RunResult | OnlineProbe) -> None:
        """A finished run's (or online probe's) record, for the JSON and ``on_run``."""
        self._experiment.runs.append(record)
        self._experiment.num_events += result.num_events
        self._experiment.sim_wall_s += result.wall_s
        if self._on_run is not None:
            self._on_run(record)


def _run_or_search(
    work: RunSpec | Search, *, progress: bool = False
) -> RunResult | list[OnlineProbe]:
    """A run or an online search (``_Runner.prefetch``'s work in a worker process)."""
    from dualpath.sim import online

    if isinstance(work, RunSpec):
        return run_simulation(work, progress=progress)
    return online.find_capacity(*work, progress=progress)


def _offline_jct(run: _Runner, result: ExperimentResult, k: int, full: bool) -> None:
    grid = [(V32, "2P4D", n, "64k") for n in (1024, 2048)]
    if full:
        grid = [(V32, "2P4D", n, p) for p in ("32k", "48k", "64k") for n in (512, 1024, 2048)]
        grid += [("27b", "1P1D", n, p) for p in ("32k", "48k", "64k") for n in (512, 1024, 2048)]
    result.table.append(
        "model nodes agents max_len | basic_s dualpath_s oracle_s | x_basic dp/oracle"
    )
    modes = ("basic", "dualpath", "oracle")
    specs = {
        (model, nodes, n, preset, mode): RunSpec(
            model=model, nodes=nodes, num_agents=n, preset=preset, mode=mode, scale_down=k
        )
        for model, nodes, n, preset in grid
        for mode in modes
    }
    run.prefetch(specs.values())
    for model, nodes, n, preset in grid:
        jct = {mode: run(specs[model, nodes, n, preset, mode]).jct_s for mode in modes}
        speedup = jct["basic"] / jct["dualpath"]
        over_oracle = jct["dualpath"] / jct["oracle"]
        result.table.append(
            f"{model} {nodes} {n // k} {preset} | {jct['basic']:.0f} {jct['dualpath']:.0f} "
            f"{jct['oracle']:.0f} | {speedup:.2f}x {over_oracle:.2f}"
        )
        if (model, nodes, n, preset) == (V32, "2P4D", 2048, "64k"):
            if k == 1:
                result.checks.append(_calibration_check(jct["dualpath"]))
            result.checks.append(
                Check("offline_660b_2p4d_64k_2048_dualpath_over_basic", 1.87, speedup, 0.187)
            )
            # SPEC: "close to Oracle"; the issue asks for DualPath within 10% of Oracle.
            result.checks.append(
                Check("offline_660b_2p4d_64k_2048_jct_dualpath_over_oracle", 1.0, over_oracle, 0.10)
            )
    result.table.append("paper (Fig. 7): up to 1.87x faster than Basic, close to Oracle")


def _calibration_check(jct_s: float) -> Check:
    """Table 3's 2P4D JCT: the target ``prefill_efficiency`` was fitted to (not a prediction)."""
    return Check(
        "offline_660b_2p4d_64k_2048_dualpath_jct_s",
        CALIBRATION_TARGET_JCT_S,
        jct_s,
        round(0.01 * CALIBRATION_TARGET_JCT_S, 1),  # the fit holds to about 1%
        fitted=True,
    )


def _ablation(run: _Runner, result: ExperimentResult, k: int, full: bool) -> None:
    base = RunSpec(model=V32, nodes="2P4D", num_agents=2048, preset="64k", scale_down=k)
    modes = ("basic", "layerwise", "layerwise+dual", "dualpath")
    run.prefetch(replace(base, mode=mode) for mode in modes)
    jct = {mode: run(replace(base, mode=mode)).jct_s for mode in modes}
    paper = {"layerwise": 17.21, "layerwise+dual": 38.19, "dualpath": 45.62}
    result.table.append("step | JCT s | reduction vs basic % | paper %")
    result.table.append(f"basic | {jct['basic']:.0f} | 0 | 0")
    for mode, paper_pct in paper.items():
        ours = 100 * (1 - jct[mode] / jct["basic"])
        result.table.append(f"{mode} | {jct[mode]:.0f} | {ours:.2f} | {paper_pct}")
        result.checks.append(Check(f"ablation_{mode}_jct_reduction_pct", paper_pct, ours, 5.0))


def _snic_balance(run: _Runner, result: ExperimentResult, k: int, full: bool) -> None:
    base = RunSpec(model="27b", nodes="1P2D", num_agents=1024, preset="48k", scale_down=k)
    run.prefetch(replace(base, mode=mode) for mode in ("dualpath", "layerwise+dual"))
    ours = run(replace(base, mode="dualpath"))
    round_robin = run(replace(base, mode="layerwise+dual"))
    result.table.append("scheduler | SNIC max/avg | paper | attention max/avg, first 5% | paper")
    result.table.append(
        f"dualpath | {ours.snic_load_balance:.3f} | 1.18 | {ours.attention_balance:.3f} | 1.06"
    )
    result.table.append(
        f"round robin (layerwise+dual) | {round_robin.snic_load_balance:.3f} | 1.53 | "
        f"{round_robin.attention_balance:.3f} | -"
    )
    result.checks.append(Check("snic_balance_scheduler", 1.18, ours.snic_load_balance, 0.1))
    result.checks.append(
        Check("snic_balance_round_robin", 1.53, round_robin.snic_load_balance, 0.1)
    )
    # SPEC §7 does not say which run its attention balance comes from; we read it as this
    # one's (Fig. 13). A PE group of one GPU (--scale-down 8) has none: no check then.
    if not math.isnan(ours.attention_balance):
        result.checks.append(
            Check("attention_balance_scheduler", 1.06, ours.attention_balance, 0.1)
        )


def _pd_ratio(run: _Runner, result: ExperimentResult, k: int, full: bool) -> None:
    shapes = ("1P1D", "2P1D", "1P2D")
    agents = (512, 1024, 2048) if full else (1024,)
    result.table.append("nodes agents | basic_s dualpath_s | speedup")
    grid = [
        RunSpec(model="27b", nodes=nodes, num_agents=n, preset="64k", scale_down=k)
        for nodes in shapes
        for n in agents
    ]
    run.prefetch(replace(spec, mode=mode) for spec in grid for mode in ("basic", "dualpath"))
    speedups = []
    for spec in grid:
        basic = run(replace(spec, mode="basic")).jct_s
        dual = run(replace(spec, mode="dualpath")).jct_s
        speedups.append(basic / dual)
        result.table.append(
            f"{spec.nodes} {spec.num_agents // k} | {basic:.0f} {dual:.0f} | {basic / dual:.2f}x"
        )
    mean = sum(speedups) / len(speedups)
    result.table.append(f"average {mean:.2f}x (paper 1.64x average, up to 2.46x)")
    result.checks.append(Check("pd_ratio_mean_speedup", 1.64, mean, round(0.15 * 1.64, 4)))


def _scale(run: _Runner, result: ExperimentResult, k: int, full: bool) -> None:
    from dualpath.sim.agents import copied_agents, synthetic_agents

    big_nodes, big_agents = ("48P96D", 49_152) if full else ("8P16D", 8192)
    small_spec = RunSpec(model=V32, nodes="2P4D", num_agents=2048, preset="64k", scale_down=k)
    # SPEC §7: more agents are copies of the same trajectories, so the big run replays the
    # small run's agents 24 (or 4) times instead of drawing a longer tail of fresh ones.
    base = synthetic_agents("64k", 2048 // k, seed=run.seed, block_size_tokens=BLOCK_SIZE_TOKENS)
    big_spec = RunSpec(
        model=V32,
        nodes=big_nodes,
        num_agents=big_agents,
        preset="64k",
        scale_down=k,
        agents=tuple(copied_agents(base, big_agents // 2048)),
    )
    online_searches = _online_scale_searches(run, k, full)
    # The long ones first: the big cluster's offline run and online search.
    run.prefetch((big_spec, online_searches[1], small_spec, online_searches[0]))
    small = run(small_spec)
    big = run(big_spec, copies_of_2p4d_agents=big_agents // 2048)
    ratio = big.jct_s / small.jct_s
    if k == 1:
        result.checks.append(_calibration_check(small.jct_s))
    result.table.append(
        f"2P4D {2048 // k} agents: {small.jct_s:.0f} s; {big_nodes} "
        f"{big_agents // k} agents: {big.jct_s:.0f} s; ratio {ratio:.3f}"
    )
    for name, r in (("2P4D", small), (big_nodes, big)):
        result.table.append(
            f"speed {name}: {r.num_requests} requests, {r.num_events} events in {r.wall_s:.1f} s "
            f"({r.events_per_s:.0f} events/s)"
        )
    result.table.append("paper (Table 3): 48P96D 3,201 s vs 2P4D 3,167 s")
    # The paper's ratio 3201/3167; the issue asks for within 5%.
    result.checks.append(
        Check(f"scale_{big_nodes.lower()}_over_2p4d_jct", round(3201 / 3167, 4), ratio, 0.05)
    )
    _online_scale(run, result, online_searches)


def _online_scale_searches(run: _Runner, k: int, full: bool) -> tuple[Search, Search]:
    """SPEC §7: online, 44P88D holds 22x 2P4D's load. DualPath's capacity searches on the
    660B, 64K, at 2P4D (online-capacity's) and on the big shape (44P88D, 8P16D by default),
    whose probes replay copies of 2P4D's probes (``online.run_probe``): the same agents and
    arrivals, so the big cluster sees exactly ``copies`` times the load."""
    big_nodes = "44P88D" if full else "8P16D"
    copies = parse_node_shape(big_nodes)[0] // 2
    base = RunSpec(model=V32, nodes="2P4D", num_agents=1024, preset="64k", scale_down=k)
    small = _search(run, run.adjust(base), "dualpath")
    spec, start_aps, window_s, _ = small
    return small, (replace(spec, nodes=big_nodes), copies * start_aps, window_s, copies)


def _online_scale(run: _Runner, result: ExperimentResult, searches: tuple[Search, Search]) -> None:
    """The online scale check, from ``_online_scale_searches``' searches."""
    small, big = searches
    big_nodes, copies = big[0].nodes, big[3]
    small_probes, big_probes = run.find_capacities([small, big])
    small_aps = _record_search(run, small, small_probes)
    big_aps = _record_search(run, big, big_probes, copies_of_2p4d_agents=copies)
    ratio = big_aps / small_aps if small_aps else float("inf")
    for nodes, aps, probes in (("2P4D", small_aps, small_probes), (big_nodes, big_aps, big_probes)):
        shown = _probes_shown(probes, with_tpot=False)
        result.table.append(f"online {nodes} dualpath: capacity {aps:.4g} APS | {shown}")
    result.table.append(
        f"online {big_nodes} / 2P4D capacity: {ratio:.2f}x "
        f"(paper: 44P88D = 22x of 2P4D, i.e. {copies}x at {big_nodes})"
    )
    # 44P88D: SPEC's 22x. 8P16D: the same linear scaling (22 of 22 copies), i.e. 4x. Each
    # search brackets its capacity within 5%, so the ratio within 10%.
    paper = 22.0 if big_nodes == "44P88D" else float(copies)
    result.checks.append(
        Check(f"scale_online_{big_nodes.lower()}_over_2p4d_capacity", paper, ratio, 0.1 * paper)
    )


def _append_scaling(run: _Runner, result: ExperimentResult, k: int, full: bool) -> None:
    from dualpath.sim.agents import scaled_append_agents

    result.table.append("append x | basic_s dualpath_s | speedup (paper 1.82-1.99x)")
    specs = {
        factor: RunSpec(
            model=V32,
            nodes="2P4D",
            num_agents=2048,
            preset="64k",
            scale_down=k,
            agents=tuple(scaled_append_agents("64k", 2048 // k, factor, seed=run.seed)),
        )
        for factor in ((1, 2, 3) if full else (1, 3))
    }
    run.prefetch(replace(s, mode=m) for s in specs.values() for m in ("basic", "dualpath"))
    for factor, spec in specs.items():
        basic = run(replace(spec, mode="basic"), append_factor=factor).jct_s
        dual = run(replace(spec, mode="dualpath"), append_factor=factor).jct_s
        result.table.append(f"x{factor} | {basic:.0f} {dual:.0f} | {basic / dual:.2f}x")


def _online_capacity(run: _Runner, result: ExperimentResult, k: int, full: bool) -> None:
    """Fig. 10: capacity under the SLO (``online.py``) of Basic and DualPath, as a ratio."""
    from dualpath.sim import online

    configs = ((V32, "2P4D", 2.25), ("27b", "1P1D", 1.67))
    modes = ("basic", "dualpath")
    bases = {
        model: run.adjust(
            RunSpec(model=model, nodes=nodes, num_agents=1024, preset="64k", scale_down=k)
        )
        for model, nodes, _ in configs
    }
    # Unloaded lifetime: a few agents alone on the cluster (DualPath); the offline runs'
    # throughput starts each search.
    run.prefetch(
        spec
        for base in bases.values()
        for spec in (replace(base, num_agents=4 * k), *(replace(base, mode=m) for m in modes))
    )
    searches = {
        (model, mode): _search(run, base, mode) for model, base in bases.items() for mode in modes
    }
    found = dict(zip(searches, run.find_capacities(list(searches.values())), strict=True))

    result.table.append("model nodes | mode | capacity APS | probes (aps: p90 TTFT s / TPOT ms)")
    for model, nodes, paper in configs:
        capacity = {}
        for mode in modes:
            probes = found[model, mode]
            capacity[mode] = _record_search(run, searches[model, mode], probes)
            shown = _probes_shown(probes, with_tpot=True)
            result.table.append(f"{model} {nodes} | {mode} | {capacity[mode]:.4g} | {shown}")
        ratio = capacity["dualpath"] / capacity["basic"] if capacity["basic"] else float("inf")
        result.table.append(f"{model} {nodes}: DualPath / Basic {ratio:.2f}x (paper {paper}x)")
        name = "660b" if model == V32 else model
        result.checks.append(
            Check(
                f"online_capacity_{name}_dualpath_over_basic", paper, ratio, round(0.15 * paper, 4)
            )
        )
    result.table.append(
        f"SLO TTFT <= {online.SLO_TTFT_S} s, TPOT <= {1e3 * online.SLO_TPOT_S:.0f} ms, p90 over "
        f"the window's second half; window {online.WINDOW_AGENT_LIFETIMES:g} lifetimes at "
        "the SLO's pace (dualpath/sim/online.py)"
    )


def _search(run: _Runner, base: RunSpec, mode: str) -> Search:
    """The capacity search of ``mode`` on ``base``'s cluster and workload: its window from
    the unloaded lifetime (a few agents alone, DualPath), its start at half the throughput
    of an offline run of ``base``'s agents (both runs recorded)."""
    from dualpath.sim import online

    k = base.scale_down
    few = replace(base, num_agents=4 * k)
    if base.agents is not None:  # given agents: the first few alone
        few = replace(few, agents=base.agents[:4])
    run.prefetch((replace(base, mode=mode), few))
    alone = run(few)
    num_turns = max(r.turn_index for r in alone.records) + 1
    window_s = online.window_s(alone.jct_s, num_turns)
    spec = replace(base, mode=mode)
    num_agents = base.num_agents // k if base.agents is None else len(base.agents)
    start_aps = 0.5 * num_agents / run(spec).jct_s
    return spec, start_aps, window_s, 1


def _probes_shown(probes: list[OnlineProbe], *, with_tpot: bool) -> str:
    """A search's probes for a table: APS, + attained or - not, p90 TTFT s (/ TPOT ms)."""
    return ", ".join(
        f"{p.aps:.4g}{'+' if p.is_attained else '-'}: {p.p90_ttft_s:.2f}"
        + (f"/{1e3 * p.p90_tpot_s:.0f}" if with_tpot else "")
        for p in probes
    )


def _record_search(
    run: _Runner, search: Search, probes: list[OnlineProbe], **labels: object
) -> float:
    """Records a search's probes (each with the capacity found); returns that capacity."""
    from dualpath.sim import online

    spec, _, window_s, _ = search
    capacity = online.capacity_aps(probes)
    for probe in probes:
        record = _probe_record(run.experiment_name, spec, probe, capacity, window_s)
        run.add(record | labels, probe)
    return capacity


def _significant(value: float) -> float:
    """Six significant digits (an APS can be small: rounding to decimals would lose the
    precision the capacity ratio is recomputed with)."""
    return float(f"{value:.6g}")


def _probe_record(
    experiment: str, spec: RunSpec, probe: OnlineProbe, capacity: float, window_s: float
) -> dict:
    return {
        "experiment": experiment,
        "model": spec.model_name,
        "nodes": spec.nodes,
        "agents": probe.num_agents,
        "max_len": MAX_LEN_BY_PRESET[spec.preset],
        "mode": spec.mode,
        "jct_s": None,
        "snic_load_balance": None,
        "attention_balance": None,
        "capacity_aps": _significant(capacity),
        "scale_down": spec.scale_down,
        "quota_per_forward": spec.quota_per_forward,
        "seed": spec.seed,
        "aps": _significant(probe.aps),
        "window_s": round(window_s, 1),
        "slo_attained": probe.is_attained,
        "p90_ttft_s": round(probe.p90_ttft_s, 4),
        "p90_tpot_s": round(probe.p90_tpot_s, 5),
        "num_requests": probe.num_requests,
        "wall_s": round(probe.wall_s, 3),
        "events_per_s": round(probe.num_events / probe.wall_s) if probe.wall_s else None,
    }


# In SPEC §7's order (``--experiment all`` runs them so).
EXPERIMENTS: dict[str, Callable[[_Runner, ExperimentResult, int, bool], None]] = {
    "offline-jct": _offline_jct,
    "ablation": _ablation,
    "snic-balance": _snic_balance,
    "pd-ratio": _pd_ratio,
    "online-capacity": _online_capacity,
    "scale": _scale,
    "append-scaling": _append_scaling,
}


def run_experiment(name: str, **options: Any) -> ExperimentResult:
    """One experiment of ``EXPERIMENTS``; ``options`` as for ``run_experiments``."""
    (result,) = run_experiments([name], **options)
    return result


def run_experiments(
    names: Sequence[str],
    *,
    scale_down: int = 1,
    full: bool = False,
    quota_per_forward: bool = False,
    seed: int = 0,
    on_run: Callable[[dict], None] | None = None,
    progress: bool = False,
    jobs: int = 1,
) -> list[ExperimentResult]:
    """The experiments ``names`` of ``EXPERIMENTS`` (``ValueError`` for an unknown one), in
    order, sharing runs: a spec two of them use (the 2P4D 2,048-agent runs of offline-jct,
    ablation and scale) is simulated once and recorded in both. ``quota_per_forward`` runs
    every spec with SPEC §6's quota read as a whole forward and that reading's fitted
    factors; ``seed`` is every run's workload seed (the checks were made on 0, the fitted one
    fitted on it); ``on_run`` gets each run's record as it is recorded; ``progress`` shows progress
    bars on stderr; ``jobs`` > 1 runs independent simulations that many at a time in worker
    processes (the same result as one at a time)."""
    unknown = [name for name in names if name not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment {unknown[0]!r}; choose from {', '.join(EXPERIMENTS)}")
    shared = _Shared()
    results = []
    for name in names:
        result = ExperimentResult(name)
        runner = _Runner(
            result,
            on_run,
            quota_per_forward=quota_per_forward,
            seed=seed,
            progress=progress,
            jobs=jobs,
            shared=shared,
        )
        EXPERIMENTS[name](runner, result, scale_down, full)
        results.append(result)
    return results


def free_form(
    *,
    model: str | ModelProfile,
    nodes: str,
    num_agents: int,
    preset: str,
    modes: list[str],
    scale_down: int = 1,
    seed: int = 0,
    agents=None,
    hardware: str | HardwareProfile = "hopper-8x400",
    read_path: str | None = None,
    frontend_requests_per_s: float | None = None,
    attention_quota_s: float | None = None,
    quota_per_forward: bool = False,
    online: bool = False,
    on_run: Callable[[dict], None] | None = None,
    progress: bool = False,
    jobs: int = 1,
) -> ExperimentResult:
    """Runs of the given modes on one configuration (generated workload or given agents);
    ``model`` and ``hardware`` are built-in names or profiles (``profiles.resolve_*``);
    ``read_path`` forces every mode's read side (e.g. "split"), ``frontend_requests_per_s``
    the front end's admission rate, ``attention_quota_s`` the PE compute quota;
    ``online``: also each mode's capacity under SPEC §7's SLO (``online.py``, searched as in
    the online-capacity experiment; given agents are drawn round robin); ``quota_per_forward``,
    ``on_run``, ``progress`` and ``jobs`` as in ``run_experiments``."""
    parse_node_shape(nodes)
    result = ExperimentResult("free-form")
    run = _Runner(result, on_run, quota_per_forward=quota_per_forward, progress=progress, jobs=jobs)
    specs = [
        RunSpec(
            model=model,
            hardware=hardware,
            nodes=nodes,
            num_agents=num_agents,
            preset=preset,
            mode=mode,
            scale_down=scale_down,
            seed=seed,
            agents=None if agents is None else tuple(agents),
            read_path=read_path,
            frontend_requests_per_s=frontend_requests_per_s,
            attention_quota_s=attention_quota_s,
        )
        for mode in modes
    ]
    result.table.append(
        "mode | JCT s | SNIC max/avg | attention max/avg | TTFT p50 / p90 s | TPOT p50 / p90 ms"
    )
    run.prefetch(specs)
    for spec in specs:
        r = run(spec)
        # The run's record holds its percentiles (a mode given twice is one run, one record).
        record = next(entry for entry in result.runs if entry["mode"] == spec.mode)
        ttft, tpot = record["ttft_s"], record["tpot_s"]
        result.table.append(
            f"{spec.mode} | {r.jct_s:.1f} | {r.snic_load_balance:.3f} | "
            f"{_fmt(record['attention_balance'])} | "
            f"{_fmt(ttft['p50'])} / {_fmt(ttft['p90'])} | "
            f"{_fmt(tpot['p50'], 1e3)} / {_fmt(tpot['p90'], 1e3)}"
        )
    if online:
        _free_form_capacities(run, result, specs)
    return result


def _free_form_capacities(run: _Runner, result: ExperimentResult, specs: list[RunSpec]) -> None:
    """Each mode's capacity search on a free-form run's cluster and workload, and their ratio
    to Basic's where Basic is among the modes."""
    # As in online-capacity: the window from DualPath's unloaded agents, whatever the mode.
    searches = [_search(run, replace(spec, mode="dualpath"), spec.mode) for spec in specs]
    capacity = {}
    result.table.append("mode | capacity APS | probes (aps: p90 TTFT s / TPOT ms)")
    for spec, search, probes in zip(specs, searches, run.find_capacities(searches), strict=True):
        capacity[spec.mode] = _record_search(run, search, probes)
        shown = _probes_shown(probes, with_tpot=True)
        result.table.append(f"{spec.mode} | {capacity[spec.mode]:.4g} | {shown}")
    basic = capacity.get("basic")
    for mode, aps in capacity.items():
        if mode != "basic" and basic:
            result.table.append(f"{mode} / basic capacity: {aps / basic:.2f}x")


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{scale * value:.3g}"

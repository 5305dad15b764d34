"""Build a simulation from names and run it: ``run_simulation(RunSpec(...))``.

    from dualpath.sim.runner import RunSpec, run_simulation
    result = run_simulation(RunSpec(model="deepseek-v3.2-660b", nodes="2P4D", num_agents=256,
                                    preset="64k", mode="dualpath", scale_down=8))
    print(result.jct_s, result.snic_load_balance)

A ``RunSpec`` is inert (no I/O); ``run_simulation`` is deterministic in it: the workload comes
from ``spec.seed`` through ``dualpath.workload``, and the simulation draws no random numbers.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TypeVar

from dualpath.config import READ_PATHS, SchedulerConfig, mode_settings, parse_node_shape
from dualpath.scheduler import make_cluster_topology
from dualpath.sim.agents import AgentTrace, synthetic_agents
from dualpath.sim.cluster import ClusterModel, RequestRecord
from dualpath.sim.cost import (
    ConstantCostModel,
    CostModel,
    EfficiencyFactors,
    RooflineCostModel,
    fit_attention_predictor,
    kv_capacity_bytes,
    weight_shard_bytes,
)
from dualpath.sim.efficiency import frozen_factors
from dualpath.sim.local import LocalProfile
from dualpath.sim.metrics import ATTENTION_BALANCE_SHARE, attention_balance, snic_load_balance
from dualpath.sim.profiles import (
    HARDWARE,
    MODELS,
    HardwareProfile,
    ModelProfile,
    resolve_hardware,
    resolve_model,
)
from dualpath.sim.simulator import Simulator

PRESET_BY_MAX_LEN = {32_768: "32k", 49_152: "48k", 65_536: "64k"}
BLOCK_SIZE_TOKENS = 64  # the store's Full Block (SPEC §3: e.g. 64 tokens)


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One simulated run, by name. ``scale_down`` K divides GPUs per node, node-wide links and
    agents by K (per-GPU ratios stay), for tests and quick looks."""

    # A built-in profile's name, or a profile (``profiles.resolve_model`` /
    # ``resolve_hardware``: a user's cluster or model from a JSON file).
    model: str | ModelProfile = "deepseek-v3.2-660b"
    hardware: str | HardwareProfile = "hopper-8x400"
    nodes: str = "2P4D"
    num_agents: int = 1024
    preset: str = "64k"
    mode: str = "dualpath"
    seed: int = 0
    scale_down: int = 1
    # None: the frozen factors fitted under this spec's reading of the quota
    # (``efficiency.frozen_factors``), set on construction.
    factors: EfficiencyFactors | None = None
    # None = the roofline model; a ConstantCostModel for hand-computable tests.
    constant_cost: ConstantCostModel | None = None
    # Forces the scheduler ("dualpath" / "round_robin") instead of the mode's (SNIC balance).
    scheduler: str | None = None
    # Forces the read side (config.READ_PATHS, e.g. "split") instead of the mode's.
    read_path: str | None = None
    # The front end's admission rate (turns/s, whole cluster, before ``scale_down``) instead of
    # the hardware profile's.
    frontend_requests_per_s: float | None = None
    # The PE compute quota (predicted seconds of one attention layer per batch) instead of
    # SPEC §6's 300 ms; per layer or per forward is an open question (docs/simulator.md).
    attention_quota_s: float | None = None
    # Read SPEC §6's 300 ms as the attention time of a whole forward: 300 ms / layers per
    # layer (``attention_quota_s`` wins), with that reading's own fitted factors by default.
    quota_per_forward: bool = False
    arrivals_s: tuple[float, ...] | None = None  # per agent; None = all at 0 (offline)
    # Measured costs and links of this machine (``local.py``); replaces the hardware profile
    # and the roofline model.
    local: LocalProfile | None = None
    agents: tuple[AgentTrace, ...] | None = field(default=None, compare=False)  # overrides

    @property
    def model_name(self) -> str:
        return self.model if isinstance(self.model, str) else self.model.name

    def __post_init__(self) -> None:
        if self.factors is None:
            factors = frozen_factors(quota_per_forward=self.quota_per_forward)
            object.__setattr__(self, "factors", factors)
        mode_settings(self.mode)
        parse_node_shape(self.nodes)
        if self.read_path is not None and self.read_path not in READ_PATHS:
            raise ValueError(
                f"read_path must be one of {', '.join(READ_PATHS)}, got {self.read_path!r}"
            )
        if self.frontend_requests_per_s is not None and not self.frontend_requests_per_s > 0:
            raise ValueError(
                f"frontend_requests_per_s must be > 0, got {self.frontend_requests_per_s}"
            )
        if self.attention_quota_s is not None and not self.attention_quota_s > 0:
            raise ValueError(f"attention_quota_s must be > 0, got {self.attention_quota_s}")
        if isinstance(self.model, str) and self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        if isinstance(self.hardware, str) and self.hardware not in HARDWARE:
            raise ValueError(
                f"unknown hardware {self.hardware!r}; choose from {', '.join(HARDWARE)}"
            )
        if self.num_agents < 1 or self.scale_down < 1:
            raise ValueError(
                f"need num_agents >= 1 and scale_down >= 1, got {self.num_agents}, {self.scale_down}"
            )


@dataclass(frozen=True, slots=True)
class RunResult:
    spec: RunSpec
    jct_s: float  # when the last agent finished
    snic_load_balance: float  # SPEC §7; nan when no SNIC carried a byte (oracle)
    # SPEC §7: per-PE attention time max / mean over a lockstep group, first 5% of the run
    attention_balance: float
    num_requests: int
    num_events: int
    wall_s: float
    records: tuple[RequestRecord, ...]
    snic_bytes: float  # read + written through all SNICs

    @property
    def events_per_s(self) -> float:
        return self.num_events / self.wall_s if self.wall_s > 0 else math.inf


def _nodes_per_group(num_prefill: int, num_decode: int) -> int:
    # Groups of 2 nodes when both roles allow it (a group of several nodes can hold both
    # categories A and B, SPEC §6); else one node per group.
    return 2 if num_prefill % 2 == 0 and num_decode % 2 == 0 else 1


def build_simulator(spec: RunSpec) -> Simulator:
    model = resolve_model(spec.model)
    hardware = resolve_hardware(spec.hardware)
    if spec.frontend_requests_per_s is not None:
        hardware = replace(hardware, frontend_requests_per_s=spec.frontend_requests_per_s)
    hardware = hardware.scaled_down(spec.scale_down)
    settings = mode_settings(spec.mode)
    num_prefill_nodes, num_decode_nodes = parse_node_shape(spec.nodes)
    block_size = BLOCK_SIZE_TOKENS
    if spec.agents is not None:
        agents = list(spec.agents)
    else:
        agents = synthetic_agents(
            spec.preset,
            max(1, spec.num_agents // spec.scale_down),
            seed=spec.seed,
            block_size_tokens=block_size,
            arrivals_s=None if spec.arrivals_s is None else list(spec.arrivals_s),
        )
    machine = _machine(spec, model, hardware, num_prefill_nodes, num_decode_nodes)
    prefill_cost, decode_cost = machine.prefill_cost, machine.decode_cost
    max_prompt = max(max(a.prompt_tokens) for a in agents)
    predictor = fit_attention_predictor(prefill_cost, max_context_tokens=max_prompt)
    # β (SPEC §6): prompt tokens one GPU prefills in 5 s, profiled on the workload's mean turn.
    num_prompt = sum(sum(a.prompt_tokens) for a in agents)
    num_hit = sum(sum(a.hit_tokens) for a in agents)
    num_turns = sum(a.num_turns for a in agents)
    mean_hit, mean_new = num_hit // num_turns, max(1, (num_prompt - num_hit) // num_turns)
    batch = [(mean_hit, mean_new)] * 16
    prefill_tokens_per_s = 16 * (mean_hit + mean_new) / prefill_cost.prefill_s(batch)
    scheduler = SchedulerConfig(
        scheduler=spec.scheduler or settings.scheduler,
        read_path=spec.read_path or settings.read_path,
        block_size_tokens=block_size,
        prefill_tokens_per_s=prefill_tokens_per_s,
    )
    if spec.attention_quota_s is not None:
        scheduler = replace(scheduler, attention_quota_s=spec.attention_quota_s)
    elif spec.quota_per_forward:
        scheduler = replace(
            scheduler, attention_quota_s=scheduler.attention_quota_s / model.num_layers
        )
    topology = make_cluster_topology(
        num_prefill_nodes=num_prefill_nodes,
        num_decode_nodes=num_decode_nodes,
        storage_read_tokens_per_s=machine.snic_read_bytes_per_s / machine.kv_bytes_per_token,
        engines_per_node=machine.num_engines_per_node,
        nodes_per_group=_nodes_per_group(num_prefill_nodes, num_decode_nodes),
    )
    cluster = ClusterModel(
        topology=topology,
        scheduler=scheduler,
        mode=spec.mode,
        kv_bytes_per_token=machine.kv_bytes_per_token,
        all_to_all_bytes_per_token=machine.all_to_all_bytes_per_token,
        snic_read_bytes_per_s=machine.snic_read_bytes_per_s,
        snic_write_bytes_per_s=machine.snic_read_bytes_per_s,
        cnic_bytes_per_s=machine.cnic_bytes_per_s,
        num_decode_kv_blocks=int(
            machine.decode_kv_capacity_bytes // (block_size * machine.kv_bytes_per_token)
        ),
        prefill_kv_capacity_bytes=machine.prefill_kv_capacity_bytes,
        turn_latency_s=spec.local.turn_latency_s if spec.local else 0.0,
        handoff_s=spec.local.handoff_s if spec.local else 0.0,
        fetch_when_idle=spec.local is not None,
        # The benchmark's SNIC cap is one token bucket for both directions.
        is_snic_shared=spec.local is not None,
        # The measured profile's front end is inside its fitted ``turn_latency_s``.
        frontend_s_per_request=0.0 if spec.local else 1.0 / hardware.frontend_requests_per_s,
        # The measured profile's store is this machine's disk, behind the benchmark's SNIC caps.
        storage_service_bytes_per_s=(
            math.inf if spec.local else hardware.storage_service_bytes_per_s
        ),
    )
    return Simulator(
        cluster,
        agents,
        prefill_cost=prefill_cost,
        decode_cost=decode_cost,
        attention_predictor=predictor,
        num_prefill_layers=machine.num_layers,
    )


@dataclass(frozen=True, slots=True)
class _Machine:
    """What ``build_simulator`` needs of the hardware and cost models, from either source."""

    prefill_cost: CostModel
    decode_cost: CostModel
    kv_bytes_per_token: int
    num_layers: int
    num_engines_per_node: int
    all_to_all_bytes_per_token: float
    snic_read_bytes_per_s: float  # per node, storage efficiency applied
    cnic_bytes_per_s: float
    decode_kv_capacity_bytes: float  # per DE
    prefill_kv_capacity_bytes: float  # per PE


def _machine(
    spec: RunSpec, model, hardware, num_prefill_nodes: int, num_decode_nodes: int
) -> _Machine:
    if spec.local is not None:
        local = spec.local
        return _Machine(
            prefill_cost=local.cost,
            decode_cost=local.cost,
            kv_bytes_per_token=local.kv_bytes_per_token,
            num_layers=local.cost.num_layers,
            num_engines_per_node=1,
            all_to_all_bytes_per_token=0.0,
            snic_read_bytes_per_s=local.snic_bytes_per_s,
            cnic_bytes_per_s=local.cnic_bytes_per_s,
            decode_kv_capacity_bytes=local.kv_cache_bytes,
            prefill_kv_capacity_bytes=local.kv_cache_bytes,
        )
    prefill_weights = weight_shard_bytes(model, num_prefill_nodes * 8)
    decode_weights = weight_shard_bytes(model, num_decode_nodes * 8)
    prefill_cost: CostModel
    decode_cost: CostModel
    if spec.constant_cost is not None:
        prefill_cost = decode_cost = spec.constant_cost
    else:
        prefill_cost = RooflineCostModel(model, hardware, spec.factors, prefill_weights)
        decode_cost = RooflineCostModel(model, hardware, spec.factors, decode_weights)
    return _Machine(
        prefill_cost=prefill_cost,
        decode_cost=decode_cost,
        kv_bytes_per_token=model.kv_bytes_per_token,
        num_layers=model.num_layers,
        num_engines_per_node=hardware.num_gpus_per_node,
        all_to_all_bytes_per_token=model.num_layers * model.all_to_all_bytes_per_token_per_layer,
        snic_read_bytes_per_s=hardware.snic_bytes_per_s * spec.factors.storage_efficiency,
        cnic_bytes_per_s=hardware.cnic_bytes_per_s,
        decode_kv_capacity_bytes=kv_capacity_bytes(hardware, decode_weights),
        prefill_kv_capacity_bytes=kv_capacity_bytes(hardware, prefill_weights),
    )


@contextmanager
def progress_bar(
    simulator: Simulator, label: str, *, enabled: bool, until_s: float = math.inf
) -> Iterator[Callable[[float, int], None] | None]:
    """A progress bar (stderr) of ``simulator``'s finished turns and simulated time, as the
    ``on_progress`` of its ``run``; None when not ``enabled``. It goes when the run ends
    (callers print one line per finished run)."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    of = "" if until_s == math.inf else f" of {until_s:,.0f}"
    with tqdm(total=simulator.num_turns, desc=label, unit="turn", leave=False) as bar:

        def on_progress(now_s: float, num_finished: int) -> None:
            bar.set_postfix_str(f"{now_s:,.0f}{of} s simulated", refresh=False)
            bar.update(num_finished - bar.n)

        yield on_progress


def run_simulation(spec: RunSpec, *, progress: bool = False) -> RunResult:
    """Build, run and summarise one simulation (``progress``: a progress bar on stderr)."""
    simulator = build_simulator(spec)
    start_s = time.perf_counter()
    with progress_bar(simulator, f"{spec.nodes} {spec.mode}", enabled=progress) as on_progress:
        simulator.run(on_progress=on_progress)
    wall_s = time.perf_counter() - start_s
    jct_s = max(simulator.agent_finish_s)
    snic_links = [(n.snic_read, n.snic_write) for n in simulator.nodes]
    return RunResult(
        spec=spec,
        jct_s=jct_s,
        snic_load_balance=snic_load_balance(snic_links, jct_s, simulator.cluster.snic_window_s),
        attention_balance=attention_balance(
            simulator.step_start_s,
            simulator.step_attention_max_s,
            simulator.step_attention_mean_s,
            ATTENTION_BALANCE_SHARE * jct_s,
        ),
        num_requests=len(simulator.records),
        num_events=simulator.queue.num_events,
        wall_s=wall_s,
        records=tuple(simulator.records),
        snic_bytes=sum(sum(r.finished_bytes) + sum(w.finished_bytes) for r, w in snic_links),
    )


T = TypeVar("T")


def map_runs(
    function: Callable[..., T], calls: Sequence[tuple], *, jobs: int = 1, progress: bool = False
) -> list[T]:
    """``function(*call, progress=...)`` for each call, results in order: with ``jobs`` > 1 in
    that many worker processes (one core each; one bar counts the finished calls), else here
    one after another (each call with its own bar). ``function`` is ``run_simulation`` or
    another module-level function of independent, deterministic work: the results are the
    same either way. A worker's exception is raised here. As with any ``multiprocessing``
    start method but fork, a script that calls this with ``jobs`` > 1 keeps its top-level
    code under ``if __name__ == "__main__":`` (the ``dualpath`` command does)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if jobs == 1 or len(calls) <= 1:
        return [function(*call, progress=progress) for call in calls]
    from tqdm import tqdm

    # forkserver: workers start from a clean interpreter (no threads of ours are forked) and
    # import the same build, sources or compiled (DUALPATH_COMPILED is inherited).
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(min(jobs, len(calls)), mp_context=context) as pool:
        futures = [pool.submit(function, *call, progress=False) for call in calls]
        try:
            with tqdm(
                total=len(futures), desc=f"{jobs} jobs", unit="run", disable=not progress
            ) as bar:
                for future in as_completed(futures):
                    future.result()  # the first failure stops the rest
                    bar.update()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return [future.result() for future in futures]

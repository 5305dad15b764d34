"""One benchmark run, specified once: what runs the model, what the agents replay, which modes
are compared and where the results go.

    spec = run_spec(args)  # bench/offline.py's main: the command line, read in one place
    report = run_offline(spec)

``RunSpec`` is what ``bench offline`` runs; ``OnlineSpec`` adds how ``bench online``'s agents
arrive and are judged, ``VsVllmSpec`` what ``bench vs-vllm`` gives the systems it compares.
Every field that is None means "the preset's" (workload) or "serve's default" (engines). The
specs are inert: building one reads no file and starts nothing; the checks that need the
preset or the checkpoint run where the run starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualpath.bench.presets import BenchPreset, WorkloadShape, workload_shape
from dualpath.config import EngineConfig
from dualpath.vllm.args import engine_kind_args

# Where ``bench offline``/``online`` take a calibrated preset's caps from
# (``calibration_records``), and how many calibration runs a recorded one is the median of.
CALIBRATION_SOURCES = ("recorded", "run", "record")
DEFAULT_CALIBRATION_RUNS = 3

SLO_BASES = ("oracle", "basic")  # whose unloaded latencies an online SLO multiplies
DEFAULT_MIN_AGENTS = 48  # an online run has at least this many agents
# The servers' KV block (serve --block-size's default): hits are whole blocks of it.
BLOCK_SIZE_TOKENS = EngineConfig().block_size_tokens
# The servers' KV dtype (serve --dtype's default): what a token's KV costs in an engine.
KV_DTYPE = EngineConfig().dtype
# EngineSpec.engine of DualPath inside vLLM servers (``--vllm-servers``: ``served_run.py``).
VLLM_SERVERS = "vllm-servers"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What runs the model in every server a benchmark starts, and how its KV moves (serve's
    flags of the same names; None: serve's default)."""

    # serve --engine: "native" (ours) or "vllm"; or VLLM_SERVERS: a vLLM server per engine,
    # `dualpath serve --external-engines` in front (its vLLM settings: served_run.py's checks)
    engine: str = "native"
    vllm_args: tuple[tuple[str, Any], ...] = ()  # with engine "vllm": serve --vllm-arg, in order
    # Each engine's device KV memory, GB. None: on vLLM engines the preset's rule
    # (``offline.engines_kv_cache_gb``), else serve's default.
    kv_cache_gb: float | None = None
    vllm_prefill_batching: str = "vllm"  # with engine "vllm": serve --vllm-prefill-batching
    attention_quota_s: float | None = None  # the prefill engines' compute quota
    transport: str = "nixl"  # PE<->DE KV transport
    read_path: str | None = None  # force one read path in every mode (None: each mode's own)
    # The servers' longest prompt (None: the context minus one); every turn of the workload is
    # checked against it before any server starts.
    max_prompt_tokens: int | None = None
    # What shapes the links: "emulated" (our token buckets, one host) or "kernel" (test hosts,
    # ``tc``: ``kernel_links.py``).
    links: str = "emulated"


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What the agents replay: a preset's workload with the command line's shaping (each None:
    the preset's; ``presets.workload_shape``)."""

    preset: str = "ci"  # a presets.PRESETS key: the workload, the cluster and its link caps
    seed: int = 0
    trace: Path | None = None  # a Mooncake-format JSONL trace instead of the preset's sessions
    max_sessions: int | None = None
    length_scale: float | None = None
    max_turns: int | None = None
    gen_scale: float | None = None
    clones: int | None = None

    def shape(self, preset: BenchPreset) -> WorkloadShape:
        """``preset``'s shaping with this spec's overrides."""
        return workload_shape(
            preset,
            trace=self.trace,
            max_sessions=self.max_sessions,
            length_scale=self.length_scale,
            max_turns=self.max_turns,
            gen_scale=self.gen_scale,
            clones=self.clones,
        )


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """Where a run's results go."""

    json_path: Path | None = None  # --json (with a table and plots beside it)
    out_dir: Path | None = None  # --out-dir
    progress: bool = True  # a progress bar per mode on stderr
    # The servers' stores and logs (None: a temporary directory, removed after the run).
    work_dir: Path | None = None


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One benchmark run: the checkpoint, what runs it (``engine``), what the agents replay
    (``workload``, on the preset's cluster), which modes are compared, and the outputs."""

    model_dir: Path
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    # The modes compared, in order (vs-vllm: the systems); tokens are checked against the first.
    modes: tuple[str, ...] = ("basic", "dualpath", "oracle")
    engine: EngineSpec = field(default_factory=EngineSpec)
    # Calibrate the SNIC caps to this rho (SPEC §5) instead of the preset's caps.
    rho: float | None = None
    output: OutputSpec = field(default_factory=OutputSpec)
    # Where a calibrated preset's caps come from (CALIBRATION_SOURCES; None: "recorded", not
    # asked for), and over how many runs a recorded one is taken.
    calibration: str | None = None
    calibration_runs: int = DEFAULT_CALIBRATION_RUNS


@dataclass(frozen=True, slots=True)
class OnlineSpec:
    """A ``bench online`` run: ``run``, and how its agents arrive and are judged
    (``online.py``'s module docstring)."""

    run: RunSpec
    aps: float | None = None  # the starting arrival rate, agents/s (None: the preset's)
    find_capacity: bool = False  # search the largest rate that attains the SLO
    slo_ttft_s: float | None = None  # None: 4 x the basis's unloaded p50
    slo_tpot_s: float | None = None
    slo_basis: str = "oracle"  # whose unloaded latencies the SLO multiplies (SLO_BASES)
    min_agents: int = DEFAULT_MIN_AGENTS
    replay_gaps: float | None = None  # wait the trace's gaps times this (None: no waits)
    max_gap_s: float | None = None  # with replay_gaps: each wait at most this

    def __post_init__(self) -> None:
        if self.slo_basis not in SLO_BASES:
            raise ValueError(f"--slo-basis must be one of {SLO_BASES}, got {self.slo_basis!r}")
        if self.min_agents < 1:
            raise ValueError(f"--min-agents must be >= 1, got {self.min_agents}")
        if self.aps is not None and self.aps <= 0:
            raise ValueError(f"--aps must be > 0, got {self.aps}")
        if self.replay_gaps is not None and self.replay_gaps < 0:
            raise ValueError(f"--replay-gaps must be >= 0, got {self.replay_gaps}")
        if self.max_gap_s is not None and (self.replay_gaps is None or self.max_gap_s < 0):
            raise ValueError(
                f"--max-gap-s must be >= 0 and goes with --replay-gaps, got {self.max_gap_s}"
            )

    @property
    def gaps(self) -> dict[str, float | None]:
        """``run_mode``'s keyword arguments for the waits between turns."""
        return {"gap_scale": self.replay_gaps, "max_gap_s": self.max_gap_s}


@dataclass(frozen=True, slots=True)
class VsVllmSpec:
    """A ``bench vs-vllm`` run: ``run`` (its modes are the systems compared), and what every
    engine of ours and every vLLM instance gets."""

    run: RunSpec
    kv_cache_gb: float = 1.0  # KV cache per engine and per vLLM instance, GB (the single: twice)
    threads: int = 1  # threads per engine of ours (serve --threads)
    decode_threads: int | None = None  # per decode engine of ours (None: threads)
    # ``dualpath-local-*`` systems' serve --local-prefill-tokens
    local_prefill_tokens: int = 0
    start_timeout_s: float = 600.0  # how long a vLLM instance may take to start
    regime: str | None = None  # --regime (None: the sessions back to back, --kv-cache-gb)
    pause_s: float = 0.0  # each session's pause after every answer (its tools)


def modes_of(text: str | None, default: str) -> tuple[str, ...]:
    """``--modes`` (or ``--systems``): the comma-separated names, in order."""
    return tuple(m.strip() for m in (text or default).split(",") if m.strip())


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The workload flags every agent benchmark shares (``--clones`` where it has one)."""
    return WorkloadSpec(
        preset=args.preset,
        seed=args.seed,
        trace=args.trace,
        max_sessions=args.max_sessions,
        length_scale=args.length_scale,
        max_turns=args.max_turns,
        gen_scale=args.gen_scale,
        clones=getattr(args, "clones", None),
    )


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """``bench offline``'s and ``bench online``'s engine flags (``ValueError`` for vLLM
    settings without ``--engine vllm`` or ``--vllm-servers``: ``vllm_args.engine_kind_args``)."""
    is_served = getattr(args, "vllm_servers", False)
    # The vLLM servers are vLLM engines: their vLLM flags are read as --engine vllm's.
    kind = engine_kind_args(
        argparse.Namespace(**{**vars(args), "engine": "vllm"}) if is_served else args
    )
    return EngineSpec(
        engine=VLLM_SERVERS if is_served else kind["engine"],
        vllm_args=tuple(kind["vllm_args"].items()),
        kv_cache_gb=args.kv_cache_gb,
        vllm_prefill_batching=kind["vllm_prefill_batching"],
        attention_quota_s=args.attention_quota_s,
        transport=args.transport,
        read_path=args.read_path,
        max_prompt_tokens=args.max_prompt_tokens,
        links=args.links,
    )


def output_spec(args: argparse.Namespace) -> OutputSpec:
    return OutputSpec(
        json_path=args.json, out_dir=args.out_dir, work_dir=getattr(args, "work_dir", None)
    )

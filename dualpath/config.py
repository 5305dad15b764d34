"""Every ``*Config`` dataclass: frozen, validated, commented, inert.

Constructing a config does no I/O, reads no environment and sets up no logging; ``cli.py``
builds configs from flags, and runners write the resolved config next to their results.
Derived values come from functions that return new objects (``dataclasses.replace``).

A config tree travels between processes as plain data: ``config_to_dict`` and
``config_from_dict`` carry every field of every nested config (a process that builds itself
from the result gets exactly the sender's config), and a field the receiver does not know is
refused by name.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class KVStoreConfig:
    """Where and how much KV the external store keeps. ``root_dir=None`` disables the store."""

    root_dir: Path | None = None
    # None = unbounded. The store evicts least-recently-used Full Blocks beyond this budget.
    capacity_bytes: int | None = None
    # Verify every block's checksum on read; a damaged block is dropped and recomputed.
    verify_checksums: bool = True
    # fsync each block before its rename: survives power loss, costs write latency.
    fsync_writes: bool = False

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0 or None, got {self.capacity_bytes}")

    @property
    def is_enabled(self) -> bool:
        return self.root_dir is not None


ENGINE_KINDS = ("native", "vllm")
VLLM_PREFILL_BATCHING = ("vllm", "quota")
# SPEC §6: a PE batch's predicted time of one attention layer, on the paper's Hopper nodes.
DEFAULT_ATTENTION_QUOTA_S = 0.300


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine's memory and batching limits, and where it runs."""

    # Tokens per paged KV block, which is also the store's Full Block (SPEC §3); 64 is the
    # paper's write-back example and small enough that a turn's append fills a few blocks.
    block_size_tokens: int = 64
    device: str = "cpu"
    # Weights and KV dtype. float32 is the default because exactness tests need it on CPU.
    dtype: str = "float32"
    # Device KV memory in blocks; None = as many as fit in kv_cache_bytes.
    num_device_blocks: int | None = None
    # Budget for the paged KV cache when num_device_blocks is None. 1 GiB holds ~8K blocks of
    # the tiny model (512K tokens): plenty on a CPU, small on a GPU.
    kv_cache_bytes: int = 1 << 30
    # Threads reading hit blocks from the store in parallel (a store is many files or a DFS).
    num_io_threads: int = 4
    # Bytes of KV waiting to be persisted before new writes wait for old ones (back-pressure).
    max_pending_write_bytes: int = 256 << 20
    # torch intra-op threads for this process; None = torch's default. Engines sharing a host
    # want 1 each: on an oversubscribed CPU every OpenMP barrier waits a scheduler tick.
    num_threads: int | None = None
    # A decode engine's torch threads instead (None: num_threads). A DE steps small batches,
    # where an OpenMP fork-join costs more than a second thread gains, and on a host whose
    # engines share cores its threads take them from the PE's prefill (measured: docs/vllm-
    # engine.md, "Against vLLM alone").
    num_decode_threads: int | None = None
    # Upper bound of running sequences in one forward step.
    max_num_seqs: int = 64
    # Upper bound of tokens in one forward step; longer prompts are prefilled in chunks.
    max_num_batched_tokens: int = 8192
    # None = the checkpoint's max_position_embeddings.
    max_model_len: int | None = None
    # What runs the model: "native" (ours, the reference) or "vllm" (vLLM's engine with our KV
    # connector, dualpath/vllm/; SPEC §9).
    engine: str = "native"
    # vLLM engine arguments passed through (EngineArgs field -> value), "vllm" engines only.
    vllm_args: dict[str, Any] = field(default_factory=dict)
    # What a vLLM PE hands its engine (docs/vllm.md): "vllm", every request whose reads are
    # done (vLLM's scheduler packs its steps by max_num_batched_tokens); "quota", one batch
    # at a time packed by the compute-quota batcher (SPEC §6, attention_quota_s) with a
    # predictor profiled on the vLLM engine, whole requests only.
    vllm_prefill_batching: str = "vllm"

    def __post_init__(self) -> None:
        if self.block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be > 0, got {self.block_size_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.num_device_blocks is not None and self.num_device_blocks <= 0:
            raise ValueError(f"num_device_blocks must be > 0, got {self.num_device_blocks}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_io_threads <= 0:
            raise ValueError(f"num_io_threads must be > 0, got {self.num_io_threads}")
        if self.max_pending_write_bytes <= 0:
            raise ValueError(
                f"max_pending_write_bytes must be > 0, got {self.max_pending_write_bytes}"
            )
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be > 0 or None, got {self.num_threads}")
        if self.num_decode_threads is not None and self.num_decode_threads <= 0:
            raise ValueError(
                f"num_decode_threads must be > 0 or None, got {self.num_decode_threads}"
            )
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine must be one of {ENGINE_KINDS}, got {self.engine!r}")
        if self.vllm_args and self.engine != "vllm":
            raise ValueError("vllm_args are vLLM engine arguments: give them with engine 'vllm'")
        if self.vllm_prefill_batching not in VLLM_PREFILL_BATCHING:
            raise ValueError(
                f"vllm_prefill_batching must be one of {VLLM_PREFILL_BATCHING}, "
                f"got {self.vllm_prefill_batching!r}"
            )
        if self.vllm_prefill_batching != "vllm" and self.engine != "vllm":
            raise ValueError(
                "vllm_prefill_batching is what a vLLM prefill engine hands vLLM: give it with "
                "engine 'vllm'"
            )

    def for_role(self, role: str) -> EngineConfig:
        """This config as an engine of ``role`` ("prefill" or "decode") runs it: a decode
        engine's ``num_threads`` is ``num_decode_threads`` where that is set."""
        if role != "decode" or self.num_decode_threads is None:
            return self
        return dataclasses.replace(self, num_threads=self.num_decode_threads)


SCHEDULER_NAMES = ("dualpath", "round_robin")
READ_PATHS = ("dual", "split", "pe", "de", "round_robin")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Placement policy, read-path policy and their constants (SPEC §6)."""

    # "dualpath" = Algorithm 1 + two-phase DE placement; "round_robin" = our reading of Basic.
    scheduler: str = "dualpath"
    # "dual": whole request on the side with the shorter read queue (tie -> DE side);
    # "split": hit blocks divided so both sides finish together (our extension, SPEC §8);
    # "pe" / "de": always that side ("pe" is Basic's classic path);
    # "round_robin": whole requests on the PE side, then the DE side, in turn, ignoring the
    # queues (the load-oblivious baseline of the ablation's "+dual path" step).
    read_path: str = "dual"
    # Tokens per Full Block (SPEC §3). Hits are whole blocks, DE free memory is counted in
    # blocks, and split reads divide a request at block boundaries.
    block_size_tokens: int = 64
    # α = tokens a node reads from storage in this many seconds (SPEC §6: 3 s).
    alpha_window_s: float = 3.0
    # β = tokens one GPU prefills in this many seconds (SPEC §6: 5 s).
    beta_window_s: float = 5.0
    # Fixed α for every node; None = alpha_window_s x the node's storage read rate.
    alpha_tokens: int | None = None
    # Fixed β; None = beta_window_s x prefill_tokens_per_s.
    beta_tokens: int | None = None
    # Profiled prompt tokens (hit + new, the unit of tok_e) one GPU prefills per second under
    # the served workload. None is allowed only when beta_tokens is set (or for round robin).
    prefill_tokens_per_s: float | None = None
    # Z = z_factor x the group's mean tok_e after the fetch (SPEC §6: 1.05).
    z_factor: float = 1.05
    # Leaders fetch every interval or when idle (SPEC §6: 10 ms). The policy itself never reads
    # time; the runtime and the simulator pace fetches with it.
    fetch_interval_s: float = 0.010
    # Predicted time of one attention layer allowed per PE batch (SPEC §6: 300 ms on the
    # paper's Hopper nodes; profile it on other hardware).
    attention_quota_s: float = DEFAULT_ATTENTION_QUOTA_S
    # Smallest chunk the batcher cuts; a batch may exceed the quota only by one such chunk,
    # so a request that alone overflows the quota still makes progress. One Full Block.
    min_prefill_chunk_tokens: int = 64

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULER_NAMES:
            raise ValueError(f"scheduler must be one of {SCHEDULER_NAMES}, got {self.scheduler!r}")
        if self.read_path not in READ_PATHS:
            raise ValueError(f"read_path must be one of {READ_PATHS}, got {self.read_path!r}")
        _require_positive("block_size_tokens", self.block_size_tokens)
        _require_positive("alpha_window_s", self.alpha_window_s)
        _require_positive("beta_window_s", self.beta_window_s)
        if self.alpha_tokens is not None and self.alpha_tokens < 0:
            raise ValueError(f"alpha_tokens must be >= 0 or None, got {self.alpha_tokens}")
        if self.beta_tokens is not None and self.beta_tokens < 0:
            raise ValueError(f"beta_tokens must be >= 0 or None, got {self.beta_tokens}")
        if self.prefill_tokens_per_s is not None:
            _require_positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        if not self.z_factor >= 1.0:
            raise ValueError(f"z_factor must be >= 1.0, got {self.z_factor}")
        _require_positive("fetch_interval_s", self.fetch_interval_s)
        _require_positive("attention_quota_s", self.attention_quota_s)
        _require_positive("min_prefill_chunk_tokens", self.min_prefill_chunk_tokens)


def _require_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class TrafficConfig:
    """Link caps and arbiter weights of the engines' traffic managers (SPEC §4)."""

    # Each node's storage NIC, shared by all its engine processes through one NodeLimiter.
    # 0 = no cap (the store's real speed); the paper's nodes have up to 400 Gbps.
    snic_bandwidth_gbps: float = 0.0
    # Each engine's compute NIC: PE<->DE KV and host<->device copies; the paper: 400 Gbps.
    cnic_bandwidth_gbps: float = 0.0
    # Host memory per node (SPEC §5's M), for the start-up check of the P/D ratio alone
    # (``check_pd_ratio``); 0 = no check. Not a cap: no movement is charged to host memory.
    host_memory_bandwidth_gbps: float = 0.0
    # SPEC §4: the high class gets ~99% under contention; the low class is never starved.
    inference_weight: int = 99
    kv_weight: int = 1
    # Span of the utilisation figure (TrafficManager's window_s); SPEC §7 measures SNIC
    # balance over 1 s windows.
    utilisation_window_s: float = 1.0
    # A capped link idle for at most this long between two movements counts as busy through
    # the gap: it is the caller's overhead (time.sleep overshoots 60-180 us), not idleness.
    # Without it a caller moving 100 KB back to back gets ~45% of a 1 GB/s cap; 0 = off.
    gap_fill_s: float = 0.001

    def __post_init__(self) -> None:
        for name in ("snic_bandwidth_gbps", "cnic_bandwidth_gbps", "host_memory_bandwidth_gbps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (0 = no cap), got {getattr(self, name)}")
        if self.inference_weight <= 0 or self.kv_weight <= 0:
            raise ValueError(
                f"class weights must be > 0 (a zero weight starves a class), "
                f"got inference {self.inference_weight} and kv {self.kv_weight}"
            )
        if not self.gap_fill_s >= 0:
            raise ValueError(f"gap_fill_s must be >= 0, got {self.gap_fill_s}")
        if not self.utilisation_window_s > 0:
            raise ValueError(f"utilisation_window_s must be > 0, got {self.utilisation_window_s}")

    @property
    def class_weights(self) -> dict[int, int]:
        """Weights by ``TrafficClass`` value (0 = inference, 1 = KV)."""
        return {0: self.inference_weight, 1: self.kv_weight}


# --- the disaggregated cluster ----------------------------------------------------------------

# Named the same everywhere (runtime, benchmarks, simulator). Each adds to the one before it,
# except oracle, which is dualpath with every storage read, host<->device copy and PE<->DE
# transfer made free (SPEC §7).
MODES = ("basic", "layerwise", "layerwise+dual", "dualpath", "oracle")


@dataclass(frozen=True, slots=True)
class ModeSettings:
    """What a mode switches on; derived from its name by ``mode_settings``."""

    mode: str
    scheduler: str  # "round_robin" or "dualpath" (SchedulerConfig.scheduler)
    read_path: str  # SchedulerConfig.read_path
    is_layerwise: bool  # layer-wise prefill on the PE (SPEC §3)
    is_io_free: bool  # oracle: links uncapped, hit KV served from memory


def mode_settings(mode: str) -> ModeSettings:
    """The switches of a mode (SPEC §7's ablation: Basic -> +layer-wise -> +dual path ->
    +scheduler; Oracle = DualPath without I/O cost)."""
    table = {
        "basic": ("round_robin", "pe", False, False),
        "layerwise": ("round_robin", "pe", True, False),
        # "+dual path": both read paths are used, but every choice is still round robin, the
        # read side included (PE, DE, PE, ... per node pair, ignoring the queues).
        "layerwise+dual": ("round_robin", "round_robin", True, False),
        # "+scheduler": DualPath's load-aware PE/DE placement and shorter-read_q read side.
        "dualpath": ("dualpath", "dual", True, False),
        "oracle": ("dualpath", "dual", True, True),
    }
    if mode not in table:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    scheduler, read_path, is_layerwise, is_io_free = table[mode]
    return ModeSettings(mode, scheduler, read_path, is_layerwise, is_io_free)


def parse_node_shape(shape: str) -> tuple[int, int]:
    """``"2P4D"`` -> (2 prefill nodes, 4 decode nodes); ``ValueError`` naming the input."""
    text = shape.strip().upper()
    head, sep, tail = text.partition("P")
    if not sep or not tail.endswith("D"):
        raise ValueError(f"node shape must look like 2P4D, got {shape!r}")
    try:
        num_prefill, num_decode = int(head), int(tail[:-1])
    except ValueError as exc:
        raise ValueError(f"node shape must look like 2P4D, got {shape!r}") from exc
    if num_prefill <= 0 or num_decode <= 0:
        raise ValueError(f"node shape needs >= 1 prefill and >= 1 decode node, got {shape!r}")
    return num_prefill, num_decode


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """A PD-disaggregated cluster: nodes, engines, buffers and link caps (0 = no cap).

    A cap emulates a cluster's link on one host (SPEC §4); every figure measured with caps
    depends on them and says so.
    """

    num_prefill_nodes: int = 1
    num_decode_nodes: int = 2
    # One engine = one GPU (or one CPU process here).
    engines_per_node: int = 1
    # Engine groups fetch work together (SPEC §6); whole nodes, one role per group.
    nodes_per_group: int = 1
    mode: str = "dualpath"
    # Forces one read path (READ_PATHS: "pe", "de", ...) instead of the mode's; None keeps the
    # mode's. For experiments and tests of a single data path.
    read_path: str | None = None
    # Link caps (SNIC per node, CNIC per engine) and the traffic classes' weights.
    traffic: TrafficConfig = TrafficConfig()
    # Host-DRAM KV buffer per engine; a full buffer delays loads (back-pressure), never drops.
    # None = sized at start from the model and its context: two requests of the whole context
    # (engine/capacity.py). A size that cannot hold one such request is refused at start.
    prefill_buffer_bytes: int | None = None
    decode_buffer_bytes: int | None = None
    # Where the scheduler listens. Loopback unless told otherwise; a token is always required.
    control_endpoint: str = "tcp://127.0.0.1:0"
    # An engine that has not reported for this long is declared dead; an engine that has not
    # heard from the scheduler for this long exits on its own.
    heartbeat_timeout_s: float = 5.0
    # A request whose hit prefix stops at a block a DE is still writing waits for the write,
    # at most this long after the writing request finished (0: never wait, recompute).
    persist_wait_s: float = 5.0
    # An agent session (a request's session id) stays on its DE, and its blocks in the store
    # against capacity pressure, for this long after its last turn (0: sessions off). 300 s
    # as Anthropic's and OpenAI's prompt caches keep an idle prefix: agents pace their tool
    # calls to it.
    session_retention_s: float = 300.0
    # Conditional disaggregation: a request whose prompt the store misses by at most this
    # many tokens (an agent's short append to its session) is prefilled on its DE, which then
    # decodes it, where the DE can (``EngineInfo.prefills_locally``: ``--engine vllm``); no
    # PE nor transfer takes part. 0: every request is disaggregated (SPEC §2).
    local_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prefill_nodes", "num_decode_nodes", "engines_per_node"):
            _require_positive(name, getattr(self, name))
        _require_positive("nodes_per_group", self.nodes_per_group)
        for role, count in (("prefill", self.num_prefill_nodes), ("decode", self.num_decode_nodes)):
            if count % self.nodes_per_group:
                raise ValueError(
                    f"{count} {role} nodes do not split into groups of {self.nodes_per_group}"
                )
        mode_settings(self.mode)  # validates the name
        if self.read_path is not None and self.read_path not in READ_PATHS:
            raise ValueError(f"read_path must be one of {READ_PATHS}, got {self.read_path!r}")
        for name in ("prefill_buffer_bytes", "decode_buffer_bytes"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        _require_positive("heartbeat_timeout_s", self.heartbeat_timeout_s)
        if self.persist_wait_s < 0:
            raise ValueError(f"persist_wait_s must be >= 0, got {self.persist_wait_s}")
        if not 0 <= self.session_retention_s < math.inf:
            raise ValueError(
                f"session_retention_s must be finite and >= 0, got {self.session_retention_s}"
            )
        if self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {self.local_prefill_tokens}")

    @property
    def node_shape(self) -> str:
        return f"{self.num_prefill_nodes}P{self.num_decode_nodes}D"

    @property
    def settings(self) -> ModeSettings:
        settings = mode_settings(self.mode)
        if self.read_path is None:
            return settings
        return dataclasses.replace(settings, read_path=self.read_path)


# --- one engine process -----------------------------------------------------------------------

ENGINE_ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class EngineProcessConfig:
    """Everything one engine process builds itself from (``dualpath engine``); the launcher
    sends it whole (``config_to_dict``). The cluster token is not part of it: it travels in
    the environment, like any secret."""

    role: str  # "prefill" or "decode"
    engine_id: int
    node_id: int
    scheduler_endpoint: str
    model_dir: Path
    store: KVStoreConfig = KVStoreConfig()
    engine: EngineConfig = EngineConfig()
    cluster: ClusterConfig = ClusterConfig()
    # The PE's batcher takes its compute quota and minimum chunk from here, and the engine its
    # report interval (SPEC §6's fetch interval), as the scheduler and the simulator do.
    scheduler: SchedulerConfig = SchedulerConfig()
    transport: str = "nixl"  # dualpath.transfer.transport.TRANSPORT_KINDS
    # An idle engine whose report would not change sends it only this often (a keep-alive,
    # well inside the heartbeat timeout); the scheduler fetches for idle groups itself. At
    # 10 ms, three idle engines and their scheduler burned half a core between them.
    report_keepalive_s: float = 0.25
    # Upper bound of one wait on a peer (a transfer, the scheduler's first answer).
    peer_timeout_s: float = 30.0
    # On exit, how long pending store writes may take to finish. Past it they are abandoned
    # and the process exits anyway: a store that hangs (a cut-off network mount) must not
    # keep a stopped engine alive. The blocks are recomputed when next needed.
    store_flush_timeout_s: float = 10.0
    # The OpenAI URL of the vLLM server this engine runs in (``dualpath vllm-config --url``),
    # which the front door forwards requests to; "" for a ``dualpath engine`` process.
    url: str = ""

    def __post_init__(self) -> None:
        if self.role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {ENGINE_ROLES}, got {self.role!r}")
        for name in ("report_keepalive_s", "peer_timeout_s", "store_flush_timeout_s"):
            _require_positive(name, getattr(self, name))

    @property
    def transfer_timeout_s(self) -> float:
        """One wait on another engine's KV transfer: ``peer_timeout_s``, but at most half the
        heartbeat timeout. A PE blocked on a DE that vanished (its host cut off) then fails
        the batch and reports again before the scheduler takes it for dead too."""
        return min(self.peer_timeout_s, self.cluster.heartbeat_timeout_s / 2)


# --- configs as plain data --------------------------------------------------------------------


def config_to_dict(config: Any) -> dict[str, Any]:
    """A config and the configs inside it as JSON-ready values (paths as strings)."""
    return {field.name: _plain(getattr(config, field.name)) for field in dataclasses.fields(config)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return config_to_dict(value)
    if isinstance(value, Path):
        return str(value)
    return value


def config_from_dict(cls: type, data: dict[str, Any]) -> Any:
    """The ``cls`` config ``data`` describes (``config_to_dict``'s output or a hand-written
    subset: missing fields take their defaults). ``ValueError`` names a field ``cls`` does
    not have, or a value that is not what the field holds."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} must be given as an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}")
    return cls(**{name: _typed(cls, name, hints[name], value) for name, value in data.items()})


def _typed(cls: type, name: str, hint: Any, value: Any) -> Any:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        if dataclasses.is_dataclass(option) and isinstance(value, dict):
            return config_from_dict(option, value)
        if option is Path and isinstance(value, str):
            return Path(value)
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if option in (int, str, bool) and type(value) is option:
            return value
        if typing.get_origin(option) is dict and isinstance(value, dict):
            return value
    raise ValueError(f"{cls.__name__}.{name} cannot be {value!r} ({hint})")

"""Hardware and model profiles of the simulator, every number with its source.

Hardware (``HARDWARE``):

* ``hopper-8x400`` -- the paper's testbed (SPEC §1, §7): 8 Hopper GPUs per node, one 400 Gbps
  CNIC per GPU, one 400 Gbps SNIC per node, 3FS storage. GPU figures are NVIDIA's H800 SXM
  datasheet (989 TFLOPS dense BF16, 3.35 TB/s HBM3, 80 GB); host memory M = 500 GB/s per node
  is SPEC §5's example; the 3FS service bandwidth 6.6 TiB/s is 3FS's published aggregate read
  throughput (180 storage nodes).
* ``local`` -- this machine as ``dualpath bench offline`` runs it (one CPU process per engine),
  by name only: its link figures serve ``dualpath plan``'s §5 bounds. A simulation of this
  machine takes its measured costs and links from ``local.py`` (``RunSpec.local``), which
  replace these figures and the roofline model.

Models (``MODELS``): KV bytes per token per layer and layer counts from the public configs
(SPEC §7 "Model facts"); FLOPs from parameter counts (2 FLOPs per active parameter per token)
plus attention FLOPs per (query, key) pair per layer; sparse attention (DSA) attends to at
most ``attention_top_k_tokens`` keys plus an indexer over every cached key.

Your own cluster or model: a JSON file where a name goes (``resolve_hardware``,
``resolve_model``; ``dualpath plan --hardware my_cluster.json``), with every field of the
profile, or ``"base"`` (a built-in name) and the fields that differ::

    {"base": "hopper-8x400", "snic_bandwidth_gbps": 200, "num_gpus_per_node": 4}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from dualpath.units import gbps_to_bytes_per_s

P = TypeVar("P", "HardwareProfile", "ModelProfile")


def _require_positive(profile: HardwareProfile | ModelProfile, *names: str) -> None:
    for name in names:
        if not getattr(profile, name) > 0:
            raise ValueError(f"{profile.name}: {name} must be > 0, got {getattr(profile, name)}")


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One node type and its fabric. Rates in bytes/s unless the name says otherwise."""

    name: str
    num_gpus_per_node: int
    gpu_flops_per_s: float  # dense BF16 peak of one GPU
    gpu_memory_bytes_per_s: float  # HBM bandwidth of one GPU
    gpu_memory_bytes: float  # HBM capacity of one GPU
    cnic_bandwidth_gbps: float  # per GPU (east-west)
    snic_bandwidth_gbps: float  # per node (north-south)
    host_memory_bytes_per_s: float  # per node (SPEC §5's M)
    storage_service_bytes_per_s: float  # the whole store's read throughput
    # HBM kept for activations, workspace and the CUDA context, not usable for KV.
    gpu_reserved_bytes: float
    # Turns the front end admits per second, for the whole cluster (a deployment figure, kept
    # here so that a K-times smaller cluster admits K times fewer: its burst lasts as long).
    frontend_requests_per_s: float

    def __post_init__(self) -> None:
        _require_positive(
            self,
            "num_gpus_per_node",
            "gpu_flops_per_s",
            "gpu_memory_bytes_per_s",
            "gpu_memory_bytes",
            "cnic_bandwidth_gbps",
            "snic_bandwidth_gbps",
            "host_memory_bytes_per_s",
            "storage_service_bytes_per_s",
            "frontend_requests_per_s",
        )

    @property
    def cnic_bytes_per_s(self) -> float:
        return gbps_to_bytes_per_s(self.cnic_bandwidth_gbps)

    @property
    def snic_bytes_per_s(self) -> float:
        return gbps_to_bytes_per_s(self.snic_bandwidth_gbps)

    def scaled_down(self, factor: int) -> HardwareProfile:
        """A node with ``num_gpus_per_node / factor`` GPUs and 1/factor of the node-wide links
        (SNIC, host memory) and of the store's throughput: per-GPU ratios stay, so a K-times
        smaller cluster behaves alike."""
        if factor < 1 or self.num_gpus_per_node % factor:
            raise ValueError(
                f"scale-down {factor} must divide the {self.num_gpus_per_node} GPUs per node"
            )
        from dataclasses import replace

        return replace(
            self,
            name=f"{self.name}/{factor}",
            num_gpus_per_node=self.num_gpus_per_node // factor,
            snic_bandwidth_gbps=self.snic_bandwidth_gbps / factor,
            host_memory_bytes_per_s=self.host_memory_bytes_per_s / factor,
            storage_service_bytes_per_s=self.storage_service_bytes_per_s / factor,
            frontend_requests_per_s=self.frontend_requests_per_s / factor,
        )


TIB = float(1 << 40)

HARDWARE: dict[str, HardwareProfile] = {
    "hopper-8x400": HardwareProfile(
        name="hopper-8x400",
        num_gpus_per_node=8,
        gpu_flops_per_s=989e12,
        gpu_memory_bytes_per_s=3.35e12,
        gpu_memory_bytes=80e9,
        cnic_bandwidth_gbps=400.0,
        snic_bandwidth_gbps=400.0,
        host_memory_bytes_per_s=500e9,
        storage_service_bytes_per_s=6.6 * TIB,
        gpu_reserved_bytes=10e9,
        # NOTE(sim): an assumption; the paper gives no front-end figure. 10,000 turns/s is
        # 100 us a request, a fast front end (about 4x the 48P96D run's mean submit rate).
        # Only its order matters: between 1e4 and 1e6 per second a burst of agents starting
        # together reaches the scheduler over several fetch intervals, and no JCT ratio moves
        # by more than the runs' own noise (docs/simulator-analysis.md, "Scale").
        frontend_requests_per_s=10_000.0,
    ),
    # Order-of-magnitude figures of a 2-vCPU VM for the §5 bounds; simulations use the measured
    # profile of ``local.py`` instead.
    "local": HardwareProfile(
        name="local",
        num_gpus_per_node=1,
        gpu_flops_per_s=20e9,
        gpu_memory_bytes_per_s=5e9,
        gpu_memory_bytes=2e9,
        cnic_bandwidth_gbps=16.0,
        snic_bandwidth_gbps=8.0,
        host_memory_bytes_per_s=10e9,
        storage_service_bytes_per_s=2e9,
        gpu_reserved_bytes=0.5e9,
        # ~40 ms of front-end CPU a request (``sim_profile``'s measurement).
        frontend_requests_per_s=25.0,
    ),
}


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What the cost model needs of a model; per token, per layer, in bytes and FLOPs."""

    name: str
    num_layers: int
    kv_bytes_per_token_per_layer: int  # what the store keeps and the links move
    num_active_params: float  # per token (MoE: shared + routed experts used)
    num_total_params: float
    bytes_per_param: float  # weight precision
    is_moe: bool  # MoE weights are sharded over the expert-parallel group
    hidden_size: int
    # Attention FLOPs per (query, key) pair per layer (QK^T + PV).
    attention_flops_per_pair: float
    # Sparse attention: keys attended per query (None = dense causal attention).
    attention_top_k_tokens: int | None
    # DSA's lightning indexer: FLOPs per (query, cached key) pair per layer (0 = none).
    indexer_flops_per_pair: float
    # Bytes of the indexer keys per token per layer, read for every cached token in decode.
    indexer_bytes_per_token_per_layer: int
    # MoE dispatch + combine bytes per token per layer on the CNIC (inference class).
    all_to_all_bytes_per_token_per_layer: float
    source: str  # where the numbers come from

    def __post_init__(self) -> None:
        _require_positive(
            self,
            "num_layers",
            "kv_bytes_per_token_per_layer",
            "num_active_params",
            "num_total_params",
            "bytes_per_param",
            "hidden_size",
            "attention_flops_per_pair",
        )
        if self.num_active_params > self.num_total_params:
            raise ValueError(f"{self.name}: more active parameters than parameters")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_per_layer


MODELS: dict[str, ModelProfile] = {
    "deepseek-v3.2-660b": ModelProfile(
        name="deepseek-v3.2-660b",
        num_layers=61,
        # 656 B: FP8 MLA latent 512 + scales + BF16 rope 64 (SPEC §7). The 132 B indexer key
        # is not counted as stored or moved KV: with it, our FLOPs give cache-compute ratios of
        # 15-42 GB/PFLOP (16K-64K, append 429) against SPEC's 13-36 and "about 22"; without
        # it, 12.2-35.0 and 21.6 at 32K. Decode still reads it (``indexer_bytes_*`` below).
        kv_bytes_per_token_per_layer=656,
        num_active_params=37e9,
        num_total_params=671e9,
        bytes_per_param=1.0,  # FP8 weights
        is_moe=True,
        hidden_size=7168,
        # Absorbed MLA, 128 heads: QK over 512+64 dims, PV over 512 dims, 2 FLOPs per MAC.
        attention_flops_per_pair=128 * (576 + 512) * 2,
        attention_top_k_tokens=2048,
        indexer_flops_per_pair=64 * 128 * 2,  # 64 indexer heads x 128 dims
        # FP8 key 128 + one float32 scale: DeepSeek's indexer cache (tests/model/
        # test_deepseek_preset.py checks both byte sizes against the published config).
        indexer_bytes_per_token_per_layer=132,
        # 8 routed experts: FP8 dispatch (1 B) + BF16 combine (2 B) per hidden element.
        all_to_all_bytes_per_token_per_layer=7168 * 8 * 3,
        source="DeepSeek-V3.2-Exp config.json; SPEC §7 (656 B/token/layer + indexer keys)",
    ),
    "27b": ModelProfile(
        name="27b",
        num_layers=30,
        # SPEC §7's 27B (30 layers, hidden 2560, 32 heads, 72 routed experts, 6 active + 2
        # shared) is DeepSeek-VL2's language model (DeepSeekMoE 27B: MLA, kv_lora_rank 512,
        # rope 64, no q LoRA, expert FFN 1536, layer 0 dense with FFN 12288) with DSA on top.
        # Its cache format is assumed V3.2's (FP8 latent + scales + rope; SPEC gives no byte
        # size; DeepSeek-VL2 itself caches BF16, 1,152 B).
        kv_bytes_per_token_per_layer=656,
        # Per token, from that config: attention 30 x 31.9M (q 2560x32x192, kv_a 2560x576,
        # kv_b 512x32x256, o 4096x2560) + layer 0's FFN 3x2560x12288 + 29 MoE layers x 8
        # experts of 3x2560x1536 (+ router) = 3.79B; embeddings and the LM head (0.33B each,
        # the head run once a sequence in prefill) are left out.
        num_active_params=3.79e9,
        # 29 x 74 experts x 11.8M + attention + layer 0 + embeddings and head: 27.0B.
        num_total_params=27.0e9,
        bytes_per_param=1.0,
        is_moe=True,
        hidden_size=2560,
        attention_flops_per_pair=32 * (576 + 512) * 2,  # absorbed MLA, 32 heads (as V3.2)
        attention_top_k_tokens=1024,
        # The indexer's size is not published for this model: V3.2's (64 heads x 128).
        indexer_flops_per_pair=64 * 128 * 2,
        indexer_bytes_per_token_per_layer=132,
        all_to_all_bytes_per_token_per_layer=2560 * 6 * 3,  # 6 routed experts, FP8 + BF16
        source="SPEC §7 (30 layers, hidden 2560, 32 heads, 72 experts 6+2 active, top-k "
        "1024) = DeepSeek-VL2's language config + DSA; cache format and indexer assumed V3.2's",
    ),
    "qwen2.5-32b": ModelProfile(
        name="qwen2.5-32b",
        num_layers=64,
        kv_bytes_per_token_per_layer=2 * 8 * 128 * 2,  # K and V, 8 KV heads x 128, FP16
        num_active_params=32.5e9,
        num_total_params=32.5e9,
        bytes_per_param=2.0,
        is_moe=False,
        hidden_size=5120,
        attention_flops_per_pair=40 * 128 * 2 * 2,  # 40 query heads, QK + PV
        attention_top_k_tokens=None,
        indexer_flops_per_pair=0.0,
        indexer_bytes_per_token_per_layer=0,
        all_to_all_bytes_per_token_per_layer=0.0,
        source="Qwen2.5-32B config.json (64 layers, 8 KV heads x 128, FP16): 256 KB/token",
    ),
    # The engine's tiny test model, for the ``local`` profile (dualpath/model/presets.py).
    "tiny": ModelProfile(
        name="tiny",
        num_layers=4,
        kv_bytes_per_token_per_layer=2 * 2 * 32 * 4,  # K and V, 2 KV heads x 32, float32
        num_active_params=1.5e6,
        num_total_params=1.5e6,
        bytes_per_param=4.0,
        is_moe=False,
        hidden_size=128,
        attention_flops_per_pair=4 * 32 * 2 * 2,
        attention_top_k_tokens=None,
        indexer_flops_per_pair=0.0,
        indexer_bytes_per_token_per_layer=0,
        all_to_all_bytes_per_token_per_layer=0.0,
        source="dualpath/model/presets.py 'tiny' (4 layers, hidden 128, 2 KB KV/token)",
    ),
}


def resolve_hardware(value: str | HardwareProfile) -> HardwareProfile:
    """A hardware profile by built-in name, from a JSON file (module docstring), or as given."""
    return _resolve(value, HARDWARE, HardwareProfile, "hardware")


def resolve_model(value: str | ModelProfile) -> ModelProfile:
    """A model profile by built-in name, from a JSON file (module docstring), or as given."""
    return _resolve(value, MODELS, ModelProfile, "model")


def _resolve(value: str | P, builtins: dict[str, P], cls: type[P], kind: str) -> P:
    if not isinstance(value, str):
        return value
    if value in builtins:
        return builtins[value]
    path = Path(value)
    if path.suffix != ".json":
        raise ValueError(
            f"unknown {kind} {value!r}; choose from {', '.join(builtins)} or give a .json file"
        )
    try:
        given = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{kind} profile {path}: cannot be read: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{kind} profile {path}: not JSON: {exc}") from exc
    if not isinstance(given, dict):
        raise ValueError(f"{kind} profile {path}: expected a JSON object")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(given) - set(names) - {"base"})
    if unknown:
        raise ValueError(f"{kind} profile {path}: unknown fields {', '.join(unknown)}")
    fields: dict[str, object] = {"name": path.stem}
    if kind == "model":
        fields["source"] = str(path)
    if "base" in given:
        base = given.pop("base")
        if base not in builtins:
            raise ValueError(f"{kind} profile {path}: unknown base {base!r}")
        fields = dataclasses.asdict(builtins[base]) | {"name": path.stem}
    fields |= given
    missing = [name for name in names if name not in fields]
    if missing:
        raise ValueError(f'{kind} profile {path}: missing {", ".join(missing)} (or give a "base")')
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ValueError(f"{kind} profile {path}: {exc}") from exc

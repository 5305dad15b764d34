"""Cost models: how long a prefill batch and a decode step take on one GPU.

Two implementations of the same interface (STYLE: a constant model next to the real one):

* ``RooflineCostModel`` -- FLOPs and bytes from a ``ModelProfile`` over a ``HardwareProfile``'s
  peaks, scaled by ``EfficiencyFactors`` (the at most three fitted numbers, below);
* ``ConstantCostModel`` -- fixed seconds per token / per step, for hand-computable tests.

Prefill of a chunk with ``c`` cached and ``n`` new tokens on one GPU::

    FLOPs = n * 2 * active_params                                  (linear layers, MoE active)
          + L * attention_flops_per_pair * pairs(c, n)             (pairs = n*(c + n/2), or
                                                                    n*min(c + n/2, top_k) if sparse)
          + L * indexer_flops_per_pair * n*(c + n/2)               (DSA indexer; 0 if none)
    time  = FLOPs / (peak * prefill_efficiency) + weights_per_gpu / HBM bandwidth (once a step)

Decode step of ``b`` sequences with ``C`` context tokens in all on one GPU (memory-bound)::

    bytes = weights_per_gpu + sum over sequences of L * (min(ctx, top_k) * kv_bytes_per_layer
            + ctx * indexer_bytes_per_layer)
    time  = bytes / (HBM * decode_efficiency) + b * 2 * active_params / (peak * prefill_efficiency)

The predictor of one attention layer (for the scheduler's compute-quota batcher) is fitted
from this model by ``FittedAttentionTimePredictor.fit`` on a grid of batches, as the runtime
fits it from profiling (``fit_attention_predictor``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from dualpath.scheduler import AttentionProfileSample, FittedAttentionTimePredictor
from dualpath.sim.profiles import HardwareProfile, ModelProfile


@dataclass(frozen=True, slots=True)
class EfficiencyFactors:
    """The only fitted numbers of the roofline model (at most three, SPEC-independent).

    Fitted once on DeepSeek-V3.2 660B, 2P4D, 64K (``calibration.py``) and then frozen.
    """

    prefill_efficiency: float  # achieved / peak FLOPs of a prefill forward (MFU)
    decode_efficiency: float  # achieved / peak HBM bandwidth of a decode step
    storage_efficiency: float  # achieved / line rate of storage reads through an SNIC

    def __post_init__(self) -> None:
        for name in ("prefill_efficiency", "decode_efficiency", "storage_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")

    def __reduce__(self) -> tuple:
        # NOTE(sim): pickled through its constructor (specs and results cross to worker
        # processes, ``--jobs``): the compiled build's default unpickling sets the fields
        # one by one, which a frozen class refuses. So are ConstantCostModel and
        # cluster.RequestRecord.
        factors = (self.prefill_efficiency, self.decode_efficiency, self.storage_efficiency)
        return (EfficiencyFactors, factors)


class CostModel(Protocol):
    """Seconds of work on one GPU; pure and deterministic."""

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One forward over ``(num_cached_tokens, num_new_tokens)`` chunks (0.0 if empty)."""
        ...

    def attention_layer_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """The attention of one layer of that forward (the compute quota's unit, SPEC §6)."""
        ...

    def decode_step_s(self, num_seqs: int, num_context_tokens: int) -> float:
        """One decode step of ``num_seqs`` sequences holding ``num_context_tokens`` in all."""
        ...


@dataclass(frozen=True, slots=True)
class ConstantCostModel:
    """Fixed costs: per new prefill token, per prefill step, per decode step and per sequence."""

    prefill_s_per_new_token: float = 1e-4
    prefill_s_per_step: float = 0.0
    decode_s_per_step: float = 0.01
    decode_s_per_seq: float = 0.0

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        return self.prefill_s_per_step + self.prefill_s_per_new_token * sum(n for _, n in chunks)

    def attention_layer_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        return self.prefill_s(chunks) / 10  # a fixed share; only the batcher's quota uses it

    def decode_step_s(self, num_seqs: int, num_context_tokens: int) -> float:
        return self.decode_s_per_step + self.decode_s_per_seq * num_seqs

    def __reduce__(self) -> tuple:  # see EfficiencyFactors.__reduce__
        costs = (
            self.prefill_s_per_new_token,
            self.prefill_s_per_step,
            self.decode_s_per_step,
            self.decode_s_per_seq,
        )
        return (ConstantCostModel, costs)


@dataclass(frozen=True, slots=True)
class RooflineCostModel:
    """The module docstring's formulas for one model on one GPU type."""

    model: ModelProfile
    hardware: HardwareProfile
    factors: EfficiencyFactors
    weight_bytes_per_gpu: float  # the GPU's shard of the weights (see ``weight_shard_bytes``)

    def _attention_flops(self, num_cached: int, num_new: int) -> float:
        model = self.model
        mean_keys = num_cached + num_new / 2
        keys = mean_keys
        if model.attention_top_k_tokens is not None:
            keys = min(mean_keys, model.attention_top_k_tokens)
        return num_new * (
            model.attention_flops_per_pair * keys + model.indexer_flops_per_pair * mean_keys
        )

    def attention_layer_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        flops = sum(self._attention_flops(c, n) for c, n in chunks)
        return flops / (self.hardware.gpu_flops_per_s * self.factors.prefill_efficiency)

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        model = self.model
        linear_flops = 2 * model.num_active_params * sum(n for _, n in chunks)
        attention_s = model.num_layers * self.attention_layer_s(chunks)
        peak = self.hardware.gpu_flops_per_s * self.factors.prefill_efficiency
        weights_s = self.weight_bytes_per_gpu / self.hardware.gpu_memory_bytes_per_s
        return linear_flops / peak + attention_s + weights_s

    def decode_step_s(self, num_seqs: int, num_context_tokens: int) -> float:
        if num_seqs == 0:
            return 0.0
        # Called at every decode membership change: the same operations in the same order as
        # the formulas, with the attribute look-ups done once (and min() spelled out).
        model = self.model
        hardware = self.hardware
        factors = self.factors
        mean_context = num_context_tokens / num_seqs
        keys = mean_context
        top_k = model.attention_top_k_tokens
        if top_k is not None and top_k < mean_context:
            keys = float(top_k)  # (a float for mypyc: the same products, below 2**53)
        num_layers = model.num_layers
        kv_bytes = num_seqs * num_layers * keys * model.kv_bytes_per_token_per_layer
        index_bytes = num_context_tokens * num_layers * model.indexer_bytes_per_token_per_layer
        memory_s = (self.weight_bytes_per_gpu + kv_bytes + index_bytes) / (
            hardware.gpu_memory_bytes_per_s * factors.decode_efficiency
        )
        compute_s = (
            2
            * model.num_active_params
            * num_seqs
            / (hardware.gpu_flops_per_s * factors.prefill_efficiency)
        )
        return memory_s + compute_s


# NOTE(sim): MoE weights are sharded over an expert-parallel group of at most this many GPUs
# (DeepSeek's published prefill deployment is EP32); a dense model is replicated per GPU.
MAX_EXPERT_PARALLEL_GPUS = 32


def weight_shard_bytes(model: ModelProfile, num_role_gpus: int) -> float:
    """Bytes of weights one GPU of a role (prefill or decode) holds."""
    total_bytes = model.num_total_params * model.bytes_per_param
    if not model.is_moe:
        return total_bytes
    return total_bytes / min(num_role_gpus, MAX_EXPERT_PARALLEL_GPUS)


def kv_capacity_bytes(hardware: HardwareProfile, weight_bytes_per_gpu: float) -> float:
    """HBM left for KV on one GPU; ``ValueError`` if the weights do not fit."""
    free = hardware.gpu_memory_bytes - hardware.gpu_reserved_bytes - weight_bytes_per_gpu
    if free <= 0:
        raise ValueError(
            f"{weight_bytes_per_gpu / 1e9:.1f} GB of weights leave no KV memory on a "
            f"{hardware.gpu_memory_bytes / 1e9:.0f} GB GPU ({hardware.name})"
        )
    return free


def fit_attention_predictor(
    cost_model: CostModel, *, max_context_tokens: int
) -> FittedAttentionTimePredictor:
    """The scheduler's predictor, fitted to ``cost_model.attention_layer_s`` on a grid of batches
    (what the runtime does with measured times, ``engine/profile.py``)."""
    samples = []
    contexts = [0, max_context_tokens // 8, max_context_tokens // 2, max_context_tokens]
    for num_chunks in (1, 4, 16):
        for cached in contexts:
            for new in (64, 512, 4096):
                chunks = ((cached, new),) * num_chunks
                samples.append(AttentionProfileSample(chunks, cost_model.attention_layer_s(chunks)))
    return FittedAttentionTimePredictor.fit(samples)

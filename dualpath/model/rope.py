"""Rotary position embedding: the inverse frequencies of each rope type we support.

Each function repeats ``transformers.modeling_rope_utils`` (5.24) operation for operation, in
the same dtype and order, so the angles, and with them the logits, are bit-identical to the
reference implementation's (tests/model/test_rope.py compares them).
"""

from __future__ import annotations

import math

import torch

from dualpath.model.config import ModelConfig, RopeConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """float32 ``[head_dim // 2]``: how many radians dimension pair i turns per position."""
    rope, dim = config.rope, config.head_dim
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, dim)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, inv_freq)
    return inv_freq


def _llama3_inv_freq(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    factor, old_context_len = rope.factor, rope.original_max_position_embeddings
    low_freq_factor, high_freq_factor = rope.low_freq_factor, rope.high_freq_factor
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: dims that turn fewer than ``beta_slow`` times over the pre-training context are
    interpolated (slowed by ``factor``), those turning more than ``beta_fast`` times are kept,
    with a linear ramp between. The attention factor is applied to cos/sin by the caller."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (rope.factor * pos_freqs)
    low, high = _yarn_correction_range(rope, dim)
    # Written as transformers has it (1 - (1 - ramp), not ramp) to round the same way.
    inv_freq_extrapolation_factor = 1 - _linear_ramp(low, high, dim // 2)
    return (
        inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
        + inv_freq_extrapolation * inv_freq_extrapolation_factor
    )


def _yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    """The dims (as pair indices) where the ramp from kept to interpolated runs."""

    def correction_dim(num_rotations: float) -> float:
        context = rope.original_max_position_embeddings
        return (dim * math.log(context / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, num_dims: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # as transformers: avoid dividing by zero
    ramp = (torch.arange(num_dims, dtype=torch.float32) - low) / (high - low)
    return torch.clamp(ramp, 0, 1)

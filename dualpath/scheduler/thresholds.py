"""α and β of SPEC §6, derived from measured rates unless ``SchedulerConfig`` fixes them."""

from __future__ import annotations

import math

from dualpath.config import SchedulerConfig


def resolve_alpha_tokens(config: SchedulerConfig, storage_read_tokens_per_s: float) -> int:
    """α for a node whose storage reads run at ``storage_read_tokens_per_s`` (SPEC §6)."""
    if config.alpha_tokens is not None:
        return config.alpha_tokens
    return math.floor(config.alpha_window_s * storage_read_tokens_per_s)


def resolve_beta_tokens(config: SchedulerConfig) -> int:
    """β for one prefill GPU (SPEC §6); ``ValueError`` when neither a rate nor β is given."""
    if config.beta_tokens is not None:
        return config.beta_tokens
    if config.prefill_tokens_per_s is None:
        raise ValueError(
            "the dualpath scheduler needs beta_tokens or a profiled prefill_tokens_per_s "
            "(beta = tokens one GPU prefills in beta_window_s)"
        )
    return math.floor(config.beta_window_s * config.prefill_tokens_per_s)

"""Random weights for the checkpoints the parity tests write with transformers."""

from __future__ import annotations

import torch


def randomize_weights(model: torch.nn.Module) -> None:
    """Norms near 1 so attention is sharp enough for positions to matter, a final norm near 10
    so logits spread (std ~20) and greedy picks win by wide margins rather than flip on
    rounding, and every other weight N(0, 0.2)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.norm.weight":
                param.normal_(10.0, 2.0)
            elif name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.2)

"""DeepSeek-V3's feed-forward layers: the dense MLP of its first layers, and the MoE of the
rest (a router with V3's ``noaux_tc`` routing, the routed experts stacked as transformers holds
them, a shared expert), plus the stacking of a checkpoint's per-expert weights on load."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dualpath.errors import CheckpointError
from dualpath.model.deepseek_config import DeepseekConfig

Device = torch.device | str | None


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, device: Device = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """V3's ``noaux_tc`` routing, in float32: sigmoid scores; the choice adds a per-expert bias
    and keeps the ``topk_group`` groups whose top two biased scores sum highest; the weights are
    the unbiased scores of the chosen experts, renormalised (``norm_topk_prob``) and scaled."""

    def __init__(self, config: DeepseekConfig, device: Device = None) -> None:
        super().__init__()
        num_experts, h = config.num_routed_experts, config.hidden_size
        self.top_k, self.num_groups = config.num_experts_per_tok, config.num_expert_groups
        self.topk_groups, self.norm_topk_prob = config.num_topk_groups, config.norm_topk_prob
        self.scaling_factor = config.routed_scaling_factor
        # float32 in any model dtype, as transformers keeps them (_keep_in_fp32_modules_strict)
        self.weight = nn.Parameter(torch.empty(num_experts, h, dtype=torch.float32, device=device))
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, top_k] float32 weights, [T, top_k] expert ids) per token."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(x.shape[0], self.num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        groups = group_scores.topk(self.topk_groups, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        kept = kept[:, :, None].expand(-1, -1, choice.shape[1] // self.num_groups)
        choice = choice.masked_fill(~kept.reshape(choice.shape), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling_factor, experts


class Experts(nn.Module):
    """The routed experts' weights stacked as transformers holds them: ``gate_up_proj``
    [E, 2 * I, H] (gate rows, then up rows) and ``down_proj`` [E, H, I]."""

    def __init__(self, config: DeepseekConfig, device: Device = None) -> None:
        super().__init__()
        e, h, i = config.num_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, device=device))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, device=device))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Each expert runs once over the tokens that chose it, in increasing expert order (the
        order transformers sums them in)."""
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            tokens, slots = torch.where(experts == expert)
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, (y * weights[tokens, slots, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, config: DeepseekConfig, device: Device = None) -> None:
        super().__init__()
        self.experts = Experts(config, device)
        self.gate = Router(config, device)
        shared_size = config.moe_intermediate_size * config.num_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared_size, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x)) + self.shared_experts(x)


_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_expert_weights(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert weights (``...mlp.experts.{e}.gate_proj.weight``, as DeepSeek
    publishes them and transformers' ``save_pretrained`` writes them) stacked into this module's
    ``experts.gate_up_proj`` / ``experts.down_proj``; every other tensor passes unchanged."""
    out: dict[str, torch.Tensor] = {}
    per_prefix: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        match = _EXPERT_KEY.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        per_prefix.setdefault(prefix, {}).setdefault(proj, {})[expert] = tensor
    for prefix, projs in per_prefix.items():
        num_experts = len(projs.get("down_proj", {}))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if sorted(projs.get(proj, {})) != list(range(num_experts)):
                raise CheckpointError(
                    f"{prefix}: {proj} is not given for experts 0..{num_experts - 1}"
                )
        stack = {proj: torch.stack([projs[proj][e] for e in range(num_experts)]) for proj in projs}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return out

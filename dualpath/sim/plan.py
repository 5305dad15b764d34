"""The P/D advisor (``dualpath plan``): SPEC §5's bottleneck-free range, then simulated shapes.

For a number of nodes it simulates every split into P prefill and D decode nodes and ranks
them by throughput per GPU (agent turns per second per GPU); the §5 range says which splits
keep every link below capacity under balanced load.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.sim.profiles import HardwareProfile, ModelProfile, resolve_hardware, resolve_model
from dualpath.sim.runner import RunSpec, map_runs, run_simulation
from dualpath.transfer.links import bottleneck_free_pd_range


@dataclass(frozen=True, slots=True)
class PlanAdvice:
    best_nodes: str
    pd_range: tuple[float, float]
    lines: tuple[str, ...]
    # One per simulated split: nodes, jct_s, turns_per_s_per_gpu, pd_ratio, inside_pd_range.
    candidates: tuple[dict, ...] = ()

    def as_dict(self, **context: object) -> dict:
        """For ``dualpath plan --json``: ``context`` (what was planned for) first."""
        low, high = self.pd_range
        return context | {
            "pd_range": [round(low, 4), round(high, 4)],
            "candidates": list(self.candidates),
            "recommended": self.best_nodes,
        }


def recommend_pd(
    *,
    model: str | ModelProfile,
    hardware: str | HardwareProfile,
    total_nodes: int,
    num_agents: int,
    preset: str,
    mode: str = "dualpath",
    scale_down: int = 1,
    quota_per_forward: bool = False,
    progress: bool = False,
    jobs: int = 1,
) -> PlanAdvice:
    """Simulate every P + D = ``total_nodes`` and return the best by turns/s per GPU;
    ``quota_per_forward`` reads SPEC §6's quota as a whole forward, with its own factors;
    ``progress`` shows progress bars on stderr; ``jobs`` > 1 simulates the shapes that many
    at a time in worker processes (``runner.map_runs``)."""
    if total_nodes < 2:
        raise ValueError(f"need at least 2 nodes (one per role), got {total_nodes}")
    profile = resolve_hardware(hardware)
    model = resolve_model(model)
    low, high = bottleneck_free_pd_range(
        profile.num_gpus_per_node,
        profile.snic_bandwidth_gbps / profile.cnic_bandwidth_gbps,
        profile.host_memory_bytes_per_s,
        profile.cnic_bytes_per_s,
    )
    lines = [f"SPEC §5 bottleneck-free P/D range on {profile.name}: {low:.3f} .. {high:.3f}"]
    shapes = [f"{p}P{total_nodes - p}D" for p in range(1, total_nodes)]
    specs = [
        RunSpec(
            model=model,
            hardware=profile,
            nodes=nodes,
            num_agents=num_agents,
            preset=preset,
            mode=mode,
            scale_down=scale_down,
            quota_per_forward=quota_per_forward,
        )
        for nodes in shapes
    ]
    results = map_runs(run_simulation, [(spec,) for spec in specs], jobs=jobs, progress=progress)
    best = None
    candidates = []
    for num_prefill, nodes, result in zip(range(1, total_nodes), shapes, results, strict=True):
        num_gpus = total_nodes * profile.num_gpus_per_node // scale_down
        per_gpu = result.num_requests / result.jct_s / num_gpus
        ratio = num_prefill / (total_nodes - num_prefill)
        inside = "inside" if low <= ratio <= high else "outside"
        lines.append(
            f"{nodes}: JCT {result.jct_s:.0f} s, {per_gpu:.4f} turns/s/GPU (P/D {ratio:.2f}, "
            f"{inside} the §5 range)"
        )
        candidates.append(
            {
                "nodes": nodes,
                "jct_s": round(result.jct_s, 3),
                "turns_per_s_per_gpu": round(per_gpu, 6),
                "pd_ratio": round(ratio, 4),
                "inside_pd_range": inside == "inside",
            }
        )
        if best is None or per_gpu > best[1]:
            best = (nodes, per_gpu)
    lines.append(f"recommended: {best[0]} ({best[1]:.4f} turns/s/GPU)")
    return PlanAdvice(best[0], (low, high), tuple(lines), tuple(candidates))

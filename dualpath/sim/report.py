"""Writing an experiment's results: the printed table, the JSON and the PNG (Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path

from dualpath import compiled
from dualpath.sim.experiments import ExperimentResult


def result_json(results: list[ExperimentResult], wall_s: float) -> dict:
    """``wall_s``, ``events_per_s``, every run and every check (SPEC §7 figures as printed)."""
    num_events = sum(r.num_events for r in results)
    sim_wall_s = sum(r.sim_wall_s for r in results)
    return {
        "wall_s": round(wall_s, 3),
        "events_per_s": round(num_events / sim_wall_s) if sim_wall_s > 0 else None,
        # Speeds depend on it: the mypyc build (``make compiled``) or the Python sources.
        "compiled": compiled.is_active(),
        "cost_model": "roofline (dualpath.sim.cost.RooflineCostModel), factors in "
        "dualpath/sim/calibration.py",
        "runs": [run for r in results for run in r.runs],
        "checks": [check.as_dict() for r in results for check in r.checks],
    }


def format_table(result: ExperimentResult) -> str:
    lines = [f"== {result.name} =="]
    lines += result.table
    for check in result.checks:
        verdict = "ok" if check.ok else "MISS"
        lines.append(
            f"check {check.name}: paper {check.paper} ours {check.ours:.3f} "
            f"(+-{check.tolerance}) {verdict}"
        )
    return "\n".join(lines)


def write_png(results: list[ExperimentResult], path: Path) -> None:
    """One bar chart: every run's JCT by label (a figure to set beside the paper's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for r in results for run in r.runs if run["jct_s"] is not None]
    labels = [f"{r['nodes']} {r['agents']} {r['max_len'] // 1024}K\n{r['mode']}" for r in runs]
    values = [r["jct_s"] for r in runs]
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(runs)), 4))
    axis.bar(range(len(runs)), values, color="tab:blue")
    axis.set_xticks(range(len(runs)), labels, fontsize=6)
    axis.set_ylabel("JCT (s, simulated)")
    axis.set_title(", ".join(r.name for r in results))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")

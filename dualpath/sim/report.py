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
    """The runs' JCTs (bars), the checks as ours / paper inside the tolerance band (a figure
    to set beside the paper's: green ok, red missed) and, for online capacity, each search's
    p90 TTFT against APS with the SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for r in results for run in r.runs if run["jct_s"] is not None]
    checks = [check for r in results for check in r.checks]
    probes = [run for r in results for run in r.runs if "aps" in run]
    panels = [
        draw
        for draw, items in ((_draw_jcts, runs), (_draw_checks, checks), (_draw_probes, probes))
        if items
    ]
    if not panels:
        raise ValueError("nothing to plot: no run with a JCT, no check, no online probe")
    width = max(6.0, 0.9 * len(runs), 0.6 * len(checks))
    figure, axes = plt.subplots(
        len(panels), 1, figsize=(min(width, 40.0), 4.2 * len(panels)), squeeze=False
    )
    for draw, axis in zip(panels, axes[:, 0], strict=True):
        draw(axis, runs=runs, checks=checks, probes=probes)
    figure.suptitle(", ".join(r.name for r in results))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _draw_jcts(axis, *, runs: list[dict], **_) -> None:
    labels = [f"{r['nodes']} {r['agents']} {r['max_len'] // 1024}K\n{r['mode']}" for r in runs]
    axis.bar(range(len(runs)), [r["jct_s"] for r in runs], color="tab:blue")
    axis.set_xticks(range(len(runs)), labels, fontsize=6)
    axis.set_ylabel("JCT (s, simulated)")


def _draw_checks(axis, *, checks: list, **_) -> None:
    """Each check as ours / paper; the grey bar is the tolerance around the paper's 1.0."""
    for x, check in enumerate(checks):
        low = (check.paper - check.tolerance) / check.paper
        high = (check.paper + check.tolerance) / check.paper
        axis.bar(x, high - low, bottom=low, width=0.6, color="0.85")
        color = "tab:green" if check.ok else "tab:red"
        axis.plot(x, check.ours / check.paper, "o", color=color)
    axis.axhline(1.0, color="0.4", linewidth=0.8)
    axis.set_xticks(
        range(len(checks)), [c.name for c in checks], rotation=30, ha="right", fontsize=6
    )
    axis.set_ylabel("ours / paper")


def _draw_probes(axis, *, probes: list[dict], **_) -> None:
    from dualpath.sim.online import SLO_TTFT_S

    top = 3 * SLO_TTFT_S  # a violation by timeout (inf) is drawn at the top
    searches: dict[tuple[str, str, str], list[dict]] = {}
    for probe in probes:
        searches.setdefault((probe["model"], probe["nodes"], probe["mode"]), []).append(probe)
    for (model, nodes, mode), found in searches.items():
        found = sorted(found, key=lambda p: p["aps"])
        ttfts = [min(p["p90_ttft_s"], top) for p in found]
        axis.plot([p["aps"] for p in found], ttfts, "o-", label=f"{model} {nodes} {mode}")
    axis.axhline(SLO_TTFT_S, color="tab:red", linestyle="--", linewidth=0.8, label="SLO")
    axis.set_xscale("log")
    axis.set_xlabel("agents per second")
    axis.set_ylabel("p90 TTFT (s), second half")
    axis.legend(fontsize=6)


def write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")

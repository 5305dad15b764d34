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
        "dualpath/sim/efficiency.py",
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


_COLORS = [f"tab:{c}" for c in ("blue", "orange", "green", "purple", "brown", "olive", "cyan")]


def write_png(results: list[ExperimentResult], path: Path) -> None:
    """The checks as ours / paper inside their tolerance bands (a figure to set beside the
    paper's: green ok, red missed), the runs' JCTs grouped by experiment and, for online
    capacity, each search's p90 TTFT against APS with the SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(r.name, [run for run in r.runs if run["jct_s"] is not None]) for r in results]
    groups = [(name, runs) for name, runs in groups if runs]
    # A check two experiments make (the calibration target under offline-jct and scale) once.
    checks = list({check.name: check for r in results for check in r.checks}.values())
    probes = [run for r in results for run in r.runs if "aps" in run]
    num_runs = sum(len(runs) for _, runs in groups)
    panels = [
        (draw, height)
        for draw, items, height in (
            (_draw_checks, checks, 1.2 + 0.32 * len(checks)),
            (_draw_jcts, groups, 4.6),
            (_draw_probes, probes, 4.2),
        )
        if items
    ]
    if not panels:
        raise ValueError("nothing to plot: no run with a JCT, no check, no online probe")
    width = min(max(8.0, 0.75 * num_runs), 36.0)
    figure, axes = plt.subplots(
        len(panels),
        1,
        figsize=(width, sum(height for _, height in panels)),
        squeeze=False,
        gridspec_kw={"height_ratios": [height for _, height in panels]},
    )
    for (draw, _), axis in zip(panels, axes[:, 0], strict=True):
        draw(axis, groups=groups, checks=checks, probes=probes)
    figure.suptitle(", ".join(r.name for r in results))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _run_label(run: dict) -> str:
    model = {"deepseek-v3.2-660b": "660B"}.get(run["model"], run["model"])
    label = f"{model} {run['nodes']} {run['agents']} x {run['max_len'] // 1024}K {run['mode']}"
    if run.get("append_factor", 1) != 1:
        label += f", append x{run['append_factor']}"
    return label


def _draw_jcts(axis, *, groups: list[tuple[str, list[dict]]], **_) -> None:
    """One bar per run, coloured and labelled by experiment (a run two experiments share
    stands under both)."""
    x = 0
    ticks, labels = [], []
    for index, (name, runs) in enumerate(groups):
        xs = list(range(x, x + len(runs)))
        color = _COLORS[index % len(_COLORS)]
        axis.bar(xs, [r["jct_s"] for r in runs], color=color, label=name)
        ticks += xs
        labels += [_run_label(r) for r in runs]
        x += len(runs) + 1  # a gap between experiments
    axis.set_xticks(ticks, labels, fontsize=6.5, rotation=35, ha="right")
    axis.set_xlim(-0.8, x - 1.2)
    axis.set_ylabel("JCT (s, simulated)")
    if len(groups) > 1:
        axis.legend(fontsize=7, ncols=min(len(groups), 7), loc="upper left")


def _draw_checks(axis, *, checks: list, **_) -> None:
    """One row per check: ours / paper as a dot, the grey bar the tolerance around 1.0, and
    both figures written beside it."""
    rows = range(len(checks) - 1, -1, -1)  # the first check on top
    for y, check in zip(rows, checks, strict=True):
        low = (check.paper - check.tolerance) / check.paper
        high = (check.paper + check.tolerance) / check.paper
        axis.barh(y, high - low, left=low, height=0.6, color="0.85")
        color = "tab:green" if check.ok else "tab:red"
        axis.plot(check.ours / check.paper, y, "o", color=color)
        verdict = ("ok" if check.ok else "missed") + (
            " (the fitted target)" if check.fitted else ""
        )
        axis.annotate(
            f"ours {check.ours:.4g}, paper {check.paper:g} ± {check.tolerance:.3g}: {verdict}",
            (1.0, y),
            xycoords=("axes fraction", "data"),
            xytext=(6, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
            color=color,
        )
    axis.axvline(1.0, color="0.4", linewidth=0.8)
    axis.set_yticks(list(rows), [c.name for c in checks], fontsize=7)
    axis.set_ylim(-0.7, len(checks) - 0.3)
    axis.set_xlabel("ours / paper (grey: the tolerance)")


def _draw_probes(axis, *, probes: list[dict], **_) -> None:
    from dualpath.sim.online import SLO_TTFT_S

    top = 3 * SLO_TTFT_S  # a violation by timeout (inf) is drawn at the top
    # A search two experiments share (online-capacity's 660B DualPath one is scale's 2P4D one)
    # is recorded under both: each probe once.
    searches: dict[tuple[str, str, str], dict[float, dict]] = {}
    for probe in probes:
        key = (probe["model"], probe["nodes"], probe["mode"])
        searches.setdefault(key, {})[probe["aps"]] = probe
    for (model, nodes, mode), by_aps in searches.items():
        found = [by_aps[aps] for aps in sorted(by_aps)]
        ttfts = [min(p["p90_ttft_s"], top) for p in found]
        axis.plot([p["aps"] for p in found], ttfts, "o-", label=f"{model} {nodes} {mode}")
    axis.axhline(SLO_TTFT_S, color="tab:red", linestyle="--", linewidth=0.8, label="SLO")
    axis.set_xscale("log")
    axis.set_xlabel("agents per second")
    axis.set_ylabel("p90 TTFT (s), second half")
    axis.legend(fontsize=6)


def write_json(data: dict, path: Path) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")

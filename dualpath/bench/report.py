"""The benchmarks' Markdown summary and PNG plots (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dualpath.bench.hardware import machine_line
from dualpath.bench.stats import ideal_speedup
from dualpath.bench.validity import invalid_message
from dualpath.options import add_json_argument


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _percentiles(values: dict | None, spec: str, scale: float = 1.0) -> str:
    """``p50 / p90 / p99`` of a ``stats.percentiles`` dict."""
    values = values or {}
    return " / ".join(
        _fmt(None if values.get(q) is None else values[q] * scale, spec)
        for q in ("p50", "p90", "p99")
    )


def markdown_table(report: dict) -> str:
    """One row per mode: JCT, each agent's JCT, throughput, latency percentiles, hits (against
    the workload's bound), reads, balance, failures."""
    bound = (report.get("workload") or {}).get("ideal_hit_ratio")
    hit = "hit" if bound is None else f"hit (bound {bound:.1%})"
    lines = [
        f"| mode | JCT s | agent JCT p50/p90/p99 s | tok/s | TTFT p50/p90/p99 s "
        f"| TPOT p50/p90 ms | {hit} | PE / DE read MB | SNIC max/avg (reads only; busy) | PE busy "
        "| failed | tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["modes"].items():
        path = r.get("path_bytes")
        reads = "–" if path is None else f"{path['pe'] / 1e6:.1f} / {path['de'] / 1e6:.1f}"
        tpot = r["tpot_s"]
        tpot_ms = [None if v is None else v * 1e3 for v in (tpot["p50"], tpot["p90"])]
        mismatches = r.get("token_mismatches")
        lines.append(
            f"| {mode} | {r['jct_s']:.2f} | {_percentiles(r.get('agent_jct_s'), '.1f')} "
            f"| {r['tokens_per_s']:.0f} | {_percentiles(r['ttft_s'], '.3f')} "
            f"| {_fmt(tpot_ms[0], '.1f')} / {_fmt(tpot_ms[1], '.1f')} "
            f"| {r['hit_ratio']:.1%} | {reads} | {_fmt(r.get('snic_load_balance'), '.2f')} "
            f"({_fmt(r.get('snic_read_load_balance'), '.2f')}; "
            f"{_fmt(r.get('snic_load_balance_busy'), '.2f')}) "
            f"| {_fmt(r.get('pe_busy_fraction'), '.0%')} "
            f"| {r.get('num_failed', 0)} of {r['num_requests']} "
            f"| {'–' if mismatches is None else ('same' if mismatches == 0 else f'{mismatches} differ')} |"
        )
    return "\n".join(lines)


def cpu_lines(run: dict) -> str:
    """Per mode, the cores each process kept busy over the run (``process_cpu.py``): on one
    host they share its cores, so a mode near their count is bound by CPU."""
    lines = []
    for mode, r in run["modes"].items():
        cpu = r.get("process_cpu")
        if not cpu:
            continue
        each = ", ".join(f"{label} {cores:.2f}" for label, cores in cpu["cores"].items())
        lines.append(
            f"- {mode}: {each}, client {cpu['client_cores']:.2f}; "
            f"total {cpu['total_cores']:.2f} of {cpu['machine_cores']} cores"
        )
    return "CPU cores busy (mean over the run):\n" + "\n".join(lines) if lines else ""


def first_token_lines(run: dict) -> str:
    """Per mode, the mean of each stage of the first token's path the server reported
    (``first_token_stages_s``): its TTFT, then the scheduler's stages within it."""
    lines = []
    for mode, r in run["modes"].items():
        stages = r.get("first_token_stages_s")
        if stages:
            lines.append(f"- {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))
    if not lines:
        return ""
    return "First token, mean seconds (the server's TTFT; the scheduler's stages):\n" + "\n".join(
        lines
    )


def write_markdown(report: dict, path: Path | None) -> str:
    """The summary as Markdown (returned, and written to ``path`` if given)."""
    runs = report.get("runs", [report])
    parts = []
    if report.get("valid") is False:
        parts.append(
            "**INVALID RUN: no figure below is a result, and no ratio is given.**\n\n"
            + "\n".join(f"- {problem}" for problem in report["problems"])
        )
    for run in runs:
        head = f"## {run['benchmark']} · preset {run.get('preset')}"
        if run.get("rho") is not None:
            head += (
                f" · rho {run['rho']:g} (SNIC cap {run['snic_caps_gbps']:.3f} Gbps per node, "
                f"ideal speedup {run['ideal_speedup']:.2f})"
            )
        parts.append(head)
        machine = machine_line(run.get("hardware") or report.get("hardware"))
        if machine:
            parts.append(machine)
        parts.append(markdown_table(run))
        for extra in (cpu_lines(run), first_token_lines(run)):
            if extra:
                parts.append(extra)
        if run.get("slo") is not None:
            slo = run["slo"]
            parts.append(
                f"SLO: TTFT <= {slo['ttft_s']:.3f} s, TPOT <= {slo['tpot_s'] * 1e3:.1f} ms "
                f"({slo['source']}). "
                + "; ".join(
                    f"{mode}: "
                    + ", ".join(
                        f"{p['aps']:.3g} APS {'ok' if p['slo_attained'] else 'miss'}"
                        + ("" if p.get("cpu_cores") is None else f" ({p['cpu_cores']:.2f} cores)")
                        for p in r["probes"]
                    )
                    + (f" -> capacity {r['capacity_aps']:.3g} APS" if r["capacity_aps"] else "")
                    for mode, r in run["modes"].items()
                )
            )
        if run.get("ratios"):
            parts.append(
                "ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(run["ratios"].items()))
            )
    text = "\n\n".join(parts) + "\n"
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--out-dir``: where ``write_outputs`` writes a benchmark's result."""
    add_json_argument(parser)
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="write the Markdown summary and PNG plots here (default: beside --json)",
    )


def write_outputs(
    report: dict, *, json_path: Path | None, out_dir: Path | None, default_stem: str
) -> None:
    """A benchmark's outputs: the JSON at ``json_path``; the Markdown summary printed and,
    with the PNG plots, written to ``out_dir`` (default: beside the JSON)."""
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    out_dir = out_dir or (json_path.parent if json_path is not None else None)
    stem = json_path.stem if json_path is not None else default_stem
    print(write_markdown(report, None if out_dir is None else out_dir / f"{stem}.md"))
    if out_dir is not None:
        for path in write_plots(report, out_dir, stem):
            print(f"wrote {path}")


def _save(plt, figure, path: Path) -> Path:  # noqa: ANN001 (matplotlib's, imported lazily)
    """``figure`` laid out and written to ``path`` as a PNG, then closed."""
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_plots(report: dict, out_dir: Path, stem: str) -> list[Path]:
    """JCT by mode, and for a rho sweep the measured speedup against the ideal one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    runs = report.get("runs", [report])
    run = runs[0]
    modes = list(run["modes"])
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.bar(modes, [run["modes"][m]["jct_s"] for m in modes], color="#4472c4")
    axis.set_ylabel("JCT (s)")
    regime = run.get("regime")
    axis.set_title(f"{run['benchmark']} · {regime or run.get('preset')}")
    written.append(_save(plt, figure, out_dir / f"{stem}_jct.png"))
    if regime:  # bench vs-vllm --regime: each system's first-token latency and hits too
        figure, (ttft_axis, hit_axis) = plt.subplots(1, 2, figsize=(10, 3.5))
        for q, color in (("p50", "#4472c4"), ("p90", "#a5a5a5")):
            ttft_axis.bar(
                [f"{m}\n{q}" for m in modes],
                [run["modes"][m]["ttft_s"][q] for m in modes],
                color=color,
                label=q,
            )
        ttft_axis.set_ylabel("TTFT (s)")
        ttft_axis.tick_params(axis="x", labelsize=7, labelrotation=30)
        hit_axis.bar(modes, [run["modes"][m]["hit_ratio"] for m in modes], color="#4472c4")
        hit_axis.axhline(run["workload"]["ideal_hit_ratio"], color="k", ls="--", label="bound")
        hit_axis.set_ylabel("prompt tokens cached")
        hit_axis.tick_params(axis="x", labelsize=7, labelrotation=30)
        hit_axis.legend()
        figure.suptitle(f"{run['benchmark']} · {regime}")
        written.append(_save(plt, figure, out_dir / f"{stem}_latency.png"))
    timelines = {m: r["snic_timeline"] for m, r in run["modes"].items() if r.get("snic_timeline")}
    if timelines:
        figure, axes = plt.subplots(
            len(timelines), 1, figsize=(7, 2.2 * len(timelines)), sharex=True, squeeze=False
        )
        for axis, (mode, timeline) in zip(axes[:, 0], timelines.items(), strict=True):
            for name, rates in timeline["gbps"].items():
                axis.plot(timeline["time_s"], rates, label=name)
            cap = run.get("snic_caps_gbps")
            if cap:
                axis.axhline(cap, color="grey", linestyle=":", label="cap")
            axis.set_title(mode, fontsize=9)
            axis.set_ylabel("Gbps")
        axes[0, 0].legend(fontsize=7, loc="upper right")
        axes[-1, 0].set_xlabel("time (s)")
        figure.suptitle("per-SNIC throughput")
        written.append(_save(plt, figure, out_dir / f"{stem}_snic.png"))
    nic_timelines = {m: r["nic_timeline"] for m, r in run["modes"].items() if r.get("nic_timeline")}
    if nic_timelines:
        written.append(_nic_plot(plt, nic_timelines, run, out_dir / f"{stem}_nics.png"))
    probed = {m: r["probes"] for m, r in run["modes"].items() if len(r.get("probes", ())) > 1}
    if probed:
        figure, (ttft_axis, tpot_axis) = plt.subplots(1, 2, figsize=(9, 3.5))
        for mode, probes in probed.items():
            ordered = sorted(probes, key=lambda p: p["aps"])
            aps = [p["aps"] for p in ordered]
            ttft_axis.plot(aps, [p["p90_ttft_s"] for p in ordered], "o-", label=mode)
            tpot_axis.plot(aps, [(p["p90_tpot_s"] or 0) * 1e3 for p in ordered], "o-", label=mode)
        slo = run["slo"]
        ttft_axis.axhline(slo["ttft_s"], color="grey", linestyle=":", label="SLO")
        tpot_axis.axhline(slo["tpot_s"] * 1e3, color="grey", linestyle=":", label="SLO")
        ttft_axis.set(xlabel="agents per second", ylabel="p90 TTFT (s)")
        tpot_axis.set(xlabel="agents per second", ylabel="p90 TPOT (ms)")
        ttft_axis.legend(fontsize=8)
        written.append(_save(plt, figure, out_dir / f"{stem}_latency_vs_aps.png"))
    swept = [r for r in runs if r.get("rho") is not None and "dualpath_vs_basic_jct" in r["ratios"]]
    if len(swept) > 1:
        rhos = [r["rho"] for r in swept]
        figure, axis = plt.subplots(figsize=(6, 3.5))
        axis.plot(rhos, [r["ratios"]["dualpath_vs_basic_jct"] for r in swept], "o-", label="ours")
        axis.plot(rhos, [ideal_speedup(x) for x in rhos], "--", label="ideal max(1,ρ)/max(1,ρ/3)")
        axis.set_xlabel("ρ (hit-KV demand / SNIC cap)")
        axis.set_ylabel("DualPath speedup over Basic")
        axis.legend()
        written.append(_save(plt, figure, out_dir / f"{stem}_rho.png"))
    return written


def _nic_plot(plt, timelines: dict[str, dict], run: dict, path: Path) -> Path:  # noqa: ANN001
    """``--links kernel``: each NIC's bytes over time from the kernel's counters, a row per
    mode, the storage NICs left and the compute NICs right."""
    figure, axes = plt.subplots(
        len(timelines), 2, figsize=(11, 2.3 * len(timelines)), sharex=True, squeeze=False
    )
    for row, (mode, timeline) in zip(axes, timelines.items(), strict=True):
        for axis, nic in zip(row, ("storage", "compute"), strict=True):
            for name, rates in timeline["gbps"].items():
                if name.endswith(f" {nic}"):
                    axis.plot(timeline["time_s"], rates, label=name.removesuffix(f" {nic}"))
            cap = run.get("snic_caps_gbps") if nic == "storage" and mode != "oracle" else None
            if cap:
                axis.axhline(cap, color="grey", linestyle=":", label="cap, each direction")
            axis.set_title(f"{mode}: {nic} NICs", fontsize=9)
            axis.set_ylabel("Gbps sent + received")
        row[0].legend(fontsize=7, loc="upper right")
    for axis in axes[-1]:
        axis.set_xlabel("time (s)")
    figure.suptitle("each NIC's bytes, from the kernel's counters")
    return _save(plt, figure, path)


def finish(report: dict, args: argparse.Namespace, default_stem: str) -> int:
    """Write a benchmark's outputs (``--json``, ``--out-dir``); its exit status: 0 for a valid
    report, 1 (having said why on stderr) otherwise."""
    write_outputs(report, json_path=args.json, out_dir=args.out_dir, default_stem=default_stem)
    if report["valid"]:
        return 0
    print(invalid_message(report), file=sys.stderr)
    return 1

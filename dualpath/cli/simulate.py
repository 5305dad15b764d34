"""``dualpath simulate``: the cluster simulator's SPEC §7 experiments, or a free-form run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dualpath.cluster_options import (
    DEFAULT_MODES,
    add_attention_quota_argument,
    add_modes_argument,
    add_nodes_argument,
    add_read_path_argument,
)
from dualpath.flags import positive_float
from dualpath.options import (
    add_jobs_argument,
    add_json_argument,
    add_no_progress_argument,
    add_profile_arguments,
    add_seed_argument,
    add_simulated_workload_arguments,
    add_trace_argument,
    add_trace_shape_arguments,
    preset_for_max_len,
)


def add_simulate(sub: argparse._SubParsersAction) -> None:

    p = sub.add_parser(
        "simulate",
        help="cluster simulator: SPEC §7 experiments or a free-form run (no GPU needed)",
        description="Discrete-event simulation of a DualPath cluster driven by the real "
        "scheduler. Prints a table beside the paper's figure; --json/--png write results.",
    )
    p.add_argument(
        "--experiment",
        default=None,
        help="offline-jct, ablation, snic-balance, pd-ratio, online-capacity, scale, "
        "append-scaling; all: every one of those in one run (runs they share are simulated "
        "once; one JSON, one PNG); or fidelity: profile this machine (local profile), run a real "
        "'dualpath bench offline --preset ci --seed 1' for basic and dualpath, simulate the "
        "same and report the JCT errors",
    )
    p.add_argument(
        "--bench-json",
        type=Path,
        default=None,
        help="fidelity: compare with this earlier 'dualpath bench offline' JSON instead of "
        "running the benchmark",
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="fidelity: measure the local profile again, just before the benchmark (the "
        "machine's speed drifts), instead of reading the packaged dualpath/sim/local_profile.json",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="fidelity: the local profile to read, or with --reprofile to write (default: the "
        "packaged one; with --reprofile, a file in a temporary directory)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="re-run the fit of the one fitted factor (prefill efficiency) to Table 3's 2P4D "
        "JCT and print it (dualpath/sim/calibration.py); a few full-size runs",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the paper's whole grid (e.g. scale: 48P96D offline and 44P88D online instead of "
        "8P16D; offline-jct: 32K-64K, 512-2,048 agents and the 27B)",
    )
    add_simulated_workload_arguments(p, num_agents=1024)
    add_profile_arguments(p, default_model="deepseek-v3.2-660b", what="free-form runs")
    add_nodes_argument(p, default="2P4D")
    add_modes_argument(p, default=DEFAULT_MODES)
    add_trace_argument(p)
    add_trace_shape_arguments(
        p,
        defaults={"length_scale": None, "max_turns": None, "gen_scale": None},
        default_help={"length_scale": "1, the trace's own", "max_turns": "all", "gen_scale": "1"},
        where="free-form runs on --trace, as 'dualpath bench' does: ",
    )
    p.add_argument(
        "--online",
        action="store_true",
        help="free-form runs: also each mode's capacity (agents per second) under SPEC §7's "
        "SLO (TTFT <= 4 s, TPOT <= 50 ms), searched as the online-capacity experiment does; "
        "a trace's sessions arrive as a Poisson process, round robin as copies",
    )
    add_read_path_argument(p, where="free-form runs: ")
    p.add_argument(
        "--frontend-rps",
        type=positive_float,
        default=None,
        help="free-form runs: turns per second the front end admits, one after another, for "
        "the whole cluster (default: the hardware profile's, 10000 on hopper-8x400); matters "
        "when many agents start together",
    )
    add_attention_quota_argument(
        p,
        default_help="SPEC §6's 0.3",
        where="free-form runs: ",
        detail="; 0.3 / 61 reads the quota as a whole DeepSeek-V3.2 forward instead "
        "(docs/simulator-analysis.md, 'ping-pong')",
    )
    add_seed_argument(
        p,
        detail=", of a free-form run or of every run of --experiment (except fidelity): the "
        "paper checks were made on 0, and the fitted one was fitted on it",
    )
    add_json_argument(p, what="runs and checks")
    p.add_argument("--png", type=Path, default=None, help="write the figure here")
    add_jobs_argument(p, "experiments and free-form runs")
    add_no_progress_argument(p)
    p.set_defaults(
        func=_run_simulate,
        free_form_defaults={dest: p.get_default(dest) for dest in _FREE_FORM_ONLY},
    )


# ``simulate`` flags that shape a free-form run; an experiment or --calibrate refuses them
# rather than ignore them (they run the paper's configurations).
_FREE_FORM_ONLY = (
    "model",
    "hardware",
    "nodes",
    "agents",
    "max_len",
    "modes",
    "trace",
    "length_scale",
    "max_turns",
    "gen_scale",
    "online",
    "read_path",
    "frontend_rps",
    "attention_quota_s",
    "seed",
)


def _print_run(record: dict) -> None:
    """One finished run, on stderr above the progress bars (the table goes to stdout)."""
    from tqdm import tqdm

    jct = "" if record["jct_s"] is None else f" JCT {record['jct_s']:,.1f} s"
    aps = f" at {record['aps']:.4g} APS" if "aps" in record else ""
    tqdm.write(
        f"done: {record['model']} {record['nodes']} {record['mode']} {record['agents']} "
        f"agents{aps}:{jct} ({record['wall_s']:.1f} s)",
        file=sys.stderr,
    )


def _run_simulate(args: argparse.Namespace) -> int:
    import time

    from dualpath.sim import experiments, report
    from dualpath.sim.agents import workload_agents
    from dualpath.sim.profiles import resolve_hardware, resolve_model
    from dualpath.sim.runner import BLOCK_SIZE_TOKENS

    start_s = time.perf_counter()
    _check_simulate_runs(args)
    if args.calibrate or args.experiment is not None:
        takes_seed = not args.calibrate and args.experiment != "fidelity"
        for dest, default in args.free_form_defaults.items():
            if dest == "seed" and takes_seed:
                continue  # the SPEC §7 experiments run on any workload seed
            if getattr(args, dest) != default:
                what = "--calibrate" if args.calibrate else f"--experiment {args.experiment}"
                raise ValueError(
                    f"--{dest.replace('_', '-')} shapes free-form runs; {what} runs its own "
                    "configurations (leave --experiment out for a free-form run)"
                )
    if args.calibrate:
        from dualpath.sim.calibration import CALIBRATION_TARGET_JCT_S, fit_prefill_efficiency

        answer, tried = fit_prefill_efficiency(
            quota_per_forward=args.quota_per_forward, progress=not args.no_progress
        )
        for efficiency, jct_s in tried:
            print(f"prefill_efficiency {efficiency:.4f}: JCT {jct_s:.1f} s")
        print(
            f"fitted prefill_efficiency {answer:.4f} (where a least-squares line through the "
            f"runs in 1 / efficiency meets Table 3's 2P4D {CALIBRATION_TARGET_JCT_S:.0f} s)"
        )
        return 0
    if args.experiment == "fidelity":
        return _run_fidelity(args)
    if args.experiment is not None:
        names = list(experiments.EXPERIMENTS) if args.experiment == "all" else [args.experiment]
        results = experiments.run_experiments(
            names,
            scale_down=args.scale_down,
            full=args.full,
            quota_per_forward=args.quota_per_forward,
            seed=args.seed,
            on_run=None if args.no_progress else _print_run,
            progress=not args.no_progress,
            jobs=args.jobs,
        )
    else:
        preset = preset_for_max_len(args.max_len)
        agents = None
        if args.trace is not None:
            from dualpath.workload import load_mooncake_trace
            from dualpath.workload.shape import cap_turns, scale_generations

            workload = load_mooncake_trace(
                args.trace,
                vocab_size=32_000,
                seed=args.seed,
                max_sessions=args.agents,
                length_scale=args.length_scale or 1.0,
            )
            workload = scale_generations(cap_turns(workload, args.max_turns), args.gen_scale or 1.0)
            agents = workload_agents(workload, block_size_tokens=BLOCK_SIZE_TOKENS)
        elif (args.length_scale, args.max_turns, args.gen_scale) != (None, None, None):
            raise ValueError(
                "--length-scale, --max-turns and --gen-scale shape a --trace; give one, or "
                "leave them out"
            )
        result = experiments.free_form(
            model=resolve_model(args.model),
            hardware=resolve_hardware(args.hardware),
            nodes=args.nodes,
            num_agents=args.agents,
            preset=preset,
            modes=args.modes.split(","),
            scale_down=args.scale_down,
            seed=args.seed,
            agents=agents,
            read_path=args.read_path,
            frontend_requests_per_s=args.frontend_rps,
            attention_quota_s=args.attention_quota_s,
            quota_per_forward=args.quota_per_forward,
            online=args.online,
            on_run=None if args.no_progress else _print_run,
            progress=not args.no_progress,
            jobs=args.jobs,
        )
        results = [result]
    data = report.result_json(results, time.perf_counter() - start_s)
    print("\n\n".join(report.format_table(result) for result in results))
    if len(results) > 1:
        # A check two experiments make on one shared run (the calibration target) counts once.
        verdicts = {check["name"]: check["ok"] for check in data["checks"]}
        missed = [name for name, ok in verdicts.items() if not ok]
        print(f"\n{len(verdicts) - len(missed)} of {len(verdicts)} checks ok", end="")
        print(f"; missed: {', '.join(missed)}" if missed else "")
    build = "compiled build" if data["compiled"] else "Python sources"
    print(f"wall {data['wall_s']:.1f} s, {data['events_per_s']} events/s ({build})")
    if args.json is not None:
        report.write_json(data, args.json)
    if args.png is not None:
        report.write_png(results, args.png)
    return 0


def _check_simulate_runs(args: argparse.Namespace) -> None:
    """``ValueError`` for flags that belong to a kind of run other than the one asked for
    (each would be ignored)."""
    if args.calibrate and args.experiment is not None:
        raise ValueError("--calibrate runs the fit alone: leave out --experiment")
    fidelity_flags = [
        flag
        for flag, is_given in (
            ("--bench-json", args.bench_json is not None),
            ("--profile", args.profile is not None),
            ("--reprofile", args.reprofile),
        )
        if is_given
    ]
    if fidelity_flags and args.experiment != "fidelity":
        raise ValueError(f"{', '.join(fidelity_flags)}: only for --experiment fidelity")
    if args.full and args.experiment in (None, "fidelity"):
        raise ValueError("--full runs an experiment's whole grid: give --experiment NAME or all")


def _run_fidelity(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from dualpath.sim.fidelity import FIDELITY_TOLERANCE, run_fidelity

    with tempfile.TemporaryDirectory(prefix="dualpath-fidelity-") as tmp:
        rows = run_fidelity(
            work_dir=Path(tmp),
            bench_json=args.bench_json,
            profile_path=args.profile,
            reprofile=args.reprofile,
        )
    print("== fidelity (local profile vs dualpath bench offline --preset ci --seed 1) ==")
    print("mode | measured JCT s | simulated JCT s | error | TTFT p50 ms | TPOT p50 ms")
    for row in rows:
        verdict = "ok" if abs(row["error"]) <= FIDELITY_TOLERANCE else "MISS"
        print(
            f"{row['mode']} | {row['measured_s']:.2f} | {row['simulated_s']:.2f} | "
            f"{100 * row['error']:+.1f}% ({verdict}, +-{100 * FIDELITY_TOLERANCE:.0f}%) | "
            f"{_ms(row['measured_ttft_p50_s'])} vs {_ms(row['simulated_ttft_p50_s'])} | "
            f"{_ms(row['measured_tpot_p50_s'])} vs {_ms(row['simulated_tpot_p50_s'])}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"fidelity": rows}, indent=1) + "\n")
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"

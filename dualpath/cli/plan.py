"""``dualpath plan``: the P/D advisor."""

from __future__ import annotations

import argparse

from dualpath.cluster_options import add_mode_argument
from dualpath.flags import positive_int
from dualpath.options import (
    add_jobs_argument,
    add_json_argument,
    add_no_progress_argument,
    add_profile_arguments,
    add_simulated_workload_arguments,
    preset_for_max_len,
)


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="P/D advisor: SPEC §5 bounds for the hardware, then the simulator's best P/D",
        description="Evaluates SPEC §5's bottleneck-free P/D range and simulates candidate "
        "P/D shapes to recommend the best throughput per GPU for a workload.",
    )
    add_profile_arguments(p, default_model="27b", what="the candidate shapes")
    p.add_argument(
        "--total-nodes", type=positive_int, default=3, help="nodes to split into P and D"
    )
    add_simulated_workload_arguments(p, num_agents=256)
    add_mode_argument(p, what="mode to plan for")
    add_jobs_argument(p, "the candidate shapes")
    add_json_argument(
        p,
        what="the advice",
        detail=": what was planned for, pd_range, candidates (nodes, jct_s, "
        "turns_per_s_per_gpu, pd_ratio, inside_pd_range) and recommended",
    )
    add_no_progress_argument(p)
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from dualpath.sim import report
    from dualpath.sim.plan import recommend_pd
    from dualpath.sim.profiles import resolve_hardware, resolve_model

    preset = preset_for_max_len(args.max_len)
    model, hardware = resolve_model(args.model), resolve_hardware(args.hardware)
    advice = recommend_pd(
        model=model,
        hardware=hardware,
        total_nodes=args.total_nodes,
        num_agents=args.agents,
        preset=preset,
        mode=args.mode,
        scale_down=args.scale_down,
        quota_per_forward=args.quota_per_forward,
        progress=not args.no_progress,
        jobs=args.jobs,
    )
    print("\n".join(advice.lines))
    if args.json is not None:
        data = advice.as_dict(
            model=model.name,
            hardware=hardware.name,
            total_nodes=args.total_nodes,
            agents=args.agents // args.scale_down,
            max_len=args.max_len,
            mode=args.mode,
            scale_down=args.scale_down,
            quota_per_forward=args.quota_per_forward,
        )
        report.write_json(data, args.json)
    return 0

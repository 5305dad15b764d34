"""``dualpath bench scheduler --wire``: the wire bench's flags and its printed summary (the
bench itself: ``scheduler_wire``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dualpath.bench.paper_cluster import PAPER_REQUESTS_PER_S
from dualpath.bench.scheduler_wire import run_wire_bench
from dualpath.bench.wire_workload import MEAN_CONTEXT_TOKENS
from dualpath.flags import non_negative_float, positive_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The wire mode's own flags (``dualpath bench scheduler`` adds them to its parser)."""
    parser.add_argument(
        "--duration-s",
        type=positive_float,
        default=10.0,
        help="--wire: timed seconds of submissions",
    )
    parser.add_argument(
        "--requests-per-s",
        type=non_negative_float,
        default=PAPER_REQUESTS_PER_S,
        help="--wire: Poisson arrival rate; 0 = saturate (default 2350: 48P96D in the paper)",
    )
    parser.add_argument(
        "--fetch-interval-ms",
        type=positive_float,
        default=10.0,
        help="--wire: every leader reports this often (default 10, SPEC §6)",
    )
    parser.add_argument(
        "--link-bytes-interval-ms",
        type=positive_float,
        default=1000.0,
        help="--wire: leaders add their link counters this often (default 1000)",
    )
    parser.add_argument(
        "--loop-turn-ms",
        type=non_negative_float,
        default=2.0,
        help="--wire: the scheduler loop takes in its messages once per turn of this length; "
        "0 = wake for every message (default 2)",
    )
    parser.add_argument(
        "--context-tokens",
        type=positive_int,
        default=MEAN_CONTEXT_TOKENS,
        help="--wire: mean prompt tokens (default 32721: SPEC §7's 64K workload)",
    )
    parser.add_argument(
        "--profile", type=Path, default=None, help="--wire: cProfile the loop thread into this file"
    )


def main(
    args: argparse.Namespace, *, num_prefill_nodes: int, num_decode_nodes: int, nodes_per_group: int
) -> int:
    """``dualpath bench scheduler --wire``; the cluster shape comes from its ``--engines``."""
    result = run_wire_bench(
        num_prefill_nodes=num_prefill_nodes,
        num_decode_nodes=num_decode_nodes,
        engines_per_node=args.engines_per_node,
        nodes_per_group=nodes_per_group,
        requests_per_s=args.requests_per_s,
        duration_s=args.duration_s,
        fetch_interval_s=args.fetch_interval_ms / 1000,
        link_bytes_interval_s=args.link_bytes_interval_ms / 1000,
        loop_turn_s=args.loop_turn_ms / 1000,
        mean_context_tokens=args.context_tokens,
        scheduler=args.scheduler,
        read_path=args.read_path,
        seed=args.seed,
        profile_path=args.profile,
    )
    print(
        f"{result['cluster']} ({result['num_engines']} engines, {result['num_leaders']} leaders "
        f"reporting every {result['fetch_interval_s'] * 1000:g} ms), seed {result['seed']}: "
        f"{result['requests_per_s_submitted']:,.0f} requests/s submitted (target "
        f"{result['requests_per_s_target']:,.0f}), mean prompt {result['mean_prompt_tokens']:,.0f} "
        f"tokens, {result['hit_fraction']:.1%} hit"
    )
    print(
        f"{result['placements_per_s']:,.0f} placements/s, "
        f"{result['cpu_s_per_placement'] * 1e6:,.1f} scheduler CPU us/placement "
        f"({result['placements_per_cpu_s']:,.0f} placements per CPU-second): "
        f"{result['cores_at_2350_rps']:.3f} cores at 2,350 requests/s "
        f"(loop thread measured at {result['loop_cores']:.3f} cores)"
    )
    projected_cores = result["projected_cores_at_2350_rps"]
    print(
        f"priced per report ({result['cpu_s_per_report'] * 1e6:,.1f} CPU us, nothing submitted) "
        f"and per placement beyond its reports "
        f"({result['cpu_s_per_placement_beyond_reports'] * 1e6:,.1f} CPU us): "
        f"{projected_cores:.3f} cores at {result['group_reports_per_s_target']:,.0f} reports/s "
        f"and 2,350 placements/s ({PAPER_REQUESTS_PER_S / projected_cores:,.0f} placements per "
        f"CPU-second)"
    )
    print(
        f"group reports {result['group_reports_per_s']:,.0f}/s (target "
        f"{result['group_reports_per_s_target']:,.0f}, {result['num_late_reports']} late); "
        f"submit {result['submit_cpu_s_per_request'] * 1e6:,.0f} CPU us/request (serving "
        f"thread); consistent: {result['is_consistent']}"
    )
    print(f"messages: {result['messages']}")
    print(f"hardware: {result['hardware']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0 if result["is_consistent"] else 1

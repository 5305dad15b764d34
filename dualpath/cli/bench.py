"""``dualpath bench``: one subcommand per benchmark module of ``dualpath.bench``."""

from __future__ import annotations

import argparse

from dualpath.cli.parser import ModuleParser


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (each writes a JSON result with --json)")
    bench_sub = p.add_subparsers(
        dest="bench", required=True, metavar="BENCHMARK", parser_class=ModuleParser
    )
    for name, module_name, help_text in (
        ("store", "dualpath.bench.store_bench", "KV store read GB/s vs plain reads, cold and warm"),
        (
            "scheduler",
            "dualpath.bench.scheduler_bench",
            "pure-policy placements per second at cluster scale",
        ),
        (
            "transfer",
            "dualpath.bench.transfer_bench",
            "cross-process KV transfer GB/s (NIXL or shared memory) vs an in-process copy",
        ),
        (
            "engine",
            "dualpath.bench.engine_bench",
            "prefill and decode tokens/s of our engine vs transformers' generate on the same "
            "weights, float32 vs bfloat16, against the memory-bandwidth bound",
        ),
        (
            "offline",
            "dualpath.bench.offline",
            "N agents on a one-host PD cluster per mode: JCT and bytes per read path",
        ),
        (
            "online",
            "dualpath.bench.online",
            "Poisson agent arrivals per mode: SLO attainment and, with --find-capacity, the "
            "largest APS that holds the SLO",
        ),
        (
            "vs-vllm",
            "dualpath.vllm.bench.vllm_compare",
            "real agent sessions against one vLLM instance (what a user would run instead), "
            "dualpath on vLLM engines (1P1D, 1P2D) and on its own (1P2D), or vLLM's own P/D; "
            "--regime small|beyond-memory sizes every system's KV memory by one rule: JCT, "
            "TTFT, TPOT, hits, CPU side by side (run from .venv-vllm)",
        ),
    ):
        bench_sub.add_parser(name, help=help_text, description=help_text, module_name=module_name)

"""The options that several ``dualpath`` commands share, each defined once here.

A command's module adds its own options and calls these for the shared ones, so an option
means the same, reads the same in ``--help`` and is checked the same way everywhere.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dualpath.flags import positive_int
from dualpath.vllm_args import add_engine_kind_arguments


def add_engine_arguments(p: argparse.ArgumentParser, *, default_threads: int | None = None) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Hugging Face checkpoint directory (default: the embedded SmolLM2-135M-Instruct "
        "under $DUALPATH_HOME/models/, converted from its packaged GGUF on first use)",
    )
    store = p.add_mutually_exclusive_group()
    store.add_argument(
        "--kv-store",
        type=Path,
        default=None,
        help="KV-cache store directory, local or on a POSIX DFS mount (default: $DUALPATH_HOME/kv)",
    )
    store.add_argument(
        "--no-kv-store", action="store_true", help="disable the store: recompute every prompt"
    )
    p.add_argument(
        "--kv-store-capacity-gb",
        type=float,
        default=None,
        help="store budget in GB (1e9 bytes); least-recently-used blocks are evicted beyond it "
        "(default: 25%% of the free space on the store's file system at start)",
    )
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]' (default cpu)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights and KV dtype (default: the checkpoint's)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=64,
        help="tokens per KV block, the store's unit (default 64)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=default_threads,
        help="torch CPU threads per engine (default: "
        + (
            "torch's choice, usually one per core)"
            if default_threads is None
            else f"{default_threads})"
        ),
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="context limit in tokens (default: the checkpoint's)",
    )
    add_engine_kind_arguments(
        p,
        where="serve and engine; generate: one vLLM engine in this process, its KV from the store",
    )


def add_profile_arguments(p: argparse.ArgumentParser, *, default_model: str, what: str) -> None:
    from dualpath.sim.profiles import HARDWARE, MODELS

    file_help = (
        'or a JSON file of the profile\'s fields, or of "base" (a built-in name) and the '
        "fields that differ (dualpath/sim/profiles.py)"
    )
    p.add_argument(
        "--model",
        default=default_model,
        help=f"{what}: model profile, {', '.join(MODELS)} (default {default_model}), {file_help}",
    )
    p.add_argument(
        "--hardware",
        default="hopper-8x400",
        help=f"{what}: node and fabric profile, {', '.join(HARDWARE)} (default hopper-8x400; "
        f"'local' only for plan's SPEC §5 bounds), {file_help}",
    )


def add_jobs_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help=f"{what}: simulate independent runs N at a time in worker processes, one core "
        "each (default 1; the results are the same either way, wall times aside; with N > 1 "
        "one progress bar counts the runs)",
    )


def add_no_progress_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar per simulated run and no line per finished run on stderr",
    )


def preset_for_max_len(max_len: int) -> str:
    """The SPEC §7 workload preset of ``--max-len`` (a CLI error names the choices)."""
    from dualpath.sim.runner import PRESET_BY_MAX_LEN

    if max_len not in PRESET_BY_MAX_LEN:
        raise ValueError(f"--max-len must be one of {sorted(PRESET_BY_MAX_LEN)}, got {max_len}")
    return PRESET_BY_MAX_LEN[max_len]

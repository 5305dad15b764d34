"""The flags ``bench offline`` and ``bench online`` share: the workload, the engines every server
runs, and the outputs (``spec.py`` reads them into a ``RunSpec``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dualpath.bench.kernel_links import LINKS
from dualpath.bench.presets import PRESETS
from dualpath.bench.report import add_output_arguments
from dualpath.bench.spec import CALIBRATION_SOURCES, DEFAULT_CALIBRATION_RUNS
from dualpath.cluster_options import (
    add_attention_quota_argument,
    add_kv_cache_argument,
    add_max_prompt_tokens_argument,
    add_modes_argument,
    add_read_path_argument,
    add_transport_argument,
)
from dualpath.flags import positive_int
from dualpath.options import (
    add_max_sessions_argument,
    add_model_argument,
    add_seed_argument,
    add_trace_argument,
    add_trace_shape_arguments,
)
from dualpath.vllm.args import add_engine_kind_arguments


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``bench offline`` and ``bench online``."""
    add_preset_argument(parser, default="ci")
    add_modes_argument(parser, default=None)
    add_model_argument(parser, tiny=True)
    add_seed_argument(parser)
    add_trace_argument(parser)
    add_max_sessions_argument(parser, default=None, default_help="the preset's agents")
    add_trace_shape_arguments(
        parser,
        defaults={"length_scale": None, "max_turns": None, "gen_scale": None},
        default_help={
            "length_scale": "the preset's",
            "max_turns": "the preset's cap",
            "gen_scale": "the preset's",
        },
        where="a trace's too: ",
    )
    add_max_prompt_tokens_argument(
        parser,
        detail=" of every server the benchmark starts; the workload is checked against it "
        "before any server starts",
    )
    parser.add_argument(
        "--url",
        default=None,
        help="run the agents against this OpenAI-compatible server instead of starting ours "
        "(not with --modes; link figures are then null)",
    )
    parser.add_argument("--api-key", default=None, help="bearer key for --url")
    parser.add_argument("--served-model-name", default=None, help="model id to request from --url")
    add_transport_argument(parser)
    add_read_path_argument(parser)
    add_engine_kind_arguments(parser, where="every server the benchmark starts")
    parser.add_argument(
        "--vllm-servers",
        action="store_true",
        help="run every mode on DualPath inside vLLM servers, as users deploy it: one vLLM "
        "OpenAI server per engine with --kv-transfer-config from `dualpath vllm-config`, and "
        "`dualpath serve --external-engines` in front, instead of `dualpath serve --engine "
        "vllm` (run from .venv-vllm). The front door and every server get the mode, the "
        "cluster shape, the link caps (the engines enforce them) and --transport; the servers "
        "get --kv-cache-gb as vLLM's --num-gpu-blocks-override and the model's context; the "
        "front door gets --read-path and the scheduler's flags. Refused with --vllm-arg, "
        "--vllm-prefill-batching quota and --url",
    )
    parser.add_argument(
        "--links",
        choices=LINKS,
        default="emulated",
        help="what shapes the cluster's links: 'emulated', every process on this host, the "
        "SNIC/CNIC caps our token buckets; 'kernel', one network namespace per engine and one "
        "for the router, each with a storage NIC and a compute NIC that tc caps at the same "
        "rates, the store on GlusterFS bricks of two storage hosts, our token buckets off, and "
        "each NIC's bytes read from the kernel's counters beside our accounting (needs root "
        "and glusterfs-server: make test-faults installs it; not with --vllm-servers or --url) "
        "(default emulated)",
    )
    add_kv_cache_argument(
        parser,
        default=None,
        default_help="on vLLM engines, paper-ratio and agentic give a fifth of the agents' "
        "final contexts' KV, at least one request of the model's context; otherwise serve's",
        detail=". On vLLM engines it also bounds the prefill engine's own prefix cache, a tier "
        "above the store: a regime where storage supplies the hits needs it well below the "
        "agents' KV",
    )
    add_attention_quota_argument(parser, default_help="serve's")
    add_calibration_arguments(parser)
    add_output_arguments(parser)
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep the servers' stores and logs here, a folder per mode (default: a "
        "temporary folder, removed after the run)",
    )


def add_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    """How a calibrated preset (paper-ratio, agentic, --rho) gets its SNIC caps
    (``calibration_records.py``)."""
    parser.add_argument(
        "--calibration",
        choices=CALIBRATION_SOURCES,
        default=None,
        help="where a calibrated preset's SNIC caps and beta come from: 'recorded' (default) "
        "uses the calibration recorded for this machine kind, engines and workload "
        "($DUALPATH_HOME/bench/calibrations.json, then the package's) and calibrates in the "
        "run if there is none; 'run' always calibrates in the run (an uncapped oracle run "
        "first); 'record' calibrates --calibration-runs times, records the run of median caps "
        "for later runs, and uses it. Only for calibrated presets and --rho",
    )
    parser.add_argument(
        "--calibration-runs",
        type=positive_int,
        default=None,
        help="with --calibration record: how many calibration runs the record's median is "
        f"taken over (default {DEFAULT_CALIBRATION_RUNS})",
    )


def calibration_settings(args: argparse.Namespace) -> dict:
    """``RunSpec``'s calibration fields from the flags; ``ValueError`` for --calibration-runs
    without --calibration record."""
    if args.calibration_runs is not None and args.calibration != "record":
        raise ValueError("--calibration-runs: only with --calibration record")
    return {
        "calibration": args.calibration,
        "calibration_runs": args.calibration_runs or DEFAULT_CALIBRATION_RUNS,
    }


def add_preset_argument(parser: argparse.ArgumentParser, *, default: str) -> None:
    """``--preset``: the workload (and the cluster, where the benchmark shapes one) of
    ``dualpath.bench.presets``."""
    parser.add_argument(
        "--preset",
        default=default,
        choices=sorted(PRESETS),
        help=f"workload and cluster shape (default {default})",
    )


def check_url_flags(args: argparse.Namespace) -> None:
    """``ValueError`` for flags that only speak to a ``--url`` server, given without it."""
    given = [
        flag
        for flag, value in (
            ("--api-key", args.api_key),
            ("--served-model-name", args.served_model_name),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)}: only for a server of your own (bench offline --url); the "
            "servers the benchmark starts need neither"
        )

"""The options that several ``dualpath`` commands share, each defined once here.

    add_model_argument(parser)                  # --model: a checkpoint directory
    add_json_argument(parser, what="the result")

A command adds its own options and calls these for the shared ones, so an option means the
same, reads the same in ``--help`` and is checked the same way everywhere. Where commands
differ only in an option's default, the default is a parameter. The cluster's options (shape,
mode, links, engine memory, transport, liveness) are ``dualpath.cluster_options``. Both sit
below ``dualpath.cli`` and ``dualpath.bench``: the benchmarks' parsers use them too, and they
never import the command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dualpath.config import DTYPES
from dualpath.flags import (
    non_negative_int,
    positive_float,
    positive_int,
)
from dualpath.vllm.args import add_engine_kind_arguments

# --- model, store, engine ----------------------------------------------------------------------


def add_model_argument(p: argparse.ArgumentParser, *, tiny: bool = False) -> None:
    """``--model DIR``; without it ``dualpath.model.default.resolve_model_dir`` picks the
    embedded default, or with ``tiny`` the random-weight tiny preset."""
    default = (
        "the random-weight tiny preset under $DUALPATH_HOME/models/, generated on first use"
        if tiny
        else "the embedded SmolLM2-135M-Instruct under $DUALPATH_HOME/models/, converted from "
        "its packaged GGUF on first use"
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"Hugging Face checkpoint directory (default: {default})",
    )


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    """``--kv-store DIR`` or ``--no-kv-store``, and ``--kv-store-capacity-gb``
    (``dualpath.cli.configs.store_config`` reads them)."""
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


# ``dualpath serve``'s torch threads per engine: its engines share the host, one thread each
# (``dualpath engine`` and ``generate`` keep torch's choice).
SERVE_ENGINE_THREADS = 1


def add_engine_arguments(p: argparse.ArgumentParser, *, default_threads: int | None = None) -> None:
    """What one engine runs and how: the model, the store, device, dtype, block size, threads,
    context and the engine kind (generate, demo, engine, serve)."""
    add_model_argument(p)
    add_store_arguments(p)
    add_device_argument(p)
    add_dtype_argument(p, default=None, default_help="the checkpoint's")
    add_block_size_argument(p, default_help=ENGINES_BLOCK_SIZE_HELP)
    add_threads_argument(
        p,
        default=default_threads,
        default_help="torch's choice, usually one per core"
        if default_threads is None
        else str(default_threads),
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


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", default="cpu", help="torch device, 'cpu' or 'cuda[:N]' (default cpu)"
    )


def add_dtype_argument(
    p: argparse.ArgumentParser, *, default: str | None, default_help: str
) -> None:
    """``--dtype``: what an engine computes and keeps its KV in, so the store's too."""
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=default,
        help=f"weights and KV dtype, the store's too (default: {default_help})",
    )


# Without --block-size an engine takes the size its kind serves (``configs.resolve_block_size``).
ENGINES_BLOCK_SIZE_HELP = (
    "the engine's choice: 64, or 16 for an MLA model on vLLM's CPU build, whose CPU_MLA pages "
    "hold 16 tokens whatever it is given; any other size is refused there"
)


def add_block_size_argument(
    p: argparse.ArgumentParser, *, default: int | None = None, default_help: str
) -> None:
    """``--block-size``: tokens per KV block, one Full Block of the store."""
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=default,
        help=f"tokens per KV block, the store's unit (a Full Block) (default: {default_help})",
    )


def add_threads_argument(
    p: argparse.ArgumentParser, *, default: int | None, default_help: str, detail: str = ""
) -> None:
    """``--threads``: torch's CPU threads in each engine a command runs (``detail`` follows)."""
    p.add_argument(
        "--threads",
        type=positive_int,
        default=default,
        help=f"torch CPU threads per engine{detail} (default: {default_help})",
    )


def add_decode_threads_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, default_help: str
) -> None:
    """``--decode-threads``: torch's CPU threads in each decode engine, instead of
    ``--threads`` (None when not given: the command's default says what it takes)."""
    p.add_argument(
        "--decode-threads",
        type=positive_int,
        default=None,
        help="torch CPU threads per decode engine instead of --threads (default: "
        f"{default_help}). A DE steps small batches, where a second thread gains less than "
        "its fork-join costs; where engines share cores, `--threads <cores> --decode-threads "
        "1` leaves them to the PE's prefill",
    )


def add_repeats_argument(
    p: argparse.ArgumentParser, *, default: int, reported: str = "medians"
) -> None:
    """``--repeats``: how often a benchmark times each case; ``reported`` says which of the
    timings its result gives."""
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=default,
        help=f"timed runs of every case; {reported} reported (default {default})",
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


# --- workload shape ----------------------------------------------------------------------------


def add_trace_shape_arguments(
    p: argparse.ArgumentParser,
    *,
    defaults: dict[str, float | int | None],
    default_help: dict[str, str],
    where: str = "",
) -> None:
    """``--length-scale``, ``--max-turns`` and ``--gen-scale``: how a workload (a trace's,
    or a preset's) is reshaped, as ``dualpath.workload.shape`` does it. ``defaults`` and
    ``default_help`` by dest; ``where`` prefixes each help (e.g. "free-form runs on --trace: ")."""
    p.add_argument(
        "--length-scale",
        type=positive_float,
        default=defaults["length_scale"],
        help=f"{where}multiply every length (prompts, appends, outputs) by this "
        f"(default: {default_help['length_scale']})",
    )
    p.add_argument(
        "--max-turns",
        type=positive_int,
        default=defaults["max_turns"],
        help=f"{where}keep each session's first N turns (default: {default_help['max_turns']})",
    )
    p.add_argument(
        "--gen-scale",
        type=positive_float,
        default=defaults["gen_scale"],
        help=f"{where}every turn generates max(1, round(g x this)) tokens instead of g, after "
        f"--length-scale (default: {default_help['gen_scale']})",
    )


def add_trace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="replay this Mooncake-format JSONL trace instead of generated trajectories",
    )


def add_max_sessions_argument(
    p: argparse.ArgumentParser, *, default: int | None, default_help: str
) -> None:
    p.add_argument(
        "--max-sessions",
        type=positive_int,
        default=default,
        help="sessions to replay: trajectories generated, or a trace's first sessions "
        f"(default: {default_help})",
    )


def add_clones_argument(
    p: argparse.ArgumentParser, *, default: int | None, default_help: str
) -> None:
    p.add_argument(
        "--clones",
        type=non_negative_int,
        default=default,
        help="every session also runs as N clones with a fresh first turn (SPEC 7: "
        f"cache-disjoint), so many agents replay few sessions (default: {default_help})",
    )


def add_simulated_workload_arguments(p: argparse.ArgumentParser, *, num_agents: int) -> None:
    """The simulator's workload and cluster size (``simulate``, ``plan``): SPEC §7's agents
    and context preset, a K-times smaller cluster, and how the compute quota is read."""
    p.add_argument(
        "--agents", type=positive_int, default=num_agents, help=f"agents (default {num_agents})"
    )
    p.add_argument(
        "--max-len",
        type=positive_int,
        default=65536,
        help="32768, 49152 or 65536 (SPEC §7 presets; default 65536)",
    )
    p.add_argument(
        "--scale-down",
        type=positive_int,
        default=1,
        help="K: nodes with 8/K GPUs (node links /K) and K times fewer agents (default 1)",
    )
    p.add_argument(
        "--quota-per-forward",
        action="store_true",
        help="read SPEC §6's 300 ms compute quota as the attention time of a whole forward "
        "(300 ms / layers per layer), with that reading's own fitted prefill efficiency "
        "(default: per attention layer)",
    )


def add_seed_argument(p: argparse.ArgumentParser, *, what: str = "", detail: str = "") -> None:
    """``--seed``: what a command draws at random as its input (prompts, blocks, bytes, a
    queue); the same seed replays the same input. ``what`` names it, ``detail`` follows."""
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help=f"seed of the {what or 'workload'} (default 0){detail}",
    )


# --- output --------------------------------------------------------------------------------------


def add_json_argument(
    p: argparse.ArgumentParser,
    *,
    what: str = "the result",
    detail: str = "",
    required: bool = False,
) -> None:
    """``--json FILE``: where a command writes ``what`` (``detail`` follows "here")."""
    p.add_argument(
        "--json", type=Path, default=None, required=required, help=f"write {what} here{detail}"
    )

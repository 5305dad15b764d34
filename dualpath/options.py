"""The options that several ``dualpath`` commands share, each defined once here.

    add_model_argument(parser)                  # --model: a checkpoint directory
    add_json_argument(parser, what="the result")

A command adds its own options and calls these for the shared ones, so an option means the
same, reads the same in ``--help`` and is checked the same way everywhere. Where commands
differ only in an option's default, the default is a parameter. It sits below both
``dualpath.cli`` and ``dualpath.bench``: the benchmarks' parsers use it too, and they never
import the command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dualpath.config import DTYPES, MODES, READ_PATHS
from dualpath.flags import (
    non_negative_float,
    non_negative_int,
    port_number,
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


# --- cluster: what serve and engine both configure ---------------------------------------------


def add_mode_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, what: str = "comparison mode"
) -> None:
    p.add_argument("--mode", choices=MODES, default="dualpath", help=f"{what} (default dualpath)")


def add_modes_argument(p: argparse.ArgumentParser, *, default: str | None) -> None:
    """``--modes``: the modes a comparison runs; None: ``DEFAULT_MODES``, resolved by the
    command (a benchmark refuses it with ``--url``)."""
    p.add_argument(
        "--modes",
        default=default,
        help=f"comma-separated modes to compare, in order (of {', '.join(MODES)}; default "
        f"{DEFAULT_MODES})",
    )


DEFAULT_MODES = "basic,dualpath,oracle"


def add_nodes_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: str
) -> None:
    p.add_argument(
        "--nodes",
        default=default,
        help=f"cluster shape: prefill and decode nodes, e.g. 2P4D (default {default})",
    )


def add_engines_per_node_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: int
) -> None:
    p.add_argument(
        "--engines-per-node",
        type=positive_int,
        default=default,
        help=f"engines (GPUs) per node (default {default})",
    )


def add_nodes_per_group_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    default: int | None,
    default_help: str | None = None,
) -> None:
    p.add_argument(
        "--nodes-per-group",
        type=positive_int,
        default=default,
        help="nodes per engine group, which fetch work together through one leader (default "
        f"{default_help or default})",
    )


def add_read_path_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    default: str | None = None,
    where: str = "",
) -> None:
    """``--read-path``: one read side forced on every request; ``where`` prefixes the help."""
    p.add_argument(
        "--read-path",
        choices=READ_PATHS,
        default=default,
        help=f"{where}force one read path on every request in every mode (pe, de, split: each "
        "request's blocks on both sides, dual, round_robin: the sides in turn) (default: "
        + (default or "each mode's own")
        + ")",
    )


def add_link_cap_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--snic-gbps`` and ``--cnic-gbps``: the links' bandwidth caps (0 = none)."""
    p.add_argument(
        "--snic-gbps",
        type=non_negative_float,
        default=0.0,
        help="storage NIC cap per node, Gbps (default 0 = no cap)",
    )
    p.add_argument(
        "--cnic-gbps",
        type=non_negative_float,
        default=0.0,
        help="compute NIC cap per engine, Gbps (default 0 = no cap)",
    )


def add_engine_memory_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--buffer-gb``, ``--kv-cache-gb`` and ``--max-num-batched-tokens``: an engine's host
    buffer, device KV cache and step size."""
    add_buffer_argument(
        p,
        default_help="sized at start to hold two requests of the model's whole context, e.g. "
        "0.755 GB for the float32 SmolLM2-135M at 8,192 tokens; a size that cannot hold one "
        "such request is refused at start, naming the size needed",
    )
    add_kv_cache_argument(p, default=1.0, default_help="1")
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=8192,
        help="tokens per engine step (default 8192)",
    )


def add_buffer_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, default_help: str
) -> None:
    p.add_argument(
        "--buffer-gb",
        type=positive_float,
        default=None,
        help=f"host KV buffer per engine (PE and DE buffers), GB (default: {default_help})",
    )


def add_kv_cache_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    default: float | None,
    default_help: str,
    detail: str = "",
) -> None:
    """``--kv-cache-gb``: each engine's device KV memory in GB (1e9 bytes), a float on every
    command; a vLLM engine gets it as that many bytes' blocks (``--num-gpu-blocks-override``)."""
    p.add_argument(
        "--kv-cache-gb",
        type=positive_float,
        default=default,
        help=f"device KV cache per engine, GB (1e9 bytes){detail} (default: {default_help})",
    )


def add_transport_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    from dualpath.transfer.transport import TRANSPORT_KINDS  # lazy: the transport's imports

    p.add_argument(
        "--transport",
        choices=TRANSPORT_KINDS,
        default="nixl",
        help="PE<->DE KV transport (default nixl)",
    )


def add_listen_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--host`` and ``--port``: where an HTTP server (serve's API, a benchmark's proxy)
    listens."""
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, loopback only; 0.0.0.0 for every interface)",
    )
    p.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")


def add_max_prompt_tokens_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, detail: str = ""
) -> None:
    """``--max-prompt-tokens``: a server's longest prompt (``detail`` follows "prompt")."""
    p.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=None,
        help=f"longest prompt in tokens{detail} (default: the context length minus one)",
    )


def add_heartbeat_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: float
) -> None:
    p.add_argument(
        "--heartbeat-timeout-s",
        type=positive_float,
        default=default,
        help="an engine silent this long is declared dead, and vice versa; a local engine's "
        f"exit is seen at once (default {default:g})",
    )


def add_attention_quota_argument(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    default_help: str | None = None,
    where: str = "",
    detail: str = "",
) -> None:
    """``--attention-quota-s``, SPEC §6's compute quota; ``default_help`` says what its
    absence means where it defaults to None (a benchmark passes serve's on, the simulator
    takes SPEC's); ``where`` prefixes the help, ``detail`` follows it."""
    p.add_argument(
        "--attention-quota-s",
        type=positive_float,
        default=0.3 if default_help is None else None,
        help=f"{where}the prefill engines' compute quota: predicted seconds of one attention "
        "layer per prefill batch (SPEC §6: 0.3 on the paper's GPUs; profile it on other "
        "hardware); the batch that would pass it is cut (native engine, simulator) or ends "
        f"before the request (--engine vllm --vllm-prefill-batching quota){detail} (default "
        f"{default_help or 0.3})",
    )


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

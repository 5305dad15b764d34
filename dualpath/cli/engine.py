"""``dualpath engine``: one prefill or decode engine process that joins a scheduler."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dualpath.cli.configs import engine_process_config
from dualpath.cluster_options import (
    add_attention_quota_argument,
    add_engine_memory_arguments,
    add_heartbeat_argument,
    add_link_cap_arguments,
    add_mode_argument,
    add_transport_argument,
)
from dualpath.flags import non_negative_int
from dualpath.options import add_engine_arguments


def _control_endpoint(text: str) -> str:
    """A scheduler endpoint an engine connects to: tcp://HOST:PORT or ipc://PATH."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    is_tcp = parts.scheme == "tcp" and bool(parts.hostname) and port is not None and port > 0
    if not is_tcp and not (parts.scheme == "ipc" and len(text) > len("ipc://")):
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT or ipc://PATH, got {text!r}")
    return text


def add_engine_identity_arguments(p: argparse.ArgumentParser, *, required: bool) -> None:
    """``--role``, ``--scheduler``, ``--engine-id`` and ``--node-id``: which engine of a
    cluster a process is, and where it joins (``dualpath engine``, ``dualpath vllm-config``)."""
    p.add_argument("--role", choices=("prefill", "decode"), required=required, help="PE or DE")
    p.add_argument(
        "--scheduler",
        type=_control_endpoint,
        required=required,
        help="the scheduler's control endpoint, tcp://HOST:PORT (dualpath serve "
        "--scheduler-endpoint)",
    )
    p.add_argument(
        "--engine-id",
        type=non_negative_int,
        required=required,
        help="this engine's id in the topology",
    )
    p.add_argument(
        "--node-id", type=non_negative_int, required=required, help="the node it belongs to"
    )


def add_engine(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engine",
        help="run one prefill or decode engine process that joins a scheduler",
        description="One engine of a PD-disaggregated cluster (one engine = one GPU). It joins "
        "the scheduler at --scheduler with the cluster token from $DUALPATH_CLUSTER_TOKEN. "
        "It stops when the scheduler tells it to or on SIGTERM (exit 0). When the engine dies "
        "or loses the scheduler (no answer, silence, declared dead), this command starts it "
        "again and it rejoins under its id (--no-restart: exit instead). Either --config gives "
        "its whole "
        "configuration (what 'dualpath serve' sends its engines), or the flags below build it "
        "(--role, --scheduler, --engine-id and --node-id required).",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the engine's whole configuration as JSON (an EngineProcessConfig: every field "
        "of its store, engine, cluster and scheduler configs), from this file or '-' for "
        "stdin; no other engine flag may be given with it but --role, --engine-id and "
        "--node-id, which must then agree with it",
    )
    add_engine_arguments(p)
    p.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine as a child and start it again when it dies or loses the "
        "scheduler: after 1, 2, 4, ... s (at most 30 s) however often it lost the scheduler, "
        "so a host cut off for a while rejoins once it is back; at most 5 times in 5 minutes "
        "after crashes; never after a refused configuration (default on; --no-restart: run "
        "the engine in this process, exit 3 when the scheduler is lost)",
    )
    add_engine_identity_arguments(p, required=False)
    add_mode_argument(p)
    add_transport_argument(p)
    add_link_cap_arguments(p)
    add_engine_memory_arguments(p)
    add_heartbeat_argument(p, default=5.0)
    add_attention_quota_argument(p)
    # Every flag but --config and --restart at its default: what --config may be given with.
    defaults = vars(p.parse_args([]))
    del defaults["config"], defaults["restart"]
    p.set_defaults(func=_run_engine, engine_flag_defaults=defaults)


def _run_engine(args: argparse.Namespace) -> int:
    from dualpath.cluster.engine_processes import TOKEN_ENV, run_supervised

    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"set ${TOKEN_ENV} to the cluster token the scheduler was started with")
    config = engine_process_config(args)
    _check_engine_capacity(config)
    if config.engine.device != "cpu":
        from dualpath.model.loader import available_device  # lazy: torch

        available_device(config.engine.device)  # before a child is started, or restarted
    if args.restart:
        return run_supervised(config, token)
    from dualpath.cluster.engine_process import run_engine

    return run_engine(config, token)


def _check_engine_capacity(config) -> None:  # config: EngineProcessConfig
    """Refuse, before the engine starts, a buffer or KV cache too small for one request of the
    model's context (exit 2: a refused configuration is never restarted)."""
    from dualpath.engine.capacity import check_capacity
    from dualpath.model.identity import kv_layout
    from dualpath.model.registry import read_config
    from dualpath.vllm.args import check_engine_kind, check_vllm_installed

    model_config = read_config(Path(config.model_dir) / "config.json")
    engine = config.engine
    if engine.engine == "vllm":
        check_vllm_installed()
    check_capacity(
        config.cluster,
        engine,
        kv_layout(model_config, engine.dtype, engine.block_size_tokens),
        engine.max_model_len or model_config.max_position_embeddings,
    )
    check_engine_kind(config.cluster, engine, model_config)

"""``dualpath vllm-config``: the ``--kv-transfer-config`` that makes a vLLM server one engine
of a dualpath cluster (``dualpath.vllm.served``)."""

from __future__ import annotations

import argparse
import json

from dualpath.cli.engine import add_engine_identity_arguments
from dualpath.cluster_options import (
    add_buffer_argument,
    add_heartbeat_argument,
    add_link_cap_arguments,
    add_mode_argument,
    add_transport_argument,
)
from dualpath.options import (
    ENGINES_BLOCK_SIZE_HELP,
    add_block_size_argument,
    add_dtype_argument,
    add_store_arguments,
)


def _http_url(text: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}")
    return text.rstrip("/")


def add_vllm_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "vllm-config",
        help="print the --kv-transfer-config that makes a vLLM server a dualpath engine",
        description="Print, as one line of JSON, vLLM's --kv-transfer-config for a vLLM server "
        "that joins a dualpath cluster as one prefill or decode engine: 'vllm serve MODEL "
        "--kv-transfer-config \"$(dualpath vllm-config ...)\"' (with vLLM's CPU build: "
        "'VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m vllm.entrypoints.openai.api_server "
        "--model MODEL --distributed-executor-backend uni ...', whose default multiprocess "
        "executor spins on its queues: docs/vllm.md). The server's "
        "connector joins the scheduler at --scheduler ('dualpath serve --external-engines') "
        "with the cluster token from $DUALPATH_CLUSTER_TOKEN in the server's environment, "
        "once the server answers at --url; the front door forwards requests there. The "
        "model, its context and the KV memory are vLLM's own; a vLLM block size or dtype "
        "other than the ones given here is refused when the server starts, naming the vLLM "
        "flag to pass. The package must be importable by the server's Python.",
    )
    add_engine_identity_arguments(p, required=True)
    p.add_argument(
        "--url",
        type=_http_url,
        required=True,
        help="this vLLM server's base URL as the front door reaches it, http://HOST:PORT",
    )
    add_store_arguments(p)
    add_block_size_argument(
        p,
        default_help=f"{ENGINES_BLOCK_SIZE_HELP}; decided when the server starts, from its "
        "model. Pass vLLM the same --block-size, and dualpath serve too",
    )
    add_dtype_argument(p, default="float32", default_help="float32; pass vLLM the same --dtype")
    add_buffer_argument(p, default_help="two requests of vLLM's context")
    add_mode_argument(p)
    add_transport_argument(p)
    add_link_cap_arguments(p)
    add_heartbeat_argument(p, default=5.0)
    p.set_defaults(func=_print_config)


def vllm_engine_config(args: argparse.Namespace):  # -> EngineProcessConfig
    """The engine's configuration the flags give (what vLLM decides is filled in by the
    connector when the server starts)."""
    from pathlib import Path

    from dualpath.cli.configs import engine_process_from_flags
    from dualpath.config import EngineConfig

    # Without --block-size, EngineConfig's stands in here; the printed configuration leaves it
    # out, and the server takes its model's when it starts (_print_config).
    block_size = {} if args.block_size is None else {"block_size_tokens": args.block_size}
    return engine_process_from_flags(
        args,
        model_dir=Path("."),  # vLLM's --model, set by the connector
        engine=EngineConfig(dtype=args.dtype, engine="vllm", **block_size),
        url=args.url,
    )


def _print_config(args: argparse.Namespace) -> int:
    from dualpath.vllm.args import served_kv_transfer_config

    config = served_kv_transfer_config(
        vllm_engine_config(args), has_block_size=args.block_size is not None
    )
    print(json.dumps(config, separators=(",", ":")))
    return 0

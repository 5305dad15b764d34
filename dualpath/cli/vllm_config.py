"""``dualpath vllm-config``: the ``--kv-transfer-config`` that makes a vLLM server one engine
of a dualpath cluster (``dualpath.cluster.served``)."""

from __future__ import annotations

import argparse
import json

from dualpath.cli.engine import _control_endpoint
from dualpath.flags import non_negative_int, positive_float, positive_int
from dualpath.options import (
    add_heartbeat_argument,
    add_link_cap_arguments,
    add_mode_argument,
    add_store_arguments,
    add_transport_argument,
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
        "'python -m vllm.entrypoints.openai.api_server --model MODEL ...'). The server's "
        "connector joins the scheduler at --scheduler ('dualpath serve --external-engines') "
        "with the cluster token from $DUALPATH_CLUSTER_TOKEN in the server's environment, "
        "once the server answers at --url; the front door forwards requests there. The "
        "model, its context and the KV memory are vLLM's own; a vLLM block size or dtype "
        "other than the ones given here is refused when the server starts, naming the vLLM "
        "flag to pass. The package must be importable by the server's Python.",
    )
    p.add_argument("--role", choices=("prefill", "decode"), required=True, help="PE or DE")
    p.add_argument(
        "--engine-id", type=non_negative_int, required=True, help="this engine's id in the topology"
    )
    p.add_argument("--node-id", type=non_negative_int, required=True, help="the node it belongs to")
    p.add_argument(
        "--scheduler",
        type=_control_endpoint,
        required=True,
        help="the scheduler's control endpoint, tcp://HOST:PORT (dualpath serve "
        "--scheduler-endpoint)",
    )
    p.add_argument(
        "--url",
        type=_http_url,
        required=True,
        help="this vLLM server's base URL as the front door reaches it, http://HOST:PORT",
    )
    add_store_arguments(p)
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=64,
        help="tokens per KV block, the store's and vLLM's (default 64; pass the same "
        "--block-size to vLLM and to dualpath serve)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the KV dtype, the store's and vLLM's (default float32; pass the same --dtype "
        "to vLLM)",
    )
    p.add_argument(
        "--buffer-gb",
        type=positive_float,
        default=None,
        help="this engine's host KV buffer, GB (default: two requests of vLLM's context)",
    )
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

    return engine_process_from_flags(
        args,
        model_dir=Path("."),  # vLLM's --model, set by the connector
        engine=EngineConfig(block_size_tokens=args.block_size, dtype=args.dtype, engine="vllm"),
        url=args.url,
    )


def _print_config(args: argparse.Namespace) -> int:
    from dualpath.vllm_args import served_kv_transfer_config

    config = served_kv_transfer_config(vllm_engine_config(args))
    print(json.dumps(config, separators=(",", ":")))
    return 0

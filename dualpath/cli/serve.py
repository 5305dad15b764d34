"""``dualpath serve``: an OpenAI-compatible API on a one-host PD-disaggregated cluster."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dualpath.cli.configs import engine_config, store_config
from dualpath.home import data_home, default_kv_store_dir, default_responses_dir
from dualpath.model.default import resolve_model_dir
from dualpath.options import SERVE_ENGINE_THREADS, add_engine_arguments
from dualpath.units import gb_to_bytes


def add_serve(sub: argparse._SubParsersAction) -> None:
    from dualpath.cli.serve_settings import add_serve_arguments, detach_defaults

    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API from a one-host PD-disaggregated cluster",
        description="Start the scheduler and the HTTP API in this process and every engine as "
        "its own process, then serve /v1/completions, /v1/chat/completions, /v1/responses, "
        "/v1/models, /tokenize, /detokenize, /health, /metrics and /version until SIGINT or "
        "SIGTERM. "
        "Without flags: the embedded SmolLM2-135M-Instruct (converted on first use), the store under "
        "$DUALPATH_HOME/kv, 1 prefill and 2 decode engines, no link caps, 127.0.0.1:8000.",
    )
    add_engine_arguments(p, default_threads=SERVE_ENGINE_THREADS)
    add_serve_arguments(p)
    p.set_defaults(func=_run_serve, serve_options=detach_defaults(p))


def _run_serve(args: argparse.Namespace) -> int:
    from dualpath.cli.serve_settings import resolve
    from dualpath.cluster.engine_processes import TOKEN_ENV
    from dualpath.cluster.launcher import LocalCluster
    from dualpath.config import DTYPES
    from dualpath.model.registry import read_config
    from dualpath.model.tokenizer import Tokenizer
    from dualpath.server.chat import ChatRenderer

    s = resolve(args, args.serve_options)
    token = os.environ.get(TOKEN_ENV) or None
    if s.external_engines and token is None:
        raise ValueError(f"--external-engines needs ${TOKEN_ENV}, shared with the engines")
    if s.local_prefill_tokens and s.engine != "vllm" and not s.external_engines:
        raise ValueError(
            "--local-prefill-tokens: our own engine's decode engines do not prefill; "
            "give it with --engine vllm"
        )
    if s.engine == "vllm" and not s.external_engines:  # the engines it starts run this Python
        from dualpath.vllm.args import check_vllm_installed

        check_vllm_installed()
    model_dir = resolve_model_dir(s.model)
    dtype = s.dtype or read_config(model_dir / "config.json").torch_dtype
    if dtype not in DTYPES:
        raise ValueError(f"the checkpoint's dtype {dtype!r} is not supported; pass --dtype")
    if s.device != "cpu" and not s.external_engines:
        from dualpath.model.loader import available_device  # lazy: torch

        available_device(s.device)  # here, not in each engine it would start
    tokenizer = Tokenizer(model_dir / "tokenizer.json")
    chat = ChatRenderer.for_checkpoint(model_dir)
    server_config = _serve_server_config(s, model_dir)
    cluster = LocalCluster(
        _serve_cluster_config(s),
        model_dir=model_dir,
        store=store_config(
            None if s.no_kv_store else (s.kv_store or default_kv_store_dir()),
            s.kv_store_capacity_gb,
        ),
        engine=engine_config(s, dtype, model_dir),
        transport=s.transport,
        prefill_tokens_per_s=s.prefill_tokens_per_s,
        attention_quota_s=s.attention_quota_s,
        log_dir=s.engine_log_dir or _server_log_dir(),
        spawn_engines=not s.external_engines,
        token=token,
        restart_engines=s.restart_engines,
    )
    from dualpath.server.context import ServingContext  # lazy, as the rest: after the checks
    from dualpath.server.serve import run_server

    context = ServingContext(server_config, cluster, tokenizer, chat)
    url = f"http://{server_config.host}:{server_config.port}"
    print(
        f"dualpath serve: model {server_config.served_model_name!r} on {url}; engines joining "
        f"the scheduler at {cluster.coordinator.endpoint} (GET /health turns 200 when ready); "
        f"KV blocks of {cluster.engine_config.block_size_tokens} tokens; "
        f"{_store_summary(cluster.store_config)}; engine logs in {cluster.log_dir}",
        file=sys.stderr,
        flush=True,
    )
    return run_server(
        context,
        on_ready=lambda: print(f"dualpath serve: ready on {url}", file=sys.stderr, flush=True),
    )


def _store_summary(store) -> str:  # store: KVStoreConfig
    if store.root_dir is None:
        return "no KV store"
    return f"KV store {store.root_dir} of at most {store.capacity_bytes / 1e9:.2f} GB"


def _server_log_dir() -> Path:
    """This server's own folder for its engines' logs: servers running side by side (or one
    after another) never write into each other's files."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return data_home() / "logs" / f"serve-{stamp}-{os.getpid()}"


def _serve_server_config(s: argparse.Namespace, model_dir: Path):  # -> ServerConfig
    from dualpath.server.config import ServerConfig

    return ServerConfig(
        served_model_name=s.served_model_name or model_dir.name,
        host=s.host,
        port=s.port,
        api_key=s.api_key or os.environ.get("DUALPATH_API_KEY") or None,
        max_waiting_requests=s.max_waiting_requests,
        max_request_bytes=s.max_request_bytes,
        max_prompt_tokens=s.max_prompt_tokens,
        engine_start_timeout_s=_engine_start_timeout_s(s),
        shutdown_timeout_s=s.shutdown_timeout_s,
        generation_config=s.generation_config,
        responses_dir=s.responses_dir or default_responses_dir(),
        responses_max_count=s.responses_max_count,
        responses_max_bytes=gb_to_bytes(s.responses_max_gb),
    )


def _engine_start_timeout_s(s: argparse.Namespace) -> float | None:
    """The flag's, else 300 s for engines this server starts (they should join within a
    minute), and no deadline for external ones: their servers start when their owners
    start them, and may load a checkpoint for many minutes."""
    if s.engine_start_timeout_s is not None:
        return s.engine_start_timeout_s
    return None if s.external_engines else 300.0


def _serve_cluster_config(s: argparse.Namespace):  # -> ClusterConfig
    from dualpath.config import ClusterConfig, TrafficConfig, parse_node_shape

    num_prefill_nodes, num_decode_nodes = parse_node_shape(s.nodes)
    buffer_bytes = None if s.buffer_gb is None else gb_to_bytes(s.buffer_gb)
    return ClusterConfig(
        num_prefill_nodes=num_prefill_nodes,
        num_decode_nodes=num_decode_nodes,
        engines_per_node=s.engines_per_node,
        nodes_per_group=s.nodes_per_group,
        mode=s.mode,
        read_path=s.read_path,
        traffic=TrafficConfig(
            snic_bandwidth_gbps=s.snic_gbps,
            cnic_bandwidth_gbps=s.cnic_gbps,
            host_memory_bandwidth_gbps=s.host_memory_gbps,
        ),
        prefill_buffer_bytes=buffer_bytes,
        decode_buffer_bytes=buffer_bytes,
        control_endpoint=s.scheduler_endpoint,
        heartbeat_timeout_s=s.heartbeat_timeout_s,
        persist_wait_s=s.persist_wait_s,
        session_retention_s=s.session_retention_s,
        local_prefill_tokens=s.local_prefill_tokens,
    )

"""The cluster options several ``dualpath`` commands share (``serve``, ``engine``,
``vllm-config``, ``plan``, the benchmarks): the shape, the mode and read path, link caps,
engine memory, transport, liveness and the compute quota, each defined once here, as
``dualpath.options`` does for the model, store, workload and output options.

    add_nodes_argument(parser, default="1P2D")
    add_link_cap_arguments(group)
"""

from __future__ import annotations

import argparse

from dualpath.config import MODES, READ_PATHS
from dualpath.flags import non_negative_float, port_number, positive_float, positive_int


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

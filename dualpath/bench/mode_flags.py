"""One mode's cluster as command-line flags: ``dualpath serve``'s for a server with its
engines below it, and split between a router and its engine processes (``--links kernel``).

    args = serve_args(run, store_dir, log_dir)  # dualpath serve ...
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dualpath.bench.spec import VLLM_SERVERS

if TYPE_CHECKING:
    from dualpath.bench.harness import ModeRun

SERVED_MODEL_NAME = "dualpath-bench"


def serve_args(run: ModeRun, store_dir: Path, log_dir: Path) -> list[str]:
    """``dualpath serve``'s flags for ``run`` (not for "vllm-servers": ``served_run.py``)."""
    if run.engine == VLLM_SERVERS:
        raise RuntimeError("caller bug: the vLLM servers' deployment is served_run.py's")
    args = [
        "--model", str(run.model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--kv-store", str(store_dir),
        "--mode", run.mode,
        "--nodes", run.nodes,
        "--snic-gbps", str(run.snic_bandwidth_gbps),
        "--cnic-gbps", str(run.cnic_bandwidth_gbps),
        "--transport", run.transport,
        "--engine-log-dir", str(log_dir),
    ]  # fmt: skip
    args += scheduler_flags(run) + engine_kind_flags(run) + vllm_arg_flags(run)
    return args + list(run.extra_serve_args)


def scheduler_flags(run: ModeRun) -> list[str]:
    """The flags of ``run`` that only the server (its scheduler and API) takes."""
    # No request may be refused for queueing in a benchmark: every agent is in flight.
    args = ["--max-waiting-requests", "100000"]
    if run.read_path is not None:
        args += ["--read-path", run.read_path]
    if run.prefill_tokens_per_s is not None:
        args += ["--prefill-tokens-per-s", f"{run.prefill_tokens_per_s:.1f}"]
    if run.max_prompt_tokens is not None:
        args += ["--max-prompt-tokens", str(run.max_prompt_tokens)]
    return args


def engine_kind_flags(run: ModeRun) -> list[str]:
    """What runs the model (the server and every engine process take them)."""
    args = []
    if run.engine != "native":
        args += ["--engine", run.engine]
    if run.kv_cache_gb is not None:
        args += ["--kv-cache-gb", str(run.kv_cache_gb)]
    if run.attention_quota_s is not None:
        args += ["--attention-quota-s", str(run.attention_quota_s)]
    if run.vllm_prefill_batching != "vllm":
        args += ["--vllm-prefill-batching", run.vllm_prefill_batching]
    return args


def vllm_arg_flags(run: ModeRun) -> list[str]:
    """``--vllm-arg KEY=VALUE`` for each of ``run``'s vLLM engine arguments."""
    return [
        arg for key, value in run.vllm_args for arg in ("--vllm-arg", f"{key}={json.dumps(value)}")
    ]

"""One mode's run on DualPath inside vLLM servers (``bench offline --vllm-servers``): the
served deployment (``served_cluster.py``) as ``harness.run_mode`` starts it.

    servers = start_served(run, store_dir, log_dir)  # run.engine == "vllm-servers"
    ... replay against servers.url, sample its /metrics ...
    exit_codes = servers.stop()

Each ``ModeRun`` field goes where the deployment takes it, so that a mode runs in the regime
``serve --engine vllm`` gives it:

- ``nodes``, ``mode``, ``read_path``, ``transport`` and the SNIC/CNIC caps: the front door's
  flags and every ``dualpath vllm-config`` (the engines enforce the caps);
- the engines' KV memory (``kv_cache_gb``, None: serve's 1 GB): vLLM's
  ``--num-gpu-blocks-override`` of that many bytes' Full Blocks, in as many whole GiB of
  ``VLLM_CPU_KVCACHE_SPACE`` as it takes, as ``serve --engine vllm`` sizes its vLLM engines;
- the context: the checkpoint's, given to the front door and every server (``--max-model-len``),
  with serve's dtype (the checkpoint's) and block size;
- ``prefill_tokens_per_s``, ``max_prompt_tokens``, ``attention_quota_s`` and
  ``extra_serve_args``: the front door's flags.

What the servers cannot be told is refused by name (``check_served_engine``): vLLM engine
arguments (``--vllm-arg``: the servers' command lines are the benchmark's) and
``--vllm-prefill-batching quota`` (a vLLM server's own scheduler forms its batches).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath.bench.kernel_links import no_nic_sampler
from dualpath.bench.process_cpu import ProcessCpu
from dualpath.bench.spec import BLOCK_SIZE_TOKENS
from dualpath.model.identity import kv_layout
from dualpath.model.registry import read_config
from dualpath.units import gb_to_bytes
from dualpath.vllm.args import vllm_cpu_kv_memory
from dualpath.vllm.bench.served_cluster import SERVED_MODEL_NAME, ServedCluster, ServedShape

if TYPE_CHECKING:
    from dualpath.bench.harness import ModeRun

DEFAULT_KV_CACHE_GB = 1.0  # serve --kv-cache-gb's default: what its vLLM engines get
# No request may be refused for queueing in a benchmark: every agent is in flight.
MAX_WAITING_REQUESTS = 100_000


def check_served_engine(vllm_args: Mapping[str, Any], vllm_prefill_batching: str) -> None:
    """``ValueError`` naming the flag, for engine settings the vLLM servers cannot be given."""
    if vllm_args:
        raise ValueError(
            f"--vllm-servers: --vllm-arg ({', '.join(vllm_args)}) is not passed to the vLLM "
            "servers, whose command lines the benchmark writes (served_cluster.py); leave it "
            "out, or run --engine vllm without --vllm-servers"
        )
    if vllm_prefill_batching != "vllm":
        raise ValueError(
            f"--vllm-servers: --vllm-prefill-batching {vllm_prefill_batching} is our prefill "
            "engine's batcher; a vLLM server's own scheduler forms its batches: leave it out, "
            "or run --engine vllm without --vllm-servers"
        )


def served_shape(run: ModeRun) -> ServedShape:
    """The deployment ``run`` describes (module docstring)."""
    check_served_engine(dict(run.vllm_args), run.vllm_prefill_batching)
    config = read_config(Path(run.model_dir) / "config.json")
    dtype = config.torch_dtype  # serve's --dtype default
    layout = kv_layout(config, dtype, BLOCK_SIZE_TOKENS)
    kv_cache_bytes = gb_to_bytes(run.kv_cache_gb or DEFAULT_KV_CACHE_GB)
    kv_cache_gib, num_gpu_blocks = vllm_cpu_kv_memory(kv_cache_bytes, layout.full_block_bytes)
    return ServedShape(
        nodes=run.nodes,
        mode=run.mode,
        read_path=run.read_path,
        block_size=BLOCK_SIZE_TOKENS,
        dtype=dtype,
        max_model_len=config.max_position_embeddings,
        kv_cache_gib=kv_cache_gib,
        num_gpu_blocks=num_gpu_blocks,
        snic_gbps=run.snic_bandwidth_gbps,
        cnic_gbps=run.cnic_bandwidth_gbps,
        transport=run.transport,
        serve_args=front_door_args(run),
    )


def front_door_args(run: ModeRun) -> tuple[str, ...]:
    """The front door's flags beyond the shape's: its admission and the scheduler's."""
    args = ["--max-waiting-requests", str(MAX_WAITING_REQUESTS)]
    if run.prefill_tokens_per_s is not None:
        args += ["--prefill-tokens-per-s", f"{run.prefill_tokens_per_s:.1f}"]
    if run.max_prompt_tokens is not None:
        args += ["--max-prompt-tokens", str(run.max_prompt_tokens)]
    if run.attention_quota_s is not None:
        args += ["--attention-quota-s", str(run.attention_quota_s)]
    return (*args, *run.extra_serve_args)


class ServedServers:
    """A started deployment, as ``harness.run_mode`` drives it: the agents and the /metrics
    sampler go to the front door, which reports the engines' link and read counters (they
    reach it through the scheduler, as our engines' do)."""

    served_model_name = SERVED_MODEL_NAME  # the front door's and every vLLM server's

    def __init__(self, cluster: ServedCluster) -> None:
        self.cluster = cluster

    @property
    def url(self) -> str:
        return self.cluster.url

    def process_cpu(self) -> ProcessCpu:
        """The front door's and every vLLM server's cores (each server with its engine core)."""
        return ProcessCpu(self.cluster.pids())

    def stop(self) -> dict:
        """Stop them; the result's ``server_exit_code`` (the front door's) and
        ``vllm_server_exit_codes``."""
        exit_codes = self.cluster.stop()
        front_door = exit_codes.pop("front door")
        return {"server_exit_code": front_door, "vllm_server_exit_codes": exit_codes}

    def nic_sampler(self) -> AbstractContextManager[None]:
        """No NIC of its own: the servers share this host's."""
        return no_nic_sampler()


def start_served(run: ModeRun, store_dir: Path, log_dir: Path) -> ServedServers:
    """``run``'s deployment, started (every engine joined, every server answering); its store
    in ``store_dir``, the front door's and the servers' logs in ``log_dir``."""
    cluster = ServedCluster(
        run.model_dir, log_dir, served_shape(run), store_dir=store_dir, log_dir=log_dir
    )
    try:
        cluster.start()
    except BaseException:  # a server that failed to start: stop the others
        cluster.stop()
        raise
    return ServedServers(cluster)

"""vLLM's own serving systems of ``bench vs-vllm``, started on this host and replayed against:

    result = run_vllm_system("vllm-single", workload, model_dir=..., kv_cache_bytes=..., ...)

``vllm-single`` is one ``vllm.entrypoints.openai.api_server`` on every core (its threads bound to
them, prefix caching on); ``vllm-pd-<P>P<D>D`` is vLLM's own prefill/decode disaggregation, one
server per instance with its NixlConnector (``kv_buffer_device: cpu``), instance i on core
i mod cores (``VLLM_CPU_OMP_THREADS_BIND``), fronted by ``pd_proxy`` as vLLM's docs describe.
Each instance gets exactly the KV blocks its bytes hold (``--num-gpu-blocks-override``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dualpath.bench.harness import SERVED_MODEL_NAME, run_against_url
from dualpath.bench.process_cpu import ProcessCpu
from dualpath.bench.server_process import ChildServer
from dualpath.bench.spec import BLOCK_SIZE_TOKENS
from dualpath.model.identity import kv_layout
from dualpath.model.registry import read_config
from dualpath.vllm.args import vllm_cpu_kv_memory

NIXL_SIDE_CHANNEL_BASE_PORT = 5600  # vLLM's default; instance i listens on base + i


def system_nodes(system: str) -> tuple[int, int]:
    """(prefill, decode) instances of a ``*-<P>P<D>D`` system."""
    shape = system.rsplit("-", 1)[1]
    num_prefill, num_decode = shape.removesuffix("D").split("P")
    return int(num_prefill), int(num_decode)


def _core_set(cores: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``'s form of a core list: ``0,1`` (or one core)."""
    return ",".join(str(core) for core in cores)


@dataclass(frozen=True, slots=True)
class VllmInstance:
    """One ``vllm.entrypoints.openai.api_server`` of a vLLM system."""

    cores: tuple[int, ...]
    kv_cache_bytes: int  # vLLM gets exactly the blocks these bytes hold (``vllm_cpu_kv_memory``)
    kv_transfer: bool  # with vLLM's NixlConnector (a P/D instance)
    side_channel_port: int


class VllmServer(ChildServer):
    """vLLM's OpenAI-compatible server (its own CLI module) as a child process."""

    name = "vLLM's api_server"

    def __init__(
        self,
        model_dir: Path,
        instance: VllmInstance,
        *,
        max_model_len: int,
        full_block_bytes: int,
        log_path: Path,
    ) -> None:
        kv_cache_gib, self.num_kv_blocks = vllm_cpu_kv_memory(
            instance.kv_cache_bytes, full_block_bytes
        )
        super().__init__(
            log_path=log_path,
            env={
                "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": _core_set(list(instance.cores)),
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(instance.side_channel_port),
            },
        )
        self.model_dir = model_dir
        self.instance = instance
        self.max_model_len = max_model_len

    def argv(self, port: int) -> list[str]:
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", SERVED_MODEL_NAME,
            "--dtype", "float32",
            "--block-size", str(BLOCK_SIZE_TOKENS),
            "--num-gpu-blocks-override", str(self.num_kv_blocks),
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",  # cached_tokens in usage, as ours reports it
            "--seed", "0",
            "--host", "127.0.0.1",
            "--port", str(port),
        ]  # fmt: skip
        if self.instance.kv_transfer:
            config = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
            argv += ["--kv-transfer-config", json.dumps({**config, "kv_buffer_device": "cpu"})]
        return argv


class ProxyServer(ChildServer):
    """``pd_proxy`` in front of one prefill and N decode instances."""

    name = "the P/D proxy"

    def __init__(self, prefill_url: str, decode_urls: list[str], *, log_path: Path) -> None:
        super().__init__(log_path=log_path)
        self.prefill_url = prefill_url
        self.decode_urls = decode_urls

    def argv(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "dualpath.vllm.bench.pd_proxy", "--prefill", self.prefill_url]
        for url in self.decode_urls:
            argv += ["--decode", url]
        return argv + ["--port", str(port)]


def _merge_cpu(parts: dict[str, dict]) -> dict:
    """One ``process_cpu`` from each server's (``ProcessCpu.stop``), labels prefixed."""
    cores = {
        f"{name}/{label}": value
        for name, cpu in parts.items()
        for label, value in cpu["cores"].items()
    }
    client = max(cpu["client_cores"] for cpu in parts.values())
    return {
        "cores": cores,
        "total_cores": round(sum(cores.values()) + client, 3),
        "client_cores": client,
        "machine_cores": os.cpu_count(),
        "wall_s": max(cpu["wall_s"] for cpu in parts.values()),
    }


def run_vllm_system(
    system: str,
    workload,
    *,
    model_dir: Path,
    max_model_len: int,
    kv_cache_bytes: int,
    work_dir: Path,
    start_timeout_s: float,
    pause_s: float | None = None,
) -> dict:
    """Serve ``system`` with vLLM alone, replay ``workload`` against it, return its figures.
    ``kv_cache_bytes``: each instance's KV memory."""
    num_cores = os.cpu_count() or 1
    log_dir = work_dir / f"logs-{system}"
    config = read_config(model_dir / "config.json")
    full_block_bytes = kv_layout(config, "float32", BLOCK_SIZE_TOKENS).full_block_bytes
    servers: dict[str, ChildServer] = {}

    def server(instance: VllmInstance, role: str) -> VllmServer:
        return VllmServer(
            model_dir,
            instance,
            max_model_len=max_model_len,
            full_block_bytes=full_block_bytes,
            log_path=log_dir / f"{role}.log",
        )

    if system == "vllm-single":
        instance = VllmInstance(tuple(range(num_cores)), kv_cache_bytes, False, 0)
        servers["single"] = server(instance, "single")
    else:
        num_prefill, num_decode = system_nodes(system)
        if num_prefill != 1:
            raise ValueError(f"{system}: the proxy fronts one prefill instance")
        for i, role in enumerate(["prefill", *(f"decode-{d}" for d in range(num_decode))]):
            instance = VllmInstance(
                (i % num_cores,), kv_cache_bytes, True, NIXL_SIDE_CHANNEL_BASE_PORT + i
            )
            servers[role] = server(instance, role)
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            server.launch()
            stack.callback(server.stop)
        for server in servers.values():
            server.wait_ready(start_timeout_s)
        if system == "vllm-single":
            front = servers["single"]
        else:
            decoders = [s.url for role, s in servers.items() if role.startswith("decode")]
            front = ProxyServer(servers["prefill"].url, decoders, log_path=log_dir / "proxy.log")
            front.launch()
            stack.callback(front.stop)
            front.wait_ready(start_timeout_s)
            servers["proxy"] = front
        cpus = {role: ProcessCpu(server.pid).start() for role, server in servers.items()}
        result = run_against_url(
            front.url, SERVED_MODEL_NAME, workload, api_key=None, pause_s=pause_s
        )
        result["process_cpu"] = _merge_cpu({role: cpu.stop() for role, cpu in cpus.items()})
    return result

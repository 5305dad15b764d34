"""`dualpath bench vs-vllm`: dualpath on vLLM engines against vLLM's own serving, one replay.

    .venv-vllm/bin/dualpath bench vs-vllm --json results/vs_vllm.json

The same agentic replay (real sessions, every agent at once, no link caps) against each system
in turn, one at a time, each on a fresh store and fresh processes:

    dualpath-1P1D, dualpath-1P2D   ``dualpath serve --engine vllm --read-path pe`` of that shape:
                                   our scheduler, store and transport, vLLM's engine in each
                                   engine process (one core each, engine e on core e mod cores)
    vllm-pd-1P1D, vllm-pd-1P2D     vLLM's own prefill/decode disaggregation of the same shape:
                                   one ``vllm.entrypoints.openai.api_server`` per instance with
                                   its NixlConnector (``kv_buffer_device: cpu``), instance i on
                                   core i mod cores (``VLLM_CPU_OMP_THREADS_BIND``), fronted by
                                   ``pd_proxy`` as vLLM's docs describe
    vllm-single                    one vLLM instance on every core (its threads bound to them),
                                   its KV cache the size of the 1P1D shape's two engines' caches

Every vLLM instance and every engine of ours gets the same checkpoint, dtype (float32), block
size (64), eager mode, prefix caching and per-engine KV cache (``--kv-cache-gb``). The figures
depend on this host: its cores are shared by every process of a system and by the client.

JSON: ``modes`` (one entry per system, as the other benchmarks' modes, so the same summary
and plots: each system's ``jct_s``, ``ttft_s``/``tpot_s`` percentiles, ``hit_ratio``, ``process_cpu``,
``num_failed`` ...), ``ratios`` (``<ours>_vs_<theirs>_jct``: the other system's JCT over
ours, above 1 when ours is faster; and ours over the single instance's), ``targets`` (faster
than vLLM's P/D of the same shape; within 1.3x of the single instance). A failed request in
any system makes the run invalid (exit 1, no ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dualpath.bench.arguments import add_preset_argument
from dualpath.bench.hardware import hardware_info
from dualpath.bench.harness import (
    SERVED_MODEL_NAME,
    ModeRun,
    run_against_url,
    run_mode,
    token_mismatches,
)
from dualpath.bench.offline import load_workload, workload_report
from dualpath.bench.presets import PRESETS
from dualpath.bench.process_cpu import ProcessCpu
from dualpath.bench.report import add_output_arguments, finish
from dualpath.bench.server_process import ChildServer
from dualpath.bench.spec import (
    BLOCK_SIZE_TOKENS,
    EngineSpec,
    RunSpec,
    VsVllmSpec,
    modes_of,
    output_spec,
    workload_spec,
)
from dualpath.bench.validity import mark_validity, mode_problems
from dualpath.cluster_options import add_kv_cache_argument
from dualpath.flags import positive_float
from dualpath.model.identity import kv_layout
from dualpath.model.registry import read_config
from dualpath.options import (
    add_clones_argument,
    add_max_sessions_argument,
    add_model_argument,
    add_seed_argument,
    add_threads_argument,
    add_trace_argument,
    add_trace_shape_arguments,
)
from dualpath.units import gb_to_bytes
from dualpath.vllm.args import (
    add_vllm_arg_argument,
    check_vllm_args,
    check_vllm_installed,
    vllm_cpu_kv_memory,
)

SYSTEMS = ("dualpath-1P1D", "dualpath-1P2D", "vllm-pd-1P1D", "vllm-pd-1P2D", "vllm-single")
# The replay when no flag reshapes it: the first 6 real agentic-coding sessions, 12 turns each,
# at 8% of their length (contexts up to ~6K tokens of SmolLM2's 8K), all at once, no clones.
DEFAULT_SHAPE = {"max_sessions": 6, "max_turns": 12, "length_scale": 0.08, "clones": 0}
WITHIN_SINGLE = 1.3  # ours over the single instance's JCT, at most (the target)
NIXL_SIDE_CHANNEL_BASE_PORT = 5600  # vLLM's default; instance i listens on base + i


def _nodes(system: str) -> tuple[int, int]:
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
) -> dict:
    """Serve ``system`` with vLLM alone, replay ``workload`` against it, return its figures."""
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
        instance = VllmInstance(tuple(range(num_cores)), 2 * kv_cache_bytes, False, 0)
        servers["single"] = server(instance, "single")
    else:
        num_prefill, num_decode = _nodes(system)
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
        result = run_against_url(front.url, SERVED_MODEL_NAME, workload, api_key=None)
        result["process_cpu"] = _merge_cpu({role: cpu.stop() for role, cpu in cpus.items()})
    return result


def run_dualpath_system(system: str, workload, spec: VsVllmSpec, work_dir: Path) -> dict:
    """``dualpath serve --engine vllm --read-path pe`` of the system's shape, no link caps."""
    nodes = system.rsplit("-", 1)[1]
    run = ModeRun(
        mode="basic",
        model_dir=spec.run.model_dir,
        nodes=nodes,
        snic_bandwidth_gbps=0.0,
        read_path="pe",
        engine="vllm",
        vllm_args=tuple(sorted(spec.run.engine.vllm_args)),
        extra_serve_args=(
            *("--kv-cache-gb", f"{spec.kv_cache_gb:g}"),
            *("--threads", str(spec.threads)),
        ),
    )
    return run_mode(run, workload, work_dir=work_dir / system)


def compare(spec: VsVllmSpec, workload, work_dir: Path) -> dict:
    """Each system's figures, the ratios and the targets (the report, before validity)."""
    model_dir = spec.run.model_dir
    config = read_config(model_dir / "config.json")
    systems = spec.run.modes
    results = {}
    for system in systems:
        print(f"== {system}", file=sys.stderr, flush=True)
        if system.startswith("dualpath"):
            results[system] = run_dualpath_system(system, workload, spec, work_dir)
        else:
            results[system] = run_vllm_system(
                system,
                workload,
                model_dir=model_dir,
                max_model_len=config.max_position_embeddings,
                kv_cache_bytes=gb_to_bytes(spec.kv_cache_gb),
                work_dir=work_dir,
                start_timeout_s=spec.start_timeout_s,
            )
    reference = results[systems[0]]["tokens"]
    for result in results.values():
        # Informational: systems may part at a near tie (a cached and an uncached prefill
        # need not be bit-exact in vLLM), and an agent's later prompts then differ too.
        result["token_mismatches"] = token_mismatches(result.pop("tokens"), reference)
    ratios: dict[str, float] = {}
    targets: dict[str, bool] = {}
    for ours in (s for s in systems if s.startswith("dualpath")):
        shape = ours.rsplit("-", 1)[1]
        jct = results[ours]["jct_s"]
        theirs = f"vllm-pd-{shape}"
        if theirs in results:
            ratios[f"{ours}_vs_{theirs}_jct"] = results[theirs]["jct_s"] / jct
            targets[f"{ours}_faster_than_{theirs}"] = results[theirs]["jct_s"] > jct
        if "vllm-single" in results:
            ratio = jct / results["vllm-single"]["jct_s"]
            ratios[f"{ours}_over_vllm-single_jct"] = ratio
            targets[f"{ours}_within_{WITHIN_SINGLE:g}x_vllm-single"] = ratio <= WITHIN_SINGLE
    return {"modes": results, "ratios": ratios, "targets": targets}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated systems to run, in order (of {', '.join(SYSTEMS)}; default all); "
        "token agreement is counted against the first",
    )
    add_model_argument(parser)
    add_preset_argument(parser, default="agentic")
    add_seed_argument(parser)
    add_trace_argument(parser)
    max_sessions, clones = DEFAULT_SHAPE["max_sessions"], DEFAULT_SHAPE["clones"]
    add_max_sessions_argument(parser, default=max_sessions, default_help=str(max_sessions))
    add_trace_shape_arguments(
        parser,
        defaults={**DEFAULT_SHAPE, "gen_scale": None},
        default_help={
            "length_scale": f"{DEFAULT_SHAPE['length_scale']}, contexts up to ~6K tokens",
            "max_turns": str(DEFAULT_SHAPE["max_turns"]),
            "gen_scale": "the preset's",
        },
    )
    add_clones_argument(parser, default=clones, default_help=str(clones))
    add_kv_cache_argument(
        parser,
        default=1.0,
        default_help="1",
        detail=" and per vLLM instance (the single instance gets twice this): vLLM's "
        "--num-gpu-blocks-override of that many bytes' blocks, in as many whole GiB of "
        "VLLM_CPU_KVCACHE_SPACE as it takes (an integer in vLLM 0.32), as serve --engine "
        "vllm sizes its engines",
    )
    add_threads_argument(
        parser,
        default=1,
        default_help="1",
        detail=" of ours (serve --threads; engine e on cores e*threads ...: with as many "
        "threads as cores every engine may use every core)",
    )
    parser.add_argument(
        "--start-timeout-s",
        type=positive_float,
        default=600.0,
        help="how long a vLLM instance may take to start (default 600)",
    )
    add_vllm_arg_argument(parser, where="for dualpath serve's vLLM engines (not vLLM's own)")
    add_output_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from dualpath.model.default import resolve_model_dir

    systems = modes_of(args.systems, "")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise ValueError(
            f"--systems: unknown {', '.join(unknown) or 'none given'}; choose from "
            f"{', '.join(SYSTEMS)}"
        )
    vllm_args = dict(args.vllm_arg or ())
    check_vllm_args(vllm_args)
    check_vllm_installed()
    spec = vs_vllm_spec(args, resolve_model_dir(args.model, tiny=False))
    shape = spec.run.workload.shape(PRESETS[args.preset])
    workload = load_workload(shape, model_dir=spec.run.model_dir, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="dualpath-vs-vllm-") as tmp:
        compared = compare(spec, workload, Path(tmp))
    report = {
        "benchmark": "vs-vllm",
        "preset": args.preset,
        "seed": args.seed,
        "model": str(spec.run.model_dir),
        "kv_cache_gb_per_engine": spec.kv_cache_gb,
        "threads_per_engine": spec.threads,
        # Set for every process the benchmark starts (OpenMP's idle threads spin or sleep).
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "hardware": hardware_info(),
        **workload_report(workload, shape),
        **compared,
    }
    problems = [p for system, r in report["modes"].items() for p in mode_problems(system, r)]
    mark_validity(report, problems)
    return finish(report, args, "vs_vllm")


def vs_vllm_spec(args: argparse.Namespace, model_dir: Path) -> VsVllmSpec:
    """``bench vs-vllm``'s command line as one run: the systems are its modes."""
    return VsVllmSpec(
        run=RunSpec(
            model_dir=model_dir,
            workload=workload_spec(args),
            modes=modes_of(args.systems, ""),
            engine=EngineSpec(engine="vllm", vllm_args=tuple(dict(args.vllm_arg or ()).items())),
            output=output_spec(args),
        ),
        kv_cache_gb=args.kv_cache_gb,
        threads=args.threads,
        start_timeout_s=args.start_timeout_s,
    )

"""DualPath inside vLLM servers, started on this host the way users deploy it: one vLLM OpenAI
server per engine with ``--kv-transfer-config "$(dualpath vllm-config ...)"``, and
``dualpath serve --external-engines`` in front (``dualpath.vllm.served``).

    with ServedCluster(model_dir, root, nodes="1P2D", read_path="de") as cluster:
        ... drive cluster.url (the front door) with HTTP clients ...
        cluster.kill_engine(2)          # SIGKILL that vLLM server, every process of it
        cluster.start_engine(2)         # the same server again, on the same store

Each engine gets ``kv_cache_gib`` of KV memory (``num_gpu_blocks`` of it, when given: vLLM's
``--num-gpu-blocks-override``). The benchmarks (``served_run.py``) and the tests start it.

Each server runs vLLM's single-process executor (``--distributed-executor-backend uni`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``UNIPROC_ENV`` and ``UNIPROC_ARGS``), as vLLM does on one
GPU, its threads on every core (the CPU build binds a worker's threads,
``VLLM_CPU_OMP_THREADS_BIND``, only in a worker process of its own) and one torch thread per
server (``OMP_NUM_THREADS=1``, as ``dualpath serve`` gives each of its engines). The CPU build
otherwise forces its multiprocess executor: the worker is a process of its own, bound to one
core, and it and the engine core both spin on their shared-memory queue for 1 s after every read
(``SpinCondition.busy_loop_s``), so three servers' spinning took the cores the prefill engine
needed. ``bench offline --vllm-servers --preset paper-ratio`` on 2 cores, the same caps: JCT
71.4 / 53.9 / 43.9 s (basic / dualpath / oracle), the prefill engine 44% busy, with it; 48.1 /
31.2 / 29.9 s, 87% busy, without it (torch's default threads); 26.9 / 16.4 / 17.0 s with one
thread per server (its own calibration).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dualpath.bench.server_process import ChildServer, ServerProcess, _free_port
from dualpath.lifetime import die_with_parent

# vLLM's single-process executor (module docstring): the flag, and the variable without which
# the CPU build replaces it with the multiprocess one.
UNIPROC_ARGS = ("--distributed-executor-backend", "uni")
UNIPROC_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

TOKEN_ENV = "DUALPATH_CLUSTER_TOKEN"  # as dualpath.cluster.engine_processes names it
# The front door's model name. The vLLM servers answer to theirs, vLLM's default (the
# checkpoint's path), as in docs/vllm.md §0: the front door sends them requests under it.
SERVED_MODEL_NAME = "dualpath-served"


@dataclass(frozen=True)
class ServedShape:
    """What the front door and every engine must agree on, and the vLLM servers' own args."""

    nodes: str = "1P2D"
    mode: str = "dualpath"
    read_path: str | None = None
    block_size: int = 64
    dtype: str = "float32"
    max_model_len: int = 4160
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: the memory vLLM's CPU build sets aside
    # vLLM's --num-gpu-blocks-override: exactly this many KV blocks of that memory (None: all
    # it holds); what ``serve --engine vllm`` gives its engines for --kv-cache-gb.
    num_gpu_blocks: int | None = None
    # Both sides' --heartbeat-timeout-s (None: their defaults). Engines send heartbeats from a
    # thread of their own, so a long step beside busy neighbours needs no longer timeout.
    heartbeat_timeout_s: float | None = None
    snic_gbps: float = 0.0  # every node's SNIC cap (0: none), enforced by the engines
    cnic_gbps: float = 0.0
    transport: str = "nixl"  # PE<->DE KV transport (vllm-config and serve --transport)
    serve_args: tuple[str, ...] = ()  # more `dualpath serve` flags
    vllm_args: tuple[str, ...] = ()  # more vLLM server flags
    engine_roles: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        num_prefill, num_decode = _parse_nodes(self.nodes)
        roles = ("prefill",) * num_prefill + ("decode",) * num_decode
        object.__setattr__(self, "engine_roles", roles)


def _parse_nodes(nodes: str) -> tuple[int, int]:
    upper = nodes.upper()
    prefill, _, decode = upper.partition("P")
    return int(prefill), int(decode.rstrip("D"))


class VllmEngineServer(ChildServer):
    """One vLLM OpenAI server that is engine ``engine_id`` of the cluster; in a process
    group of its own, so that ``kill`` takes its engine-core and worker processes too."""

    name = "vLLM server"

    def __init__(
        self,
        model_dir: Path,
        shape: ServedShape,
        engine_id: int,
        *,
        scheduler: str,
        store_dir: Path,
        token: str,
        log_path: Path,
    ) -> None:
        super().__init__(
            log_path=log_path,
            env={
                TOKEN_ENV: token,
                "VLLM_CPU_KVCACHE_SPACE": str(shape.kv_cache_gib),
                **UNIPROC_ENV,
                # Servers sharing a host: one torch thread each, as serve's engines (on an
                # oversubscribed CPU every OpenMP barrier waits a scheduler tick).
                "OMP_NUM_THREADS": "1",
            },
        )
        self.model_dir, self.shape, self.engine_id = model_dir, shape, engine_id
        self.scheduler, self.store_dir = scheduler, store_dir
        self.name = f"vLLM server of engine {engine_id}"
        # Where the front door reaches this server (vllm-config --url), when not its own
        # address: a proxy in front of it. Set ``port`` too, so the proxy knows where to go.
        self.advertised_url: str | None = None

    def vllm_config_argv(self, port: int) -> list[str]:
        """The ``dualpath vllm-config`` command for this engine."""
        shape = self.shape
        argv = [
            sys.executable, "-m", "dualpath.cli", "vllm-config",
            "--role", shape.engine_roles[self.engine_id],
            "--engine-id", str(self.engine_id), "--node-id", str(self.engine_id),
            "--scheduler", self.scheduler,
            "--url", self.advertised_url or f"http://127.0.0.1:{port}",
            "--kv-store", str(self.store_dir), "--block-size", str(shape.block_size),
            "--dtype", shape.dtype, "--mode", shape.mode,
        ]  # fmt: skip
        if shape.heartbeat_timeout_s is not None:
            argv += ["--heartbeat-timeout-s", str(shape.heartbeat_timeout_s)]
        if shape.snic_gbps:
            argv += ["--snic-gbps", str(shape.snic_gbps)]
        if shape.cnic_gbps:
            argv += ["--cnic-gbps", str(shape.cnic_gbps)]
        return argv + ["--transport", shape.transport]

    def kv_transfer_config(self, port: int) -> str:
        """What ``dualpath vllm-config`` prints for this engine (run as users run it)."""
        done = subprocess.run(self.vllm_config_argv(port), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"dualpath vllm-config for engine {self.engine_id} exited with "
                f"{done.returncode}: {done.stderr.strip()[-2000:]}"
            )
        return done.stdout.strip()

    def argv(self, port: int) -> list[str]:
        return [*self.server_argv(port), "--kv-transfer-config", self.kv_transfer_config(port)]

    def server_argv(self, port: int) -> list[str]:
        """The vLLM server's command but its ``--kv-transfer-config``."""
        shape = self.shape
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--dtype", shape.dtype, "--block-size", str(shape.block_size),
            "--max-model-len", str(shape.max_model_len), "--enforce-eager", "--seed", "0",
            "--enable-prompt-tokens-details", *UNIPROC_ARGS,
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        if shape.num_gpu_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(shape.num_gpu_blocks)]
        return argv + list(shape.vllm_args)

    keeps_port = True

    @staticmethod
    def preexec() -> None:
        """A process group of its own (``kill`` takes all of it), gone with the caller."""
        os.setsid()
        die_with_parent()

    def kill(self) -> None:
        """SIGKILL every process of the server (a host that dies)."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever of it is left
        return process.returncode


class ServedCluster:
    """The front door and one vLLM server per engine (see the module docstring)."""

    def __init__(
        self,
        model_dir: Path,
        root: Path,
        shape: ServedShape | None = None,
        *,
        start_timeout_s: float = 600.0,
        store_dir: Path | None = None,
        log_dir: Path | None = None,
    ) -> None:
        """The store in ``store_dir`` and the servers' logs in ``log_dir`` (default: ``kv``
        and ``logs`` under ``root``)."""
        self.model_dir, self.root = Path(model_dir), Path(root)
        self.shape = shape or ServedShape()
        self.start_timeout_s = start_timeout_s
        self.token = secrets.token_hex(16)
        self.store_dir = Path(store_dir) if store_dir is not None else self.root / "kv"
        self.log_dir = Path(log_dir) if log_dir is not None else self.root / "logs"
        self.scheduler = f"tcp://127.0.0.1:{_free_port()}"
        self.front: ServerProcess | None = None
        self.engines: list[VllmEngineServer] = [
            VllmEngineServer(
                self.model_dir,
                self.shape,
                engine_id,
                scheduler=self.scheduler,
                store_dir=self.store_dir,
                token=self.token,
                log_path=self.log_dir / f"vllm-{engine_id}.log",
            )
            for engine_id in range(len(self.shape.engine_roles))
        ]

    @property
    def url(self) -> str:
        assert self.front is not None, "caller bug: the cluster has not been started"
        return self.front.url

    def front_door_args(self) -> list[str]:
        shape = self.shape
        args = [
            "--external-engines", "--engine", "vllm", "--model", str(self.model_dir),
            "--served-model-name", SERVED_MODEL_NAME, "--nodes", shape.nodes,
            "--scheduler-endpoint", self.scheduler, "--kv-store", str(self.store_dir),
            "--mode", shape.mode, "--block-size", str(shape.block_size), "--dtype", shape.dtype,
            "--max-model-len", str(shape.max_model_len),
        ]  # fmt: skip
        if shape.heartbeat_timeout_s is not None:
            args += ["--heartbeat-timeout-s", str(shape.heartbeat_timeout_s)]
        if shape.read_path is not None:
            args += ["--read-path", shape.read_path]
        if shape.snic_gbps:
            args += ["--snic-gbps", str(shape.snic_gbps)]
        if shape.cnic_gbps:
            args += ["--cnic-gbps", str(shape.cnic_gbps)]
        return args + ["--transport", shape.transport, *shape.serve_args]

    def start(self) -> ServedCluster:
        """Start the front door and every vLLM server together; return once every engine
        has joined and every server answers."""
        self.start_front_door()
        for engine in self.engines:
            engine.launch()
        for engine in self.engines:
            engine.wait_ready(self.start_timeout_s)
        self.wait_for_engines()
        return self

    def joined(self) -> int:
        """How many engines the front door has live now (its /health)."""
        assert self.front is not None
        return httpx.get(f"{self.front.url}/health", timeout=30).json()["num_live_engines"]

    def start_front_door(self) -> None:
        self.front = ServerProcess(
            self.front_door_args(),
            log_path=self.log_dir / "serve.log",
            env={TOKEN_ENV: self.token},
        )
        self.front.launch()

    def stop_front_door(self) -> int | None:
        return None if self.front is None else self.front.stop()

    def wait_for_engines(self, timeout_s: float | None = None) -> None:
        """Until the front door's /health says every engine is live."""
        assert self.front is not None
        self.front.wait_ready(timeout_s or self.start_timeout_s)

    def kill_engine(self, engine_id: int) -> None:
        self.engines[engine_id].kill()

    def start_engine(self, engine_id: int) -> None:
        """The engine's vLLM server again (same port, same store); returns once it answers
        and has joined."""
        engine = self.engines[engine_id]
        engine.launch()
        engine.wait_ready(self.start_timeout_s)
        self.wait_for_engines()

    def stop(self) -> dict[str, int | None]:
        """Stop every server; their exit codes by ``pids()``'s labels (None: never started)."""
        exit_codes = {engine.name: engine.stop() for engine in self.engines}
        return {"front door": self.stop_front_door(), **exit_codes}

    def pids(self) -> dict[str, int]:
        """Process ids by label (for per-process CPU): the front door and each server."""
        assert self.front is not None
        pids = {"front door": self.front.pid}
        pids.update({engine.name: engine.pid for engine in self.engines})
        return pids

    def __enter__(self) -> ServedCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

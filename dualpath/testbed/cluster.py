"""A dualpath cluster spread over the test hosts, started the way an operator would. 1P2D:

    host 0: dualpath serve --external-engines --scheduler-endpoint tcp://10.77.0.1:PORT (API too)
    host 1: dualpath engine --role prefill --engine-id 0 --node-id 0
    host 2: dualpath engine --role decode  --engine-id 1 --node-id 1
    host 3: dualpath engine --role decode  --engine-id 2 --node-id 2

Given a host per engine and one more, every engine runs on a host of its own, the router on
host 0 (any shape: ``2P4D`` on 7 hosts). On four hosts ``2P2D`` puts its second prefill engine
beside the API server (engine 0 on host 0, 1 on host 1, the decode engines 2 and 3 on hosts 2
and 3). With ``restart_engines`` each ``dualpath engine`` supervises its engine (its default):
a host's engine that dies or loses the scheduler is started again there; without, it runs
``--no-restart`` and stays dead.

Each process gets ``--kv-store`` from ``store_dir_of(host)`` (its own mount of a shared volume,
or ``None`` for no store); ``extra_serve_args`` go to the router alone, ``engine_args`` to every
engine, ``common_args`` to both (the benchmarks' mode, engine kind and caps). PE<->DE KV moves
over NIXL/UCX restricted to TCP on the host's compute NIC (``UCX_TLS=tcp``,
``UCX_NET_DEVICES=dp0``): without that, UCX on one machine would take shared memory or
cross-memory attach and bypass the links the tests cut and shape.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from dualpath.config import parse_node_shape
from dualpath.testbed.hosts import HOST_DEVICE, Host

SCHEDULER_PORT = 5555
API_PORT = 8000
TOKEN = "testbed-cluster-token"  # the hosts are private to this machine
START_TIMEOUT_S = 300.0  # a hang guard, as the server tests' (tests/server/serving.py)
# One HTTP request's hang guard: a loaded 2-core machine answers late, not never.
HTTP_TIMEOUT_S = 60.0
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": HOST_DEVICE, "NIXL_LOG_LEVEL": "WARN"}


@dataclass(frozen=True, slots=True)
class EngineSpec:
    role: str
    engine_id: int
    node_id: int
    host: Host


# Shapes with more engines than hosts besides the router's: (role, host) of engine i.
_SHARED_LAYOUTS = {
    "2P2D": (("prefill", 0), ("prefill", 1), ("decode", 2), ("decode", 3)),
}


def engine_layout(hosts: Sequence[Host], nodes: str) -> list[EngineSpec]:
    """Engine i (on node i) of ``nodes``: on ``hosts[i + 1]`` when there is a host for each
    engine besides the router's ``hosts[0]``, else on a packed layout (module docstring)."""
    num_prefill, num_decode = parse_node_shape(nodes)
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    if len(hosts) > len(roles):
        placed = [(role, index + 1) for index, role in enumerate(roles)]
    elif nodes.upper() in _SHARED_LAYOUTS and len(hosts) >= 4:
        placed = list(_SHARED_LAYOUTS[nodes.upper()])
    else:
        raise ValueError(
            f"a {nodes} cluster over hosts needs {len(roles) + 1} hosts (one for the router), "
            f"got {len(hosts)}"
        )
    return [
        EngineSpec(role, engine_id, engine_id, hosts[host_index])
        for engine_id, (role, host_index) in enumerate(placed)
    ]


class MultiHostCluster:
    def __init__(
        self,
        hosts: Sequence[Host],
        *,
        model_dir: Path,
        log_dir: Path,
        store_dir_of: Callable[[Host], Path | None],
        heartbeat_timeout_s: float = 4.0,
        extra_serve_args: Sequence[str] = (),
        engine_args: Sequence[str] = (),
        common_args: Sequence[str] = (),
        nodes: str = "1P2D",
        restart_engines: bool = False,
        threads: int | None = 1,
        served_model_name: str = "tiny",
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        """``threads``: each process's ``--threads`` (None: its default); the rest: the module
        docstring."""
        self.api_host = hosts[0]
        self.nodes = nodes
        self.engines = engine_layout(hosts, nodes)
        self.restart_engines = restart_engines
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.store_dir_of = store_dir_of
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.extra_serve_args = tuple(extra_serve_args)
        self.engine_args = tuple(engine_args)
        self.common_args = tuple(common_args)
        self.threads = threads
        self.served_model_name = served_model_name
        self.start_timeout_s = start_timeout_s
        self.url = f"http://{self.api_host.address}:{API_PORT}"
        self.server: subprocess.Popen | None = None
        self.engine_id_to_process: dict[int, subprocess.Popen] = {}
        self.http = httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT_S)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> MultiHostCluster:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(httpx.HTTPError):
            self.http.get("/health")  # refused at once when nothing listens
            raise RuntimeError(f"another cluster already answers at {self.url}")
        try:
            self.server = self._popen(self.api_host, "server", self._serve_argv())
            for spec in self.engines:
                self.engine_id_to_process[spec.engine_id] = self._popen(
                    spec.host, f"engine-{spec.engine_id}", self._engine_argv(spec)
                )
            self.wait_healthy(self.start_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def engine_pid(self, engine_id: int) -> int:
        """The pid of the process that runs engine ``engine_id`` now: with ``restart_engines``
        the child of its ``dualpath engine`` (which outlives it), else that process."""
        process = self.engine_id_to_process[engine_id]
        if not self.restart_engines:
            return process.pid
        # Restarts are started from a thread of it: its children are its threads' children.
        children = [
            child
            for task in Path(f"/proc/{process.pid}/task").iterdir()
            for child in (task / "children").read_text().split()
        ]
        if len(children) != 1:
            raise RuntimeError(f"engine {engine_id}'s supervisor has children {children}")
        return int(children[0])

    def close(self) -> dict[str, int | None]:
        """SIGTERM everything, then SIGKILL what lingers; idempotent. Each process's exit code
        (``server``, ``engine-<id>``; None: never started)."""
        processes = [p for p in (self.server, *self.engine_id_to_process.values()) if p]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.http.close()
        named = {"server": self.server} | {
            f"engine-{engine_id}": process
            for engine_id, process in self.engine_id_to_process.items()
        }
        return {name: p.returncode if p else None for name, p in named.items()}

    def __enter__(self) -> MultiHostCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------

    def complete(self, prompt_token_ids: list[int], max_tokens: int, **kwargs) -> httpx.Response:
        body = {
            "model": self.served_model_name,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return self.http.post("/v1/completions", json=body, **kwargs)

    def health(self) -> dict:
        return self.http.get("/health").json()

    def metric(self, name: str) -> float:
        """The sum of a Prometheus metric's samples (every label set)."""
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.server is not None and self.server.poll() is not None:
                raise RuntimeError(f"server exited with {self.server.returncode}: {self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if self.http.get("/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not healthy in {timeout_s} s: {self.log()}")
            time.sleep(0.2)

    def log(self, name: str = "server") -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    # -- argv ----------------------------------------------------------------------------------

    def _common_args(self, host: Host) -> list[str]:
        store_dir = self.store_dir_of(host)
        store = ["--no-kv-store"] if store_dir is None else ["--kv-store", str(store_dir)]
        threads = [] if self.threads is None else ["--threads", str(self.threads)]
        return ["--model", str(self.model_dir), *store, *threads, *self.common_args]

    def _serve_argv(self) -> list[str]:
        return [
            "serve", *self._common_args(self.api_host),
            "--external-engines",
            "--scheduler-endpoint", f"tcp://{self.api_host.address}:{SCHEDULER_PORT}",
            "--host", self.api_host.address, "--port", str(API_PORT),
            "--served-model-name", self.served_model_name,
            "--nodes", self.nodes,
            "--heartbeat-timeout-s", str(self.heartbeat_timeout_s),
            *self.extra_serve_args,
        ]  # fmt: skip

    def _engine_argv(self, spec: EngineSpec) -> list[str]:
        return [
            "engine", *self._common_args(spec.host),
            "--role", spec.role,
            "--scheduler", f"tcp://{self.api_host.address}:{SCHEDULER_PORT}",
            "--engine-id", str(spec.engine_id),
            "--node-id", str(spec.node_id),
            "--heartbeat-timeout-s", str(self.heartbeat_timeout_s),
            "--restart" if self.restart_engines else "--no-restart",
            *self.engine_args,
        ]  # fmt: skip

    def _popen(self, host: Host, name: str, args: list[str]) -> subprocess.Popen:
        env = dict(os.environ, DUALPATH_CLUSTER_TOKEN=TOKEN, **UCX_ENV)
        env["DUALPATH_HOME"] = str(self.log_dir / "home")
        argv = [sys.executable, "-m", "dualpath.cli", "--log-level", "INFO", *args]
        with open(self.log_dir / f"{name}.log", "ab") as log:
            return host.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

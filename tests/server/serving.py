"""A real `dualpath serve` process for the server tests: start it, wait for /health, read its
metrics, stop it. Each test module that needs a server starts its own (``start_server``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
MODEL = "tiny"
START_TIMEOUT_S = 300  # a hang guard: 45 s to healthy on 2 cores at a load average of 10
# A hang guard per request, not a latency bound: a 1,000-token prompt on the real SmolLM2 took
# 25-30 s beside the other test worker on an AVX2-only 2-core host, and failed at 30.
REQUEST_TIMEOUT_S = 180


class Server:
    def __init__(self, process: subprocess.Popen, url: str, root: Path, health: list[int]):
        self.process = process
        self.url = url
        self.root = root
        self.health_statuses_before_ready = health  # /health statuses seen while starting
        self.http = httpx.Client(base_url=url, headers=auth(), timeout=REQUEST_TIMEOUT_S)
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_S
        )

    @property
    def log(self) -> str:
        return (self.root / "server.log").read_text()

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=REQUEST_TIMEOUT_S)  # as every other request


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def start_server(
    model_dir: Path,
    root: Path,
    *extra_args: str,
    has_engine_log_dir: bool = True,
    has_api_key: bool = True,
) -> Iterator[Server]:
    """`dualpath serve` on ``model_dir`` with its store, logs and home under ``root``; healthy
    on entry, killed (if still running) on exit. Without ``has_engine_log_dir`` the engines
    log where the server chooses (under ``root / "home"``); without ``has_api_key`` no route
    asks for ``API_KEY``."""
    port = free_port()
    argv = [
        sys.executable, "-m", "dualpath.cli", "--log-level", "INFO", "serve",
        "--model", str(model_dir),
        "--kv-store", str(root / "kv"),
        "--port", str(port),
        "--served-model-name", MODEL,
        *extra_args,
    ]  # fmt: skip
    if has_api_key:
        argv += ["--api-key", API_KEY]
    if has_engine_log_dir:
        argv += ["--engine-log-dir", str(root / "logs")]
    env = dict(os.environ, DUALPATH_HOME=str(root / "home"))
    with open(root / "server.log", "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        statuses = wait_until_healthy(process, url, root)
        yield Server(process, url, root, statuses)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_until_healthy(process: subprocess.Popen, url: str, root: Path) -> list[int]:
    statuses: list[int] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {(root / 'server.log').read_text()[-3000:]}")
        try:
            status = httpx.get(f"{url}/health", timeout=5).status_code
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        if status == 200:
            return statuses
        statuses.append(status)
        time.sleep(0.1)
    process.kill()
    raise TimeoutError(f"server not healthy: {(root / 'server.log').read_text()[-3000:]}")


def metric_values(server: Server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics").text  # no key needed
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def http_count(values: dict, route: str, status: int) -> float:
    key = ("dualpath_http_requests_total", (("route", route), ("status_code", str(status))))
    return values.get(key, 0.0)


def random_ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 5 for i in range(n)]


def child_pids(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (engines are spawned from a worker thread)."""
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


@contextmanager
def paused(*pids: int) -> Iterator[None]:
    """The processes stopped (SIGSTOP) for the block, then continued: whatever they would do
    cannot happen meanwhile, on any machine. Keep the block shorter than the server's
    heartbeat timeout, or the scheduler declares them dead."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def engine_pids(server: Server) -> dict[int, int]:
    """Engine id -> pid of the server's engine processes (from their command lines)."""
    pids = {}
    for pid in child_pids(server.process.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        pids[int(argv[argv.index(b"--engine-id") + 1])] = pid
    return pids

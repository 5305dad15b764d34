"""The engine processes one host starts: spawned with their whole config, watched, stopped.

Engine ``i`` is started as ``python -m dualpath.cli engine --config - --role R --engine-id N
--node-id M``: its ``EngineProcessConfig`` (every field of every config: ``config_to_dict``)
on stdin as JSON, the identity flags for process lists (the CLI checks they agree), and the
cluster token in its environment, never on its command line. A watcher thread per process
reaps it when it exits (no zombies) and reports its exit code at once.

    processes = EngineProcesses(token, log_dir, on_exit=coordinator.on_engine_exited)
    processes.spawn(config)
    processes.stop(timeout_s=10.0)      # after the engines were asked to shut down
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dualpath.config import EngineProcessConfig, config_to_dict

logger = logging.getLogger(__name__)

TOKEN_ENV = "DUALPATH_CLUSTER_TOKEN"


class EngineProcesses:
    def __init__(
        self, token: str, log_dir: Path | None, *, on_exit: Callable[[int, int], None]
    ) -> None:
        self.token = token
        self.log_dir = log_dir
        self._on_exit = on_exit  # (engine_id, exit_code), from the watcher thread
        self._processes: list[subprocess.Popen] = []
        self._is_stopping = threading.Event()  # exits from here on are expected

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def spawn(self, config: EngineProcessConfig) -> None:
        """Start the engine ``config`` describes, and watch it."""
        argv = [
            sys.executable, "-m", "dualpath.cli", "engine", "--config", "-",
            "--role", config.role, "--engine-id", str(config.engine_id),
            "--node-id", str(config.node_id),
        ]  # fmt: skip
        env = dict(os.environ, **{TOKEN_ENV: self.token})
        env.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent creation at INFO
        output = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = open(self.log_dir / f"engine-{config.engine_id}.log", "ab")  # noqa: SIM115
        process = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT
        )
        # An engine that dies before reading it is reported with its exit code.
        with contextlib.suppress(BrokenPipeError), process.stdin:
            process.stdin.write(json.dumps(config_to_dict(config)).encode())
        self._processes.append(process)
        self._watch(process, config.engine_id)

    def _watch(self, process: subprocess.Popen, engine_id: int) -> None:
        """Reap the engine's process when it exits and report it at once (its requests fail
        or are placed again within a loop turn, not a heartbeat timeout)."""

        def wait() -> None:
            exit_code = process.wait()
            if not self._is_stopping.is_set():
                logger.error("engine %d (pid %d) exited with %d", engine_id, process.pid, exit_code)
                self._on_exit(engine_id, exit_code)

        threading.Thread(target=wait, name=f"watch-engine-{engine_id}", daemon=True).start()

    def first_exited(self) -> subprocess.Popen | None:
        """An engine process that has exited, if any (start-up checks for one)."""
        return next((p for p in self._processes if p.poll() is not None), None)

    def log_hint(self) -> str:
        return f"; see logs in {self.log_dir}" if self.log_dir else "; pass log_dir for logs"

    def expect_exits(self) -> None:
        """The engines are being stopped: their exits are no longer reported."""
        self._is_stopping.set()

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the engines to exit (asked to already), then terminate
        those that linger, and kill those that still do after 2 s."""
        self.expect_exits()
        deadline = time.monotonic() + timeout_s
        for process in self._processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
        for process in self._processes:
            try:
                process.wait(2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

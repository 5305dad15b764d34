"""The engine processes one host starts: spawned with their whole config, watched, stopped.

Engine ``i`` is started as ``python -m dualpath.cli engine --config - --role R --engine-id N
--node-id M``: its ``EngineProcessConfig`` (every field of every config: ``config_to_dict``)
on stdin as JSON, the identity flags for process lists (the CLI checks they agree), and the
cluster token in its environment, never on its command line. A watcher thread per process
reaps it when it exits (no zombies) and reports its exit code at once.

With ``restart`` an engine that dies is started again under the same id, after a backoff that
doubles each time (1, 2, 4, ... s); it joins the running scheduler and replaces its dead self.
At most ``max_restarts`` times per engine within ``RESTART_WINDOW_S``: one that keeps dying
stays dead, and the scheduler serves on without it.

    processes = EngineProcesses(token, log_dir, on_exit=coordinator.on_engine_exited,
                                restart=True)
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
MAX_RESTARTS = 5  # per engine within RESTART_WINDOW_S
RESTART_WINDOW_S = 300.0
FIRST_BACKOFF_S = 1.0


class EngineProcesses:
    def __init__(
        self,
        token: str,
        log_dir: Path | None,
        *,
        on_exit: Callable[[int, int], None],
        restart: bool = False,
        max_restarts: int = MAX_RESTARTS,
        first_backoff_s: float = FIRST_BACKOFF_S,
    ) -> None:
        self.token = token
        self.log_dir = log_dir
        self._on_exit = on_exit  # (engine_id, exit_code), from the watcher thread
        self.restart = restart
        self.max_restarts = max_restarts
        self.first_backoff_s = first_backoff_s
        # By engine id, in start order; a restarted engine's replaces its dead self's.
        self._processes: dict[int, subprocess.Popen] = {}
        # Guards _processes and the restart records (watcher threads restart engines).
        self._lock = threading.RLock()
        self._is_stopping = threading.Event()  # exits from here on are expected
        # Per engine: when it was restarted (within RESTART_WINDOW_S), and how often in all.
        self._restart_times: dict[int, list[float]] = {}
        self.num_restarts: dict[int, int] = {}

    @property
    def pids(self) -> list[int]:
        """Of the processes started, in order (a restarted engine's last)."""
        with self._lock:
            return [p.pid for p in self._processes.values()]

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
        with self._lock:
            self._processes[config.engine_id] = process
        self._watch(process, config)

    def _watch(self, process: subprocess.Popen, config: EngineProcessConfig) -> None:
        """Reap the engine's process when it exits and report it at once (its requests fail
        or are placed again within a loop turn, not a heartbeat timeout); restart it."""
        engine_id = config.engine_id

        def wait() -> None:
            exit_code = process.wait()
            if self._is_stopping.is_set():
                return
            logger.error("engine %d (pid %d) exited with %d", engine_id, process.pid, exit_code)
            self._on_exit(engine_id, exit_code)
            backoff_s = self._restart_backoff_s(engine_id)
            if backoff_s is None:
                return
            logger.warning("restarting engine %d in %.0f s", engine_id, backoff_s)
            if self._is_stopping.wait(backoff_s):
                return
            with self._lock:  # stop() takes the processes under it: none is left behind
                if self._is_stopping.is_set():
                    return
                self.num_restarts[engine_id] = self.num_restarts.get(engine_id, 0) + 1
                self.spawn(config)

        threading.Thread(target=wait, name=f"watch-engine-{engine_id}", daemon=True).start()

    def _restart_backoff_s(self, engine_id: int) -> float | None:
        """How long to wait before restarting the engine, or None not to (restarts are off, or
        it used up its restarts within the window)."""
        if not self.restart:
            return None
        now_s = time.monotonic()
        with self._lock:
            times = [
                t for t in self._restart_times.get(engine_id, []) if now_s - t < RESTART_WINDOW_S
            ]
            if len(times) >= self.max_restarts:
                logger.error(
                    "engine %d died %d times within %.0f s: not restarted again",
                    engine_id,
                    len(times) + 1,
                    RESTART_WINDOW_S,
                )
                return None
            self._restart_times[engine_id] = [*times, now_s]
        return self.first_backoff_s * 2 ** len(times)

    def first_exited(self) -> subprocess.Popen | None:
        """An engine process that has exited, if any (start-up checks for one)."""
        with self._lock:
            return next((p for p in self._processes.values() if p.poll() is not None), None)

    def log_hint(self) -> str:
        return f"; see logs in {self.log_dir}" if self.log_dir else "; pass log_dir for logs"

    def expect_exits(self) -> None:
        """The engines are being stopped: their exits are no longer reported."""
        self._is_stopping.set()

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the engines to exit (asked to already), then terminate
        those that linger, and kill those that still do after 2 s."""
        self.expect_exits()
        with self._lock:  # no restart spawns after this
            processes = list(self._processes.values())
        deadline = time.monotonic() + timeout_s
        for process in processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
        for process in processes:
            try:
                process.wait(2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

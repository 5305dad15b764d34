"""The engine processes one host starts: spawned with their whole config, watched, stopped.

Engine ``i`` is started as ``python -m dualpath.cli engine --config - --role R --engine-id N
--node-id M``: its ``EngineProcessConfig`` (every field of every config: ``config_to_dict``)
on stdin as JSON, the identity flags for process lists (the CLI checks they agree), and the
cluster token in its environment, never on its command line. A watcher thread per process
reaps it when it exits (no zombies) and reports its exit code at once.

With ``restart`` an engine that dies is started again under the same id, after a backoff that
doubles each time (1, 2, 4, ... s); it joins the running scheduler and replaces its dead self.
What its exit code says decides (``engine_process``):

    0                     stopped on purpose (Shutdown, SIGTERM): not restarted
    2                     a configuration refused (flags, cluster token): not restarted
    EXIT_SCHEDULER_LOST   it lost the scheduler, or its transport could not start (no usable
                          network device), or its store's file system was out of reach (a
                          network mount not reconnected yet): restarted however often (backoff at most
                          MAX_BACKOFF_S), so a host cut off for a while rejoins when it is back
    any other             a crash (or a kill): at most ``max_restarts`` times per engine within
                          RESTART_WINDOW_S; one that keeps dying stays dead, and the scheduler
                          serves on without it

``dualpath serve`` supervises its local engines so; ``dualpath engine`` supervises itself so
(a parent that only restarts its one engine child), which is what brings a remote engine back.

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
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dualpath.config import EngineProcessConfig, config_to_dict
from dualpath.lifetime import ignore_stop_signals

logger = logging.getLogger(__name__)

TOKEN_ENV = "DUALPATH_CLUSTER_TOKEN"
MAX_RESTARTS = 5  # per engine within RESTART_WINDOW_S
RESTART_WINDOW_S = 300.0
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# An engine that lost the scheduler after running this long starts its backoff afresh.
STABLE_RUN_S = 60.0
# Exit codes an engine process ends with (besides 0, stopped on purpose, and a crash's).
EXIT_CONFIG_ERROR = 2  # an error the CLI names (argparse's code): flags, the cluster token
EXIT_SCHEDULER_LOST = 3  # the scheduler did not answer, went silent or declared it dead


def openmp_env(config: EngineProcessConfig, env: dict[str, str]) -> dict[str, str]:
    """OpenMP settings for one engine process (none where ``env`` already names them).

    A vLLM engine of more than one thread is pinned to cores the host's other engines use too
    (``dualpath.vllm.roles.make_vllm_role``). OpenMP's idle threads spin by default, taking those cores
    from an engine with work: ``OMP_WAIT_POLICY=PASSIVE`` makes them sleep. Measured with
    ``dualpath bench vs-vllm --threads 2``, 1P1D on 2 cores: 172 s spinning, 149 s passive
    (one vLLM instance: 101-105 s). It must be in the environment the process starts with:
    libgomp reads it once, when torch loads it. Our own engine is not pinned and not measured
    this way, so it keeps OpenMP's default."""
    engine = config.engine
    if engine.engine != "vllm" or (engine.num_threads or 1) <= 1 or "OMP_WAIT_POLICY" in env:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


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
        inherit_output: bool = False,
    ) -> None:
        """Engines log to ``log_dir``/engine-<id>.log; with neither it nor ``inherit_output``
        (to this process's stdout and stderr) their output is dropped."""
        self.token = token
        self.log_dir = log_dir
        self._on_exit = on_exit  # (engine_id, exit_code), from its supervising thread
        self.restart = restart
        self.max_restarts = max_restarts
        self.first_backoff_s = first_backoff_s
        self.inherit_output = inherit_output
        # By engine id, in start order; a restarted engine's replaces its dead self's.
        self._processes: dict[int, subprocess.Popen] = {}
        # Guards _processes and the restart records (supervising threads restart engines).
        self._lock = threading.RLock()
        self._is_stopping = threading.Event()  # exits from here on are expected
        # Per engine: when it was restarted after a crash (within RESTART_WINDOW_S), how
        # often in a row it lost the scheduler, and how often it was restarted in all.
        self._restart_times: dict[int, list[float]] = {}
        self._num_lost_in_a_row: dict[int, int] = {}
        self.num_restarts: dict[int, int] = {}
        # Engines running or waiting for their restart (``wait``: until none is).
        self._num_supervised = 0
        self._none_supervised = threading.Condition(self._lock)

    @property
    def pids(self) -> list[int]:
        """Of the processes started, in order (a restarted engine's last)."""
        with self._lock:
            return [p.pid for p in self._processes.values()]

    def spawn(self, config: EngineProcessConfig) -> None:
        """Start the engine ``config`` describes, and supervise it. Its process starts on its
        supervising thread (``_supervise``), at once unless ``stop`` came first."""
        with self._lock:
            self._num_supervised += 1
        threading.Thread(
            target=self._supervise,
            args=(config,),
            name=f"supervise-engine-{config.engine_id}",
            daemon=True,
        ).start()

    def argv(self, config: EngineProcessConfig) -> list[str]:
        """The engine's command; its config comes on stdin."""
        return [
            sys.executable, "-m", "dualpath.cli", "engine", "--config", "-",
            "--role", config.role, "--engine-id", str(config.engine_id),
            "--node-id", str(config.node_id),
            "--no-restart",  # restarted from here
        ]  # fmt: skip

    def _start(self, config: EngineProcessConfig) -> subprocess.Popen:
        argv = self.argv(config)
        env = dict(os.environ, **{TOKEN_ENV: self.token})
        env.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent creation at INFO
        env.update(openmp_env(config, env))
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            stdout = open(self.log_dir / f"engine-{config.engine_id}.log", "ab")  # noqa: SIM115
            stderr = subprocess.STDOUT
        elif self.inherit_output:
            stdout = stderr = None
        else:
            stdout = stderr = subprocess.DEVNULL
        process = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr
        )
        # An engine that dies before reading it is reported with its exit code.
        with contextlib.suppress(BrokenPipeError), process.stdin:
            process.stdin.write(json.dumps(config_to_dict(config)).encode())
        with self._lock:
            self._processes[config.engine_id] = process
        return process

    def _supervise(self, config: EngineProcessConfig) -> None:
        """Start the engine's process, reap it when it exits and report it at once (its
        requests fail or are placed again within a loop turn, not a heartbeat timeout); start
        it again while its exit codes call for it. Every start comes from this thread, which
        outlives the process: an engine dies with the thread that started it (Linux's parent
        death signal, ``lifetime.die_with_parent``, follows the thread, not the process). Not
        the caller's: started from a worker thread of a pool (``dualpath serve`` starts its
        cluster from one of anyio's), engines got SIGTERM when the pool retired that thread
        as idle."""
        with self._lock:  # stop() takes the processes under it: none is left behind
            process = None if self._is_stopping.is_set() else self._start(config)
        while process is not None:
            started_s = time.monotonic()
            exit_code = process.wait()
            if self._is_stopping.is_set():
                break
            engine_id = config.engine_id
            (logger.info if exit_code == 0 else logger.error)(
                "engine %d exited with %d", engine_id, exit_code
            )
            self._on_exit(engine_id, exit_code)
            backoff_s = self._restart_backoff_s(engine_id, exit_code, time.monotonic() - started_s)
            if backoff_s is None:
                break
            logger.warning("restarting engine %d in %.0f s", engine_id, backoff_s)
            if self._is_stopping.wait(backoff_s):
                break
            with self._lock:  # stop() takes the processes under it: none is left behind
                if self._is_stopping.is_set():
                    break
                self.num_restarts[engine_id] = self.num_restarts.get(engine_id, 0) + 1
                process = self._start(config)
        with self._lock:
            self._num_supervised -= 1
            self._none_supervised.notify_all()

    def _restart_backoff_s(self, engine_id: int, exit_code: int, ran_s: float) -> float | None:
        """How long to wait before restarting the engine, or None not to (restarts are off,
        its exit code says not to, or it used up its restarts within the window)."""
        if not self.restart or exit_code in (0, EXIT_CONFIG_ERROR):
            return None
        if exit_code == EXIT_SCHEDULER_LOST:
            with self._lock:
                num_lost = 0 if ran_s >= STABLE_RUN_S else self._num_lost_in_a_row.get(engine_id, 0)
                self._num_lost_in_a_row[engine_id] = num_lost + 1
            return min(MAX_BACKOFF_S, self.first_backoff_s * 2**num_lost)
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

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until no engine is running or waiting for its restart; False on timeout."""
        with self._lock:
            return self._none_supervised.wait_for(lambda: self._num_supervised == 0, timeout_s)

    def terminate(self, timeout_s: float) -> None:
        """SIGTERM every engine (each finishes its store writes and exits 0), then ``stop``."""
        self.expect_exits()
        with self._lock:
            processes = list(self._processes.values())
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        self.stop(timeout_s)

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


def run_supervised(config: EngineProcessConfig, token: str) -> int:
    """``dualpath engine``: the engine as a child of this process, started again as its exit
    codes call for. Returns when it stopped for good: 0 when it was told to stop (or this
    process got SIGTERM or SIGINT, passed on to it), else its last exit code."""
    exit_codes: list[int] = []
    processes = EngineProcesses(
        token,
        None,
        on_exit=lambda _engine_id, exit_code: exit_codes.append(exit_code),
        restart=True,
        inherit_output=True,
    )
    is_stopping = threading.Event()

    def stop(signum: int, frame: object) -> None:
        logger.info("signal %d: stopping engine %d", signum, config.engine_id)
        is_stopping.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    processes.spawn(config)
    while not processes.wait(timeout_s=0.2):
        if is_stopping.is_set():
            processes.terminate(timeout_s=config.store_flush_timeout_s + 5)
            ignore_stop_signals()
            return 0
    # Stopping on its own (told to stop, or given up): a SIGTERM from here on, e.g. from
    # whoever stops the host's engines, must not turn the exit code into -15.
    ignore_stop_signals()
    return exit_codes[-1] if exit_codes else 1

"""When a supervised engine is started again: what its exit code says decides."""

from __future__ import annotations

from pathlib import Path

from dualpath.cluster.engine_processes import (
    EXIT_CONFIG_ERROR,
    EXIT_SCHEDULER_LOST,
    MAX_BACKOFF_S,
    MAX_RESTARTS,
    STABLE_RUN_S,
    EngineProcesses,
    openmp_env,
)
from dualpath.config import EngineConfig, EngineProcessConfig


def _processes(*, restart: bool = True) -> EngineProcesses:
    return EngineProcesses("token", Path("/nonexistent"), on_exit=lambda *_: None, restart=restart)


def test_an_engine_stopped_on_purpose_or_misconfigured_is_not_restarted() -> None:
    processes = _processes()
    assert processes._restart_backoff_s(0, 0, ran_s=100.0) is None
    assert processes._restart_backoff_s(0, EXIT_CONFIG_ERROR, ran_s=0.5) is None
    assert _processes(restart=False)._restart_backoff_s(0, 1, ran_s=100.0) is None


def test_crashes_are_restarted_with_doubling_backoff_a_bounded_number_of_times() -> None:
    processes = _processes()
    backoffs = [processes._restart_backoff_s(7, -9, ran_s=1.0) for _ in range(MAX_RESTARTS + 1)]
    assert backoffs == [1.0, 2.0, 4.0, 8.0, 16.0, None]
    assert processes._restart_backoff_s(8, 1, ran_s=1.0) == 1.0  # per engine


def test_an_engine_that_lost_the_scheduler_is_restarted_however_often() -> None:
    processes = _processes()
    backoffs = [processes._restart_backoff_s(3, EXIT_SCHEDULER_LOST, ran_s=1.0) for _ in range(9)]
    assert backoffs == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S, 30.0, 30.0]
    # After a long enough run it starts afresh; the crash budget is untouched.
    assert processes._restart_backoff_s(3, EXIT_SCHEDULER_LOST, ran_s=STABLE_RUN_S) == 1.0
    assert processes._restart_backoff_s(3, 1, ran_s=1.0) == 1.0


def test_idle_openmp_threads_sleep_only_in_multi_threaded_vllm_engines() -> None:
    def config(engine: str, threads: int) -> EngineProcessConfig:
        return EngineProcessConfig(
            "prefill", 0, 0, "tcp://127.0.0.1:1", Path("m"),
            engine=EngineConfig(num_threads=threads, engine=engine),
        )  # fmt: skip

    assert openmp_env(config("vllm", 2), {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_env(config("vllm", 1), {}) == {}  # one thread: no idle OpenMP workers
    assert openmp_env(config("native", 2), {}) == {}
    assert openmp_env(config("vllm", 2), {"OMP_WAIT_POLICY": "ACTIVE"}) == {}  # the user's

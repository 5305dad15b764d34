"""When a supervised engine is started again: what its exit code says decides."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dualpath.cluster.engine_processes import (
    EXIT_CONFIG_ERROR,
    EXIT_SCHEDULER_LOST,
    MAX_BACKOFF_S,
    MAX_RESTARTS,
    STABLE_RUN_S,
    EngineProcesses,
    openmp_env,
)
from dualpath.config import EngineConfig, EngineProcessConfig, KVStoreConfig, config_to_dict

HANG_GUARD_S = 60.0  # only a bug waits this long


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


class _SleeperProcesses(EngineProcesses):
    """Engines that only ask for the parent death signal, as ``dualpath engine`` does, say so
    in their log, and wait."""

    def argv(self, config: EngineProcessConfig) -> list[str]:
        code = (
            "import sys, time; from dualpath.lifetime import die_with_parent; "
            "die_with_parent(); print('ready', flush=True); time.sleep(600)"
        )
        return [sys.executable, "-c", code]


def test_an_engine_outlives_the_thread_that_asked_for_it(tmp_path: Path) -> None:
    """``dualpath serve`` starts its cluster from a pool's worker thread, which the pool may
    retire; engines started from that thread got its death signal (SIGTERM) then."""
    processes = _SleeperProcesses("token", tmp_path, on_exit=lambda *_: None, restart=False)
    config = EngineProcessConfig(
        role="prefill", engine_id=0, node_id=0, scheduler_endpoint="tcp://127.0.0.1:1",
        model_dir=tmp_path, engine=EngineConfig(num_threads=1),
    )  # fmt: skip
    log = tmp_path / "engine-0.log"

    def ask() -> None:  # and stay until the engine has asked for the signal
        processes.spawn(config)
        deadline = time.monotonic() + HANG_GUARD_S
        while "ready" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "the engine never started"
            time.sleep(0.05)

    caller = threading.Thread(target=ask)
    caller.start()
    caller.join()  # the thread that asked is gone; the engine must not be
    try:
        [pid] = processes.pids
        with pytest.raises(subprocess.TimeoutExpired):  # still running a while later
            processes._processes[0].wait(timeout=2)
        assert processes.first_exited() is None, pid
    finally:
        processes.terminate(timeout_s=HANG_GUARD_S)


def _run_engine_failing_at_start(
    tiny_model_dir: Path, store_dir: Path, patch: str
) -> subprocess.CompletedProcess:
    """``run_engine`` of a decode engine in a process of its own, ``patch`` (Python run
    first, with ``engine_process`` imported) making its start fail; its exit code and output."""
    config = EngineProcessConfig(
        role="decode", engine_id=3, node_id=1, scheduler_endpoint="tcp://127.0.0.1:1",
        model_dir=tiny_model_dir, engine=EngineConfig(num_threads=1),
        store=KVStoreConfig(root_dir=store_dir),
    )  # fmt: skip
    code = (
        "import errno, json, sys\n"
        "from dualpath.cluster import engine_process\n"
        "from dualpath.config import config_from_dict, EngineProcessConfig\n"
        f"{patch}"
        "config = config_from_dict(EngineProcessConfig, json.loads(sys.stdin.read()))\n"
        "sys.exit(engine_process.run_engine(config, 'token'))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(config_to_dict(config)),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


def test_an_engine_whose_transport_cannot_start_exits_to_be_started_again(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """On a host whose link is cut, UCX finds no usable device and the NIXL agent cannot be
    created: the engine must exit as after a lost scheduler (started again until the host is
    back), not as a configuration refused (never started again)."""
    done = _run_engine_failing_at_start(
        tiny_model_dir,
        tmp_path / "kv",
        "from dualpath.errors import TransferError\n"
        "def no_device(*args, **kwargs):\n"
        "    raise TransferError(\"creating NIXL agent 'engine-3': no usable devices\")\n"
        "engine_process.create_transport = no_device\n",
    )
    assert done.returncode == EXIT_SCHEDULER_LOST, done.stderr[-2000:]
    assert "no usable devices: exiting" in done.stderr


@pytest.mark.parametrize(("errno_name", "is_restarted"), [("ENOTCONN", True), ("EACCES", False)])
def test_an_engine_whose_store_is_out_of_reach_exits_to_be_started_again(
    tiny_model_dir: Path, tmp_path: Path, errno_name: str, is_restarted: bool
) -> None:
    """A host whose network mount lost its servers (GlusterFS's FUSE client answers ENOTCONN
    until it reconnects) exits as after a lost scheduler, to be started again until the store
    is back; a store refused (no permission) stays a configuration error, never started again."""
    done = _run_engine_failing_at_start(
        tiny_model_dir,
        tmp_path / "kv",
        "from dualpath.errors import StoreWriteError\n"
        "from dualpath.kv.file_store import FileKVStore\n"
        "def unreachable(*args, **kwargs):\n"
        f"    cause = OSError(errno.{errno_name}, 'the mount says so')\n"
        "    raise StoreWriteError('cannot create store namespace') from cause\n"
        "FileKVStore.from_config = unreachable\n",
    )
    if is_restarted:
        assert done.returncode == EXIT_SCHEDULER_LOST, done.stderr[-2000:]
        assert "the KV store is out of reach" in done.stderr
    else:  # raised: the CLI names it and exits 2; run bare here, a traceback
        assert done.returncode not in (0, EXIT_SCHEDULER_LOST), done.stderr[-2000:]
        assert "StoreWriteError: cannot create store namespace" in done.stderr

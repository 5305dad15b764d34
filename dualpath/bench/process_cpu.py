"""CPU used by each process of a served cluster over a benchmark run: what binds on one host.

On one machine the server, its scheduler loop, every engine and the benchmark's own client
share the same cores, so a mode can be bound by CPU rather than by the links it emulates. A
``ProcessCpu`` reads the CPU time (user + system, all threads) of the server and every
process below it at the start and at the end of a run, and reports each one's mean cores
busy over the run, labelled by what it is (``serve``, ``prefill-0``, ``decode-1``, ...), with
the client's (this process) and the machine's core count beside them.

Processes that are not one tree (a served deployment's front door and its vLLM servers) are
measured together by name: ``ProcessCpu({"front door": pid, "vLLM server of engine 0": pid})``
labels each root by its name and each process below it ``<name>/<its process name>``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import psutil


def process_label(process: psutil.Process) -> str:
    """``prefill-<id>`` / ``decode-<id>`` for an engine process, ``serve`` for the server,
    else the executable's name and pid."""
    try:
        argv = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return f"pid-{process.pid}"
    if "engine" in argv and "--role" in argv and "--engine-id" in argv:
        return f"{_after(argv, '--role')}-{_after(argv, '--engine-id')}"
    if "serve" in argv:
        return "serve"
    return f"{os.path.basename(argv[0]) if argv else 'process'}-{process.pid}"


def _after(argv: list[str], flag: str) -> str:
    index = argv.index(flag) + 1
    return argv[index] if index < len(argv) else "?"


def _process_name(process: psutil.Process) -> str:
    """The name the process gave itself (Linux keeps 15 characters: vLLM's engine core is
    ``VLLM::EngineCor``), or its pid."""
    try:
        return process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return f"pid-{process.pid}"


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads, not its children)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _cpu_s(process: psutil.Process) -> float | None:
    """``process_cpu_s``, or None for a process that has gone or cannot be read."""
    try:
        times = process.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return times.user + times.system


class ProcessCpu:
    """Cores busy per process of the trees under ``roots`` between ``start`` and ``stop``:
    one server's pid (each process labelled by ``process_label``), or name -> pid of several
    trees (module docstring)."""

    def __init__(self, roots: int | Mapping[str, int]) -> None:
        # root pid -> its name (None: every process of its tree labelled by process_label)
        self._root_to_name: dict[int, str | None] = (
            {roots: None} if isinstance(roots, int) else {pid: name for name, pid in roots.items()}
        )
        self._start_cpu_s: dict[int, float] = {}  # pid -> CPU seconds at start
        self._start_wall_s = 0.0
        self._start_client_s = 0.0

    def _tree(self) -> list[tuple[psutil.Process, str]]:
        """Every process under the roots that is still there, with its label."""
        labelled = []
        for pid, name in self._root_to_name.items():
            try:
                root = psutil.Process(pid)
                below = root.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            if name is None:
                labelled += [(p, process_label(p)) for p in (root, *below)]
            else:
                labelled += [(root, name), *((p, f"{name}/{_process_name(p)}") for p in below)]
        return labelled

    def start(self) -> ProcessCpu:
        self._start_cpu_s = {}
        for process, _ in self._tree():
            cpu_s = _cpu_s(process)
            if cpu_s is not None:
                self._start_cpu_s[process.pid] = cpu_s
        self._start_wall_s = time.monotonic()
        self._start_client_s = time.process_time()
        return self

    def stop(self) -> dict:
        """``{"cores": {label: mean cores busy}, "total_cores", "client_cores",
        "machine_cores", "wall_s"}``. A process that started during the run counts from
        zero; one that ended during it is left out (its time cannot be read any more)."""
        wall_s = max(time.monotonic() - self._start_wall_s, 1e-9)
        cores: dict[str, float] = {}
        for process, label in self._tree():
            cpu_s = _cpu_s(process)
            if cpu_s is None:
                continue
            start_s = self._start_cpu_s.get(process.pid, 0.0)
            cores[label] = cores.get(label, 0.0) + (cpu_s - start_s) / wall_s
        client = (time.process_time() - self._start_client_s) / wall_s
        return {
            "cores": {label: round(value, 3) for label, value in sorted(cores.items())},
            "total_cores": round(sum(cores.values()) + client, 3),
            "client_cores": round(client, 3),
            "machine_cores": os.cpu_count(),
            "wall_s": round(wall_s, 3),
        }

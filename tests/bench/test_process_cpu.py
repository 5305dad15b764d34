"""Per-process CPU of a served cluster: every process under the server, labelled by role."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from dualpath.bench.process_cpu import ProcessCpu

# A parent standing for `dualpath serve` that starts one busy "engine" and one idle one,
# labelled from their command lines as the launcher writes them.
_PARENT = """
import subprocess, sys, time
busy = "import time\\nend = time.monotonic() + 30\\nwhile time.monotonic() < end: pass"
idle = "import time; time.sleep(30)"
children = [
    subprocess.Popen([sys.executable, "-c", busy, "engine", "--role", "decode", "--engine-id", "3"]),
    subprocess.Popen([sys.executable, "-c", idle, "engine", "--role", "prefill", "--engine-id", "0"]),
]
print("started", flush=True)
time.sleep(30)
"""


def test_each_process_under_the_server_reports_its_cores() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, "serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout.readline().strip() == "started"
        cpu = ProcessCpu(parent.pid).start()
        time.sleep(1.5)
        figures = cpu.stop()
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
    cores = figures["cores"]
    assert set(cores) == {"serve", "decode-3", "prefill-0"}
    # The busy loop has a core to itself most of the time; the sleepers use next to none.
    assert cores["decode-3"] > 0.2
    assert cores["prefill-0"] < 0.1 and cores["serve"] < 0.1
    assert figures["total_cores"] >= cores["decode-3"]
    assert figures["machine_cores"] >= 1 and figures["wall_s"] >= 1.5


def test_one_process_cpu_seconds_grow_with_its_work() -> None:
    import os

    from dualpath.bench.process_cpu import process_cpu_s

    before = process_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert process_cpu_s(os.getpid()) >= before + 0.1

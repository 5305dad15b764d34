"""Per-process CPU of a served cluster: every process under the server, labelled by role."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from dualpath.bench.process_cpu import ProcessCpu

# A parent standing for `dualpath serve` that starts one busy "engine" and one idle one,
# labelled from their command lines as the launcher writes them. The children share the
# test's pipes: each says "ready" once started; on a line from the test the busy one burns
# BURN_CPU_S of its own CPU time and says "burnt". CPU time, not a wall-clock spell of
# spinning, so how busy the machine is changes how long it takes, not what is measured.
BURN_CPU_S = 0.5
_PARENT = f"""
import subprocess, sys, time
busy = (
    "import os, sys, time\\nos.write(1, b'ready\\\\n')\\nsys.stdin.readline()\\n"
    "end = time.process_time() + {BURN_CPU_S}\\nwhile time.process_time() < end: pass\\n"
    "print('burnt', flush=True)\\ntime.sleep(300)"
)
idle = "import os, time; os.write(1, b'ready\\\\n'); time.sleep(300)"
children = [
    subprocess.Popen([sys.executable, "-c", busy, "engine", "--role", "decode", "--engine-id", "3"]),
    subprocess.Popen([sys.executable, "-c", idle, "engine", "--role", "prefill", "--engine-id", "0"]),
]
time.sleep(300)
"""


def test_each_process_under_the_server_reports_its_cores() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # Both children write to one pipe: each says it in one write (atomic on a pipe), and
        # the words are counted, whatever lines they land on.
        num_ready = 0
        while num_ready < 2:
            line = parent.stdout.readline()
            assert line, "a child exited before it was ready"
            num_ready += line.count("ready")
        cpu = ProcessCpu(parent.pid).start()
        parent.stdin.write("burn\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "burnt"
        figures = cpu.stop()
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
    cores = figures["cores"]
    assert set(cores) == {"serve", "decode-3", "prefill-0"}
    # Cores x wall time is CPU time: the burn's, and next to none for the sleepers (/proc
    # counts in 10 ms ticks).
    cpu_s = {label: value * figures["wall_s"] for label, value in cores.items()}
    assert cpu_s["decode-3"] >= BURN_CPU_S - 0.1
    assert cpu_s["prefill-0"] < 0.1 and cpu_s["serve"] < 0.1
    assert figures["total_cores"] >= cores["decode-3"]
    assert figures["machine_cores"] >= 1 and figures["wall_s"] >= BURN_CPU_S  # one thread burnt


def test_one_process_cpu_seconds_grow_with_its_work() -> None:
    import os

    from dualpath.bench.process_cpu import process_cpu_s

    before = process_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert process_cpu_s(os.getpid()) >= before + 0.1

"""What every benchmark result records about the machine it ran on."""

from __future__ import annotations

import os
import platform

# The widest vector extension a CPU flag names, widest first: the kernels a CPU engine runs
# (torch's, vLLM's CPU attention) dispatch on it, and two hosts that report the same model
# name (a virtual machine's "AMD EPYC") may differ here by a factor in prefill speed.
_VECTOR_FLAGS = ("avx512f", "avx2", "avx", "sve2", "sve", "asimd", "neon")


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            return file.readlines()
    except OSError:
        return []  # not Linux


def cpu_vector_isa(cpuinfo: list[str]) -> str | None:
    """The widest of ``_VECTOR_FLAGS`` that ``/proc/cpuinfo``'s lines name (x86's ``flags``,
    Arm's ``Features``); None when they name none of them."""
    flags: set[str] = set()
    for line in cpuinfo:
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    return next((flag for flag in _VECTOR_FLAGS if flag in flags), None)


def hardware_info(**versions: str) -> dict[str, object]:
    """CPU, OS and Python facts, plus any library ``versions`` the benchmark depends on."""
    cpuinfo = _cpuinfo()
    cpu_model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_vector_isa": cpu_vector_isa(cpuinfo),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        **versions,
    }


def machine_line(hardware: dict | None) -> str:
    """The machine a run's figures belong to, in one line (empty when it is not recorded):
    figures from hosts whose CPU or vector ISA differ are not comparable."""
    if not hardware:
        return ""
    isa = hardware.get("cpu_vector_isa") or "unknown"
    return (
        f"Machine: {hardware.get('cpu_model')}, {hardware.get('cpu_count')} cores, vector ISA {isa}"
    )

"""What every benchmark result records about the machine it ran on."""

from __future__ import annotations

import os
import platform


def hardware_info(**versions: str) -> dict[str, object]:
    """CPU, OS and Python facts, plus any library ``versions`` the benchmark depends on."""
    cpu_model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            cpu_model = next(
                (line.split(":", 1)[1].strip() for line in file if line.startswith("model name")),
                cpu_model,
            )
    except OSError:
        pass  # not Linux: keep platform.processor()
    return {
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        **versions,
    }

"""The scheduler is pure policy (STYLE principle 1): no torch, no numpy, no clock, no I/O,
no threads, no module-level randomness."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dualpath.scheduler

FORBIDDEN_MODULES = {
    "torch",
    "numpy",
    "time",
    "datetime",
    "random",
    "threading",
    "multiprocessing",
    "asyncio",
    "concurrent",
    "os",
    "io",
    "socket",
    "subprocess",
    "pathlib",
}


def test_importing_the_scheduler_pulls_in_neither_torch_nor_numpy():
    code = (
        "import sys, dualpath.scheduler; "
        "sys.exit(3 if {'torch', 'numpy'} & set(sys.modules) else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"dualpath.scheduler imports torch or numpy\n{result.stderr}"


def test_scheduler_modules_import_nothing_that_reads_clocks_files_or_starts_threads():
    package_dir = Path(dualpath.scheduler.__file__).parent
    for path in sorted(package_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN_MODULES, f"{path.name} imports {name}"

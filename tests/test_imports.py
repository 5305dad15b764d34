"""Import rules from STYLE.md §4: policy, metadata and config code never pull in torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = (
    "dualpath",
    "dualpath.config",
    "dualpath.errors",
    "dualpath.units",
    "dualpath.types",
    "dualpath.kv.layout",
    "dualpath.kv.hashing",
    "dualpath.kv.store",
    "dualpath.kv.block_pool",
    "dualpath.model.presets",
    "dualpath.model.identity",
    "dualpath.cli",
    "dualpath.workload",
    "dualpath.sim",
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit(3 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"{module} imports torch\n{result.stderr}"


def test_help_lists_every_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dualpath.cli", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    for command in ("make-model", "generate", "demo", "bench"):
        assert command in result.stdout

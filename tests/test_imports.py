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
    "dualpath.kv.block_file",
    "dualpath.kv.file_store",
    "dualpath.kv.block_pool",
    "dualpath.model.presets",
    "dualpath.model.identity",
    "dualpath.cli",
    "dualpath.home",
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


# Layers, lowest first: a package may import from its own layer and those before it, never
# from a later one (the engines speak the protocol; they do not know the scheduler process or
# the HTTP server).
LAYERS = {
    # Our engine knows no other engine: vLLM's adapters sit above it (``dualpath.vllm``).
    "dualpath.engine": (
        "dualpath.vllm",
        "dualpath.cluster",
        "dualpath.server",
        "dualpath.bench",
        "dualpath.sim",
    ),
    # vLLM as an engine: its roles implement the engine layer's RoleEngine, driven from above
    # (but for the parts of dualpath.vllm that sit in later layers: ``_LATER_LAYERS``).
    "dualpath.vllm": ("dualpath.cluster", "dualpath.server", "dualpath.bench", "dualpath.sim"),
    # The engine inside a user's vLLM server is a cluster engine (``dualpath engine``'s loop).
    "dualpath.vllm.served": ("dualpath.server", "dualpath.bench"),
    "dualpath.vllm.served_scheduler": ("dualpath.server", "dualpath.bench"),
    "dualpath.vllm.served_mailbox": ("dualpath.server", "dualpath.bench"),
    # The router in front of vLLM servers is part of the HTTP server.
    "dualpath.vllm.router": ("dualpath.bench", "dualpath.cli"),
    "dualpath.vllm.bench": ("dualpath.cli",),
    "dualpath.protocol": (
        "dualpath.engine",
        "dualpath.cluster",
        "dualpath.server",
        "dualpath.bench",
        "dualpath.sim",
    ),
    "dualpath.scheduler": (
        "dualpath.engine",
        "dualpath.cluster",
        "dualpath.server",
        "dualpath.bench",
        "dualpath.sim",
    ),
    # The simulator runs the scheduler's code, never the runtime's.
    "dualpath.sim": ("dualpath.engine", "dualpath.cluster", "dualpath.server"),
    # The scheduler process knows nothing of the HTTP server or the benchmarks (the group
    # leaders' protocol is the scheduler benchmark's: it imports the coordinator, not back).
    "dualpath.cluster": ("dualpath.server", "dualpath.bench"),
    # The command line builds the benchmarks' parsers; they never import it back.
    "dualpath.bench": ("dualpath.cli",),
}


# Parts of a package that sit in a later layer, with rules of their own above.
_LATER_LAYERS = {
    "dualpath.vllm": ("served.py", "served_scheduler.py", "served_mailbox.py", "router", "bench"),
}


def _imports_of(path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # ``from dualpath import cluster`` imports dualpath.cluster too.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_point_down_the_layers(package: str) -> None:
    from pathlib import Path

    import dualpath

    root = Path(dualpath.__file__).parent
    relative = Path(*package.split(".")[1:])
    files = sorted((root / relative).rglob("*.py")) if (root / relative).is_dir() else []
    files = files or [(root / relative).with_suffix(".py")]
    later = _LATER_LAYERS.get(package, ())
    files = [f for f in files if not later or f.relative_to(root / relative).parts[0] not in later]
    forbidden = LAYERS[package]
    wrong = [
        f"{path.relative_to(root)} imports {name}"
        for path in files
        for name in sorted(_imports_of(path))
        if any(name == above or name.startswith(above + ".") for above in forbidden)
    ]
    assert not wrong, "\n".join(wrong)


def test_only_dualpath_vllm_imports_vllm() -> None:
    """vLLM lives in its own venv (``make test-vllm``): everything that imports it is under
    ``dualpath/vllm/``, so the rest of the package runs without it."""
    from pathlib import Path

    import dualpath

    root = Path(dualpath.__file__).parent
    wrong = [
        f"{path.relative_to(root)} imports {name}"
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).parts[0] != "vllm"
        for name in sorted(_imports_of(path))
        if name == "vllm" or name.startswith("vllm.")
    ]
    assert not wrong, "\n".join(wrong)

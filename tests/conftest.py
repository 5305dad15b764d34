"""Shared fixtures: one generated tiny checkpoint per test run (shared by the run's xdist
workers), deterministic torch."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import HealthCheck, settings

# Hypothesis fails an example that runs over 200 ms (its default deadline) and data generation
# it finds slow (a health check): both are wall-clock bounds a loaded machine can break, and no
# property here is about speed.
settings.register_profile("dualpath", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("dualpath")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Only a vLLM that is absent skips: one that is installed but fails to import must fail the
    # tests in .venv-vllm, not skip them all. find_spec looks for the package without importing
    # it (tens of seconds), and tests `make test` deselects never get here.
    if item.get_closest_marker("vllm") and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this venv: run make test-vllm")


@pytest.fixture(scope="session", autouse=True)
def _deterministic_torch() -> None:
    # Exactness across KV paths is asserted in float32 with a fixed thread count and
    # deterministic algorithms (torch is imported lazily so torch-free tests stay torch-free).
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # Deterministic mode NaN-fills every torch.empty; the engine's 1 GiB KV cache would pay
    # for that on every construction, and every cache slot is written before it is read.
    torch.utils.deterministic.fill_uninitialized_memory = False


def shared_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Path]
) -> Path:
    """``make(models_dir)``'s checkpoint, made once per run: under xdist the first worker to
    ask writes it and the others wait for it (a file lock) instead of writing their own."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the run's folder, above every worker's own
    models_dir = root / "models"
    models_dir.mkdir(exist_ok=True)
    with FileLock(models_dir / f"{name}.lock"):
        if (models_dir / name / "config.json").is_file():
            return models_dir / name
        return make(models_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dualpath.model.make import make_model

    return shared_checkpoint(
        tmp_path_factory, "tiny", lambda models: make_model("tiny", models / "tiny", seed=0)
    )


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3.2 in miniature (MLA, MoE, sparse attention; ``presets.py``)."""
    from dualpath.model.make import make_model

    return shared_checkpoint(
        tmp_path_factory,
        "tiny-deepseek",
        lambda models: make_model("tiny-deepseek", models / "tiny-deepseek"),
    )


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3 in miniature (MLA with the 576-value entry vLLM's CPU MLA backend takes,
    MoE, no indexer; ``presets.py``)."""
    from dualpath.model.make import make_model

    return shared_checkpoint(
        tmp_path_factory,
        "tiny-deepseek-v3",
        lambda models: make_model("tiny-deepseek-v3", models / "tiny-deepseek-v3"),
    )


@pytest.fixture(params=["tiny", "tiny-deepseek"])
def each_architecture_dir(request: pytest.FixtureRequest) -> Path:
    """A dense model, then an MLA one: the KV-path guarantees hold for both cache entries."""
    fixture = {"tiny": "tiny_model_dir", "tiny-deepseek": "tiny_deepseek_dir"}[request.param]
    return request.getfixturevalue(fixture)


@pytest.fixture(scope="session")
def smollm2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default's real weights (SmolLM2-135M-Instruct from its packaged GGUF),
    converted once per test run (about 15 s) by the code that makes the default."""
    from dualpath.model.default import DEFAULT_MODEL_NAME, ensure_default_model

    path = shared_checkpoint(tmp_path_factory, DEFAULT_MODEL_NAME, ensure_default_model)
    assert path.name == DEFAULT_MODEL_NAME and (path / "config.json").is_file()
    return path
